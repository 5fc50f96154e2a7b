"""Reports of run directories: tables (`table`), figures (`figures`, `heatmap`), one long CSV
(`results`), paired bootstrap intervals (`stats`, marked in tables by `significance`), reversals of
the methods' order between datasets (`order`), read through `runs` over the items `item_sets` finds
(and the canary suite's recall files through `recall_runs`) and shown with the display names of
`names` and the styles of `palette`."""

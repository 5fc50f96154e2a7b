"""Reports of run directories: tables (`table`), figures (`figures`), one long CSV (`results`), read
through `runs` and shown with the display names of `names`."""

"""Benchmarks and profiles of the library on random-weight models: `python -m evals.bench.<name>`.

decode (tokens/s of the engine per method), throughput (the paper's Figure 3), attention (the decode
kernel, Figure 1), workload (static vs continuous batching on a queue), profile_decode (kernel times
of a decode step), profile_admission (the parts of a continuous-batching admission). `common`: the
policy and engine set-up, random prompts and the printed table they share.
"""

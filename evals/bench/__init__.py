"""Benchmarks and profiles of the library on random-weight models: `python -m evals.bench.<name>`.

decode (tokens/s of the engine per method), throughput (the paper's Figure 3), attention (the decode
kernel, Figure 1), workload (static vs continuous batching on a queue), profile_decode (kernel times
of a decode step), profile_admission (the parts of a continuous-batching admission),
profile_compression (an interval method's compression), duplicates (R-KV's duplicate search).
Studies of the decode step's parts: epilogue_cost (the fused call's attention and score passes),
scratch_store (what a scratch store costs the attention loop; TMA loads), weight_matmuls (the
weight GEMMs, separate or concatenated, cuBLAS or autotuned), compile_options (the compiled step
under other Inductor options). `common`: the policy and engine set-up, random prompts and the
printed table they share.
"""

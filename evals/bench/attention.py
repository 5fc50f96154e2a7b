"""Latency of one decode attention call per method: the LongFlow paper's Figure 1, and the grid.

    python -m evals.bench.attention [--batches 1 16 64 128] [--slots 1024 3200 8192] [--out results/]
    python -m evals.bench.attention --quick      # batches 1 and 128 at 3200 slots
    python -m evals.bench.attention --sweep      # time LaunchConfig variants of the fused kernel
    python -m evals.bench.attention --sweep-step --batches 1   # ... of vanilla's one-launch step
    python -m evals.bench.attention --replot results/fig1.csv   # redraw fig1.png from a CSV (CPU)
    ncu --nvtx --nvtx-include profile/ -o R python -m evals.bench.attention --nvtx --batches 128 --slots 3200
                                                 # one call of each method for Nsight Compute

Methods, on the same random cache at Qwen3-8B shapes (32 query heads, 8 KV heads, head dim 128, bf16):
  - `sdpa`: `F.scaled_dot_product_attention` with `enable_gqa` and no mask, under the flash backend
    when it accepts the call (the backend used is recorded): the attention floor of a full cache.
  - `sdpa_packed`: the same attention with the G query heads of each KV head passed as G queries
    (`[B, Hkv, G, D]`), the usual GQA decode formulation.
  - `sdpa_cudnn`: `sdpa_packed` under the cuDNN backend, when it accepts the call. Ratios
    (`x_sdpa`) are to the fastest of the SDPA rows.
  - `h2o`: `longflow.attention.decode_attention` plus what H2O adds per step: the probabilities
    summed over each KV head's group, added into a running `[B, Hkv, S]` float32 score, and the
    next slot by the selection rule of every method (`longflow.selection.choose_next`).
  - `longflow_fused`: `longflow.kernels.longflow_attention` as it chooses: the Triton call, or where
    `longflow.kernels.onchip.tiling` expects it faster the on-chip pass (the CSV's backend `gluon`).
  - `longflow_reference`: its plain PyTorch reference.
  - `flash_decode`: vanilla's decode attention (`longflow.kernels.flash_decode`), every slot filled.
Timed only when named in `--methods` (not in Figure 1): vanilla's whole step of one layer at a full
cache, the token written at the last slot (where a row that has filled its cache keeps writing)
and the attention over the slots before it and the token, as
  - `vanilla_step`: the slot-write kernel, `flash_decode` and its combine (three launches), or
  - `vanilla_step_one_launch`: `longflow.kernels.append_decode` (one launch; `method.one_launch`).
The policies see about 3% invalid slots (left padding). Timing: the calls of one method on several
input sets (enough sets to hold over 3x the L2 cache, so each replay reads from memory, as a real
decode step does) are captured in one CUDA graph; the time per call is the median over graph
replays divided by the number of sets. The graph removes the host's launch cost, as the engine's
graph-captured decode step does. Next to each time: the memory floor, the bytes of K, V and the
mask read once over the device-to-device copy bandwidth measured in the same run.

Imports neither Hydra nor datasets: it runs on a bare GPU machine with torch and triton.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from evals.bench.common import require_cuda, run
from longflow.attention import decode_attention
from longflow.kernels import reference
from longflow.selection import choose_next

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
DTYPE = torch.bfloat16
METHODS = ("sdpa", "sdpa_packed", "sdpa_cudnn", "h2o", "longflow_fused", "longflow_reference", "flash_decode")
KERNELS = ("longflow_fused", "flash_decode")  # the project's kernels, each shown as a ratio to the best SDPA
STEPS = ("vanilla_step", "vanilla_step_one_launch")  # timed on request only
FIGURE_POINT = (128, 3200)  # the paper's Figure 1: batch 128, 3200 slots
ROTATION_BYTES = 192 * 2**20  # input sets per timing hold at least this much (H200 L2: 60 MB)
REPLAYS = 30
ROUNDS = 5  # turns of the methods' replays at one grid point (`interleaved_ms`)


def median_ms(fn) -> float:
    """Median of `triton.testing.do_bench` (L2 flushed before each call): host launch cost included."""
    import triton.testing

    fn()  # compile / warm up outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def captured(calls) -> torch.cuda.CUDAGraph:
    """`calls` (one per input set) captured in one CUDA graph, after a warm-up outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture, as PyTorch advises
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Milliseconds of each of `replays` replays of `graph`."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def graph_ms(calls, replays: int = REPLAYS) -> float:
    """Median time of one call: `calls` (one per input set) captured in one CUDA graph and replayed."""
    return statistics.median(replay_ms(captured(calls), replays)) / len(calls)


def interleaved_ms(methods: dict[str, list], rounds: int = ROUNDS, replays: int = REPLAYS) -> dict[str, float]:
    """`graph_ms` of several methods (name -> calls, one per input set), their replays taken in turns:
    `rounds` rounds of `replays // rounds` replays each. Timed one after the other, a method's time
    depends on what ran before it (the same kernel measured 1.00x cuDNN right after it and 1.12x after
    the eager reference, longflow/kernels/NOTES.md), and such drift would go into the ratios."""
    graphs = {name: captured(calls) for name, calls in methods.items()}
    return {name: ms / len(methods[name]) for name, ms in replays_in_turns_ms(graphs, rounds, replays).items()}


def against_cudnn(sets: list[tuple], methods: dict[str, list]) -> str:
    """`methods` (name -> calls, one per input set of `sets`) timed in turns beside cuDNN's SDPA,
    `flash_decode` and the library's fused call as it chooses, as "cuDNN <ms> ms; x cuDNN: <name>
    <ratio>, ..." (the sweeps' one line a point)."""
    baselines = {name: [method_calls(name, *s)[0] for s in sets] for name in ("sdpa_cudnn", "flash_decode",
                                                                              "longflow_fused")}
    times = interleaved_ms(baselines | methods)
    cudnn = times.pop("sdpa_cudnn")
    return f"cuDNN {cudnn:.4f} ms; x cuDNN: " + ", ".join(f"{name} {ms / cudnn:.3f}" for name, ms in times.items())


def replays_in_turns_ms(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int = ROUNDS,
                        replays: int = REPLAYS) -> dict[str, float]:
    """Median replay of each graph (name -> graph), `rounds` rounds of `replays // rounds` each in turns."""
    samples = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            samples[name] += replay_ms(graph, max(1, replays // rounds))
    return {name: statistics.median(samples[name]) for name in graphs}


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def make_cache(batch: int, slots: int, device: torch.device, seed: int = 0):
    """Random q `[B, Hq, D]`, k, v `[B, Hkv, S, D]`, and valid `[B, S]` with up to 6% left padding."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(batch, KV_HEADS, slots, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(batch, KV_HEADS, slots, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    pad = torch.randint(0, max(1, slots * 6 // 100), (batch,), generator=gen, device=device)
    valid = torch.arange(slots, device=device)[None, :] >= pad[:, None]
    return q, k, v, valid


def cache_sets(batch: int, slots: int, device: torch.device) -> list[tuple]:
    """Enough independent input sets that one pass over them overflows the L2 cache."""
    count = max(1, min(64, math.ceil(ROTATION_BYTES / floor_bytes(batch, slots))))
    return [make_cache(batch, slots, device, seed) for seed in range(count)]


def sdpa_call(q, k, v, packed: bool = False, backend: str = "flash"):
    """`(call, backend name)`: SDPA under `backend` (flash or cudnn) if it takes the call, else the default.

    `packed`: the G query heads of a KV head passed as G queries of that head (`[B, Hkv, G, D]`),
    the GQA decode formulation that reads each K/V slot once; otherwise `[B, Hq, 1, D]` with
    `enable_gqa`, which leaves the sharing of K/V between query heads to the kernel.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if packed:
        batch, q_heads, head_dim = q.shape
        q4 = q.view(batch, KV_HEADS, q_heads // KV_HEADS, head_dim)  # [B, Hkv, G, D]

        def plain():
            return F.scaled_dot_product_attention(q4, k, v)
    else:
        q4 = q[:, :, None]  # [B, Hq, 1, D]

        def plain():
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def call():
        with sdpa_kernel(chosen):
            return plain()

    try:
        call()
        return call, backend
    except RuntimeError:
        return plain, "default"


def h2o_call(q, k, v, valid):
    """H2O's decode step: attention with probabilities, accumulated per KV head, and the argmin."""
    received = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)  # [B, Hkv, S]
    valid3d = valid[:, None, :]
    scale = HEAD_DIM**-0.5

    def step():
        out, probs = decode_attention(q, k, v, valid3d, scale)  # probs [B, Hkv, G, S]
        received.add_(probs.sum(dim=2))
        next_slot = choose_next(received, valid3d)
        return out, next_slot

    return step


def vanilla_step_call(q, k, v, valid, one_launch: bool, config=None):
    """Vanilla's step of one layer (`STEPS`): every call writes its token at the last slot, where next_slot
    stays, so that each call reads the same bytes (the three launches read up to next_slot, the slots
    before the token; one launch those and the token, from registers)."""
    from longflow.kernels import append_decode, flash_decode, write_token

    batch, kv_heads, slots, _ = k.shape
    device, scale = k.device, HEAD_DIM**-0.5
    valid3d = valid[:, None, :].expand(batch, kv_heads, slots).contiguous()
    positions = torch.zeros(batch, kv_heads, slots, dtype=torch.long, device=device)
    next_slot = torch.full((batch, kv_heads), slots - 1, dtype=torch.long, device=device)
    token_positions = torch.full((batch,), slots - 1, dtype=torch.long, device=device)
    new_k, new_v = k[:, :, -1:].clone(), v[:, :, -1:].clone()
    arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
    if one_launch:
        return lambda: append_decode(q, new_k, new_v, k, v, valid3d, positions, next_slot, token_positions, arrivals,
                                     scale, config=config)

    def step():
        write_token(k, v, valid3d, positions, next_slot, new_k, new_v, token_positions, advance=True)
        return flash_decode(q, k, v, valid3d[:, 0], next_slot[:, 0], scale, config=config)

    return step


def floor_bytes(batch: int, slots: int) -> int:
    """K and V read once, the mask once, q read and out written."""
    return 2 * batch * KV_HEADS * slots * HEAD_DIM * 2 + batch * slots + 2 * batch * Q_HEADS * HEAD_DIM * 2


def method_calls(method: str, q, k, v, valid):
    """`(call, backend)` of one method on one input set."""
    from longflow.kernels import flash_decode, longflow_attention
    from longflow.kernels.longflow_attention import call_config

    scale = HEAD_DIM**-0.5
    if method.startswith("sdpa"):
        return sdpa_call(q, k, v, packed=method != "sdpa", backend="cudnn" if method == "sdpa_cudnn" else "flash")
    if method == "flash_decode":
        filled = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
        return (lambda: flash_decode(q, k, v, valid, filled, scale)), "triton"
    if method in STEPS:
        return vanilla_step_call(q, k, v, valid, one_launch=method == "vanilla_step_one_launch"), "triton"
    if method == "h2o":
        return h2o_call(q, k, v, valid), "torch"
    if method == "longflow_fused":  # the library's choice: the Triton call or the on-chip pass (Gluon)
        return (lambda: longflow_attention(q, k, v, valid, scale)), "gluon" if call_config(q, k, v).onchip else "triton"
    return (lambda: reference(q, k, v, valid, scale)), "torch"


def measure_point(batch: int, slots: int, methods, bandwidth: float, device: torch.device) -> list[dict]:
    """One grid point: every method on the same caches."""
    sets = cache_sets(batch, slots, device)
    floor_ms = floor_bytes(batch, slots) / bandwidth * 1e3
    calls = {method: [method_calls(method, *inputs) for inputs in sets] for method in methods}
    backends = {method: pairs[0][1] for method, pairs in calls.items()}
    times = interleaved_ms({method: [call for call, _ in pairs] for method, pairs in calls.items()})
    del calls
    # The ratio is to the fastest SDPA formulation and backend: the stricter comparison.
    sdpa_ms = min(ms for m, ms in times.items() if m.startswith("sdpa")) if "sdpa" in times else None
    return [
        dict(batch=batch, slots=slots, method=method, backend=backends[method], ms=round(ms, 5),
             floor_ms=round(floor_ms, 5), x_floor=round(ms / floor_ms, 3),
             x_sdpa=round(ms / sdpa_ms, 3) if sdpa_ms else None,
             copy_tb_s=round(bandwidth / 1e12, 3), input_sets=len(sets), timer="cuda_graph")
        for method, ms in times.items()
    ]


def run_grid(batches, slot_counts, methods, device) -> list[dict]:
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write, {torch.cuda.get_device_name(device)})")
    rows = []
    for batch, slots in itertools.product(batches, slot_counts):
        point = measure_point(batch, slots, methods, bandwidth, device)
        rows += point
        # the grid takes minutes: each point's times as it comes, kept if the run stops before the table
        times = [f"{row['method']} {row['ms']:.4f} ms" + (f" ({row['x_sdpa']:.3f}x)" if row["x_sdpa"] else "")
                 for row in point]
        print(f"batch {batch}, {slots} slots: " + ", ".join(times), flush=True)
        torch.cuda.empty_cache()
    return rows


def nvtx_calls(batches, slot_counts, methods, device, warmups: int = 3) -> None:
    """One call of each method at each point inside the NVTX range `profile` (the method's name and the
    point in a range nested in it), after `warmups` calls outside it, for a profiler that records
    that range alone (`ncu --nvtx --nvtx-include profile/`; Nsight Compute flushes the caches
    before each kernel it profiles, so each kernel reads its inputs from memory there)."""
    for batch, slots in itertools.product(batches, slot_counts):
        q, k, v, valid = make_cache(batch, slots, device)
        for method in methods:
            call, _ = method_calls(method, q, k, v, valid)
            for _ in range(warmups):
                call()
            torch.cuda.synchronize()
            with torch.cuda.nvtx.range("profile"), torch.cuda.nvtx.range(f"{method} {batch}x{slots}"):
                call()
                torch.cuda.synchronize()
            print(f"{method} at batch {batch}, {slots} slots: one call in the NVTX range 'profile'", flush=True)
        torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    methods = list(dict.fromkeys(row["method"] for row in rows))
    points = list(dict.fromkeys((row["batch"], row["slots"]) for row in rows))
    by_key = {(row["batch"], row["slots"], row["method"]): row for row in rows}
    kernels = [m for m in KERNELS if m in methods] if "sdpa" in methods else []
    titles = {"longflow_fused": "fused/best sdpa", "flash_decode": "flash_decode/best sdpa"}
    header = f"{'batch':>5} {'slots':>5} {'floor ms':>9} " + " ".join(f"{m:>18}" for m in methods)
    header += "".join(f" {titles[m]:>22}" for m in kernels)
    print(header)
    for batch, slots in points:
        first = by_key[(batch, slots, methods[0])]
        line = f"{batch:>5} {slots:>5} {first['floor_ms']:>9.4f} "
        line += " ".join(f"{by_key[(batch, slots, m)]['ms']:>18.4f}" for m in methods)
        line += "".join(f" {by_key[(batch, slots, m)]['x_sdpa']:>22.3f}" for m in kernels)
        print(line)
    sdpa_backends = {row["backend"] for row in rows if row["method"].startswith("sdpa")}
    if sdpa_backends:
        print(f"sdpa backend: {', '.join(sorted(sdpa_backends))}; ms per call, median of CUDA-graph replays")


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    """Panel 1: H2O vs LongFlow at the Figure 1 point (or the nearest measured); panel 2: fused/SDPA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    points = list(dict.fromkeys((row["batch"], row["slots"]) for row in rows))
    point = min(points, key=lambda p: (abs(p[0] - FIGURE_POINT[0]), abs(p[1] - FIGURE_POINT[1])))
    at_point = {row["method"]: row["ms"] for row in rows if (row["batch"], row["slots"]) == point}
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw=dict(width_ratios=[1.3, 2]))
    names = {"h2o": "H2O", "longflow_fused": "LongFlow\n(fused)", "flash_decode": "flash_decode\n(vanilla)",
             "sdpa": "SDPA flash\n(no eviction)", "sdpa_packed": "SDPA flash\n(GQA packed)",
             "sdpa_cudnn": "SDPA cuDNN\n(GQA packed)"}
    palette = {"h2o": "tab:gray", "longflow_fused": "tab:red", "flash_decode": "tab:orange", "sdpa": "tab:blue",
               "sdpa_packed": "tab:cyan", "sdpa_cudnn": "tab:purple"}
    if any(row["backend"] == "gluon" for row in rows
           if row["method"] == "longflow_fused" and (row["batch"], row["slots"]) == point):
        names["longflow_fused"] = "LongFlow\n(fused, on chip)"  # the Gluon pass, not the Triton call
    labels = [m for m in names if m in at_point]
    bars = axes[0].bar([names[m] for m in labels], [at_point[m] for m in labels], color=[palette[m] for m in labels])
    axes[0].bar_label(bars, fmt="%.3f", fontsize=7)
    axes[0].tick_params(axis="x", labelsize=7)
    axes[0].set_ylabel("latency of one decode attention call (ms)")
    axes[0].set_title(f"batch {point[0]}, {point[1]} KV slots, Qwen3-8B shapes")

    ratios = {(row["method"], row["batch"], row["slots"]): row["x_sdpa"] for row in rows
              if row["method"] in KERNELS and row.get("x_sdpa")}
    if ratios:
        kernels = [m for m in KERNELS if any(key[0] == m for key in ratios)]
        slot_counts = sorted({s for _, _, s in ratios})
        batches = sorted({b for _, b, _ in ratios})
        width = 0.8 / (len(slot_counts) * len(kernels))
        # Outlined: the points where LongFlow's call took the on-chip pass (Gluon) instead of the Triton call.
        on_chip = {(row["batch"], row["slots"]) for row in rows
                   if row["method"] == "longflow_fused" and row.get("backend") == "gluon"}
        for i, (slots, kernel) in enumerate(itertools.product(slot_counts, kernels)):
            values = [ratios.get((kernel, b, slots), 0) for b in batches]
            edges = ["black" if kernel == "longflow_fused" and (b, slots) in on_chip else "white" for b in batches]
            axes[1].bar([x + i * width for x in range(len(batches))], values, width,
                        color=f"C{slot_counts.index(slots)}", hatch="//" if kernel == "flash_decode" else None,
                        edgecolor=edges, label=f"{slots} slots" if kernel == kernels[0] else None)
        axes[1].axhline(1.1, color="k", linestyle="--", linewidth=1, label="1.1x target")
        axes[1].set_xticks([x + width * (len(slot_counts) * len(kernels) - 1) / 2 for x in range(len(batches))])
        axes[1].set_xticklabels([f"batch {b}" for b in batches])
        axes[1].set_ylabel("kernel time / fastest SDPA")
        hatched = " and flash_decode (hatched)" if "flash_decode" in kernels else ""
        axes[1].set_title(f"LongFlow fused{hatched} over the fastest SDPA, every grid point", fontsize=9)
        axes[1].set_ylim(0, max(1.3, 1.15 * max(ratios.values())))
        handles, _ = axes[1].get_legend_handles_labels()
        if on_chip:
            handles.append(Patch(facecolor="none", edgecolor="black", label="LongFlow on chip"))
        axes[1].legend(handles=handles, fontsize=8, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def heuristic_config(batch: int, slots: int, device: torch.device, scored: bool = True):
    """The Triton call's own `LaunchConfig` at this shape on `device`, the point the sweeps vary around
    (never the on-chip pass, which `default_config` is asked for only where the inputs allow it);
    `scored` False: vanilla's decode pass's (`flash_decode`, `append_decode`), which splits elsewhere."""
    from longflow.kernels.longflow_attention import _l2_bytes, _multiprocessors, default_config

    return default_config(batch, KV_HEADS, Q_HEADS, slots, HEAD_DIM, _multiprocessors(device), _l2_bytes(device),
                          scored=scored)


def sweep_point(batch: int, slots: int, device: torch.device) -> None:
    """Times LaunchConfig variants at one shape, one parameter at a time around the heuristic."""
    from dataclasses import replace

    from longflow.kernels.longflow_attention import _run

    sets = cache_sets(batch, slots, device)
    scale = HEAD_DIM**-0.5
    sdpa_ms = min(graph_ms([sdpa_call(q, k, v, packed, backend)[0] for q, k, v, _ in sets])
                  for packed, backend in ((False, "flash"), (True, "cudnn")))  # the faster, as the grid's ratio
    base = heuristic_config(batch, slots, device)
    other = "fp16" if base.scratch == "fp32" else "fp32"
    variants = [base, replace(base, scratch=other), replace(base, l2_hints=False)]
    variants += [replace(base, block_n=32), replace(base, block_n=32, scratch=other)]
    variants += [replace(base, score_splits=base.score_splits * 2), replace(base, scratch=other,
                                                                           score_splits=base.score_splits * 2)]
    variants += [replace(base, splits=base.splits * 2), replace(base, splits=max(1, base.splits // 2))]
    variants += [replace(base, block_s=base.block_s // 2), replace(base, block_s=base.block_s * 2),
                 replace(base, score_warps=8)]
    variants += [replace(base, score_splits=max(1, base.score_splits // 2)),
                 replace(base, score_splits=max(1, base.score_splits // 4))]
    variants += [replace(base, num_stages=base.num_stages - 1), replace(base, num_stages=base.num_stages + 1),
                 replace(base, num_warps=8), replace(base, block_n=128, num_warps=8),
                 replace(base, block_n=32, num_stages=base.num_stages + 2), replace(base, splits=base.splits * 3)]
    for config in dict.fromkeys(variants):
        full = graph_ms([lambda c=config, i=inputs: _run(*i, scale, None, c) for inputs in sets])
        attn = graph_ms([lambda c=config, i=inputs: _run(*i, scale, None, c, attention_only=True) for inputs in sets])
        print(f"{batch:>5} {slots:>5} {sdpa_ms:>8.4f} {full:>8.4f} {attn:>8.4f} {full / sdpa_ms:>7.3f}  {config}",
              flush=True)
    torch.cuda.empty_cache()


def sweep(device: torch.device, points) -> None:
    print(f"{'batch':>5} {'slots':>5} {'sdpa':>8} {'ms':>8} {'attn':>8} {'x_sdpa':>7}  config")
    for batch, slots in points:
        sweep_point(batch, slots, device)


def step_sweep(device: torch.device, points) -> None:
    """Times `append_decode`'s launch configurations (`vanilla_step_one_launch`) at each shape against the
    three launches under the heuristic's, each configuration and the three launches in turns."""
    from dataclasses import replace

    print(f"{'batch':>5} {'slots':>5} {'three':>8} {'one':>8} {'x_three':>7}  config")
    for batch, slots in points:
        sets = cache_sets(batch, slots, device)
        base = heuristic_config(batch, slots, device, scored=False)
        variants = [base, *(replace(base, splits=max(1, base.splits * n // 4)) for n in (1, 2, 8)),
                    replace(base, block_n=32), replace(base, block_n=128), replace(base, num_warps=2),
                    replace(base, num_warps=8), replace(base, num_stages=2)]
        for config in dict.fromkeys(variants):
            times = interleaved_ms({
                "three": [vanilla_step_call(*inputs, one_launch=False) for inputs in sets],
                "one": [vanilla_step_call(*inputs, one_launch=True, config=config) for inputs in sets]})
            print(f"{batch:>5} {slots:>5} {times['three']:>8.4f} {times['one']:>8.4f} "
                  f"{times['one'] / times['three']:>7.3f}  {config}", flush=True)
        torch.cuda.empty_cache()


def read_csv(path: Path) -> list[dict]:
    """Rows of a `fig1.csv` with their numbers parsed (for `--replot`)."""
    numbers = {"batch": int, "slots": int, "input_sets": int, "ms": float, "floor_ms": float,
               "x_floor": float, "x_sdpa": float, "copy_tb_s": float}
    with path.open() as handle:
        return [{key: numbers[key](value) if key in numbers and value else value or None
                 for key, value in row.items()} for row in csv.DictReader(handle)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--slots", type=int, nargs="+", default=[1024, 3200, 8192])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + STEPS)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true", help="batches 1 and 128 at 3200 slots only")
    parser.add_argument("--sweep", action="store_true", help="time launch-config variants instead")
    parser.add_argument("--sweep-step", action="store_true",
                        help="time launch-config variants of vanilla's one-launch step against its three launches")
    parser.add_argument("--nvtx", action="store_true",
                        help="time nothing: one call of each method in the NVTX range 'profile', for ncu")
    parser.add_argument("--replot", type=Path, metavar="CSV",
                        help="redraw the figure (next to the CSV) and the table from a fig1.csv; no GPU needed")
    args = parser.parse_args(argv)
    if args.replot:
        rows = read_csv(args.replot)
        plot(rows, args.replot.with_suffix(".png"))
        print(f"wrote {args.replot.with_suffix('.png')}")
        print_table(rows)
        return
    require_cuda("evals.bench.attention")
    device = torch.device("cuda")
    if args.quick:
        args.batches, args.slots = [1, 128], [3200]
    if args.nvtx:
        nvtx_calls(args.batches, args.slots, args.methods, device)
        return
    if args.sweep or args.sweep_step:
        (step_sweep if args.sweep_step else sweep)(device, list(itertools.product(args.batches, args.slots)))
        return
    if "sdpa" not in args.methods:
        args.methods.insert(0, "sdpa")  # every ratio is to SDPA
    rows = run_grid(args.batches, args.slots, args.methods, device)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "fig1.csv")
    plot(rows, args.out / "fig1.png")
    print(f"wrote {args.out / 'fig1.csv'} and {args.out / 'fig1.png'}")
    print_table(rows)


if __name__ == "__main__":
    run(main)

"""Decode throughput against batch size, and the largest batch each method fits: the LongFlow paper's Figure 3.

    python -m evals.bench.throughput                     # Qwen3-8B, prompt 512, 8192 new tokens, six methods
    python -m evals.bench.throughput --methods vanilla,longflow --batches 16,64 --new 2048
    python -m evals.bench.throughput --validate --methods vanilla,longflow --batches 64 --new 2048 --budget 512
    python -m evals.bench.throughput --replot results/fig3.csv    # redraw fig3.png from the CSV (CPU)

The model is built from `conf/model/<name>.yaml` with random weights and fed random prompts of
`--prompt` tokens; EOS is ignored, so every row generates `--new` tokens. The compressing methods
run at `--budget` slots, by default `--budget-fraction` (20%) of prompt + new tokens rounded to a
multiple of 16. Writes `fig3.csv` (one row per method and batch that fits) and `fig3.png`. The
model and method configs are composed by Hydra (`evals.configs`): install hydra-core where the GPU
image lacks it. An interval method's compressions have columns of their own:
`compressions` (over the output), `compression_ms` (what one adds to its step, the mean over the
`compressions_timed` that fell in the timed windows), `compressions_ms_total` (their product) and
`compressions_share` (of the output's time).

Throughput of a batch without decoding all its steps. A decode step's cost depends on how full the
cache is (vanilla reads every filled slot; a compressing method grows until its budget is full,
then holds steady, and an interval method adds a compression every few steps), not on what the
slots hold: random weights already make the tokens meaningless. So the batch is allocated and
prefilled as `Engine.generate` does, its first decode step runs eagerly and the step is captured
as a CUDA graph; then, at a few steps s along the output (`--points` evenly spaced, plus the first
step at which the budget is full or the first compression), `fast_forward` sets the cache to the
occupancy the real run has before step s and `--steps` graph replays are timed, each with the
policy's host hooks (compressions included), as the engine runs them. Fast-forwarding marks the
slots a row holds at step s as valid (the lowest ones, with the newest positions), points the next
slot at the first free one, sets the host's count of held slots of interval methods and the decode
state's positions and output index; K/V and per-slot scores keep whatever they hold. It lives in
this benchmark alone: the library's decode path is the one `generate` runs. The time of the output
is then the setup (allocation, prefill, first token) + the eager step + the capture + the sum over
every later step of the step time interpolated linearly between the timed points + one measured
compression cost per compression the policy's schedule makes (`schedule`); an interval method's first
compression of a batch runs once untimed before the windows (kernel compilation, the allocator's
first blocks). `--validate` compares this estimate with the wall time of a full `Engine.generate` at
the same setting.

The largest batch. The engine allocates every cache buffer when a batch starts (`new_cache`), so
allocation, prefill (whose activations are the largest transients) and a few decode steps with the
graph capture reach the memory peak of the whole run; the one allocation a later step adds, an
interval method's compression temporaries, is reached by timing the first compression step. Each
measurement is therefore also the test of whether a batch fits: torch.OutOfMemoryError means it
does not. The list `--batches` is measured first; then `largest_fitting` searches from the batch
that the peaks measured so far predict (memory is affine in the batch), by doubling then bisection,
to within `--tolerance` rows. Memory is freed between trials (gc + `torch.cuda.empty_cache`).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evals.bench.common import bench_engine, bench_model, method_policy, random_prompts, run
from evals.names import METHOD_NAMES, method_rank, model_name
from longflow.config import GenerationConfig
from longflow.engine import DecodeState, Engine, StepTimer, synchronize
from longflow.errors import out_of_memory
from longflow.policy import ALIGN, KVPolicy
from longflow.selection import first_free

PAPER_METHODS = ("vanilla", "streaming", "h2o", "vatp", "rkv", "longflow")


@dataclass(frozen=True)
class Setting:
    """One figure's setting: lengths, the compressing methods' budget, and what is timed per batch."""

    prompt: int
    new_tokens: int
    budget: int
    steps: int = 8  # decode steps timed at each point
    points: int = 5  # evenly spaced points along the output (plus the step at which the budget is full)

    @property
    def generation(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.new_tokens, ignore_eos=True)


def default_budget(prompt: int, new_tokens: int, fraction: float) -> int:
    """`fraction` of the full length, rounded to a multiple of ALIGN (at least ALIGN)."""
    return max(ALIGN, round(fraction * (prompt + new_tokens) / ALIGN) * ALIGN)


# ---- the largest batch ---------------------------------------------------------------------------

def largest_fitting(fits: Callable[[int], bool], start: int, step: int, tolerance: int = 1,
                    limit: int | None = None) -> tuple[int, int | None]:
    """The largest batch for which `fits` holds, `fits` being monotone (what fits, every smaller batch fits).

    Doubling: from `start`, up by `step`, 2 `step`, 4 `step`... while batches fit (with `step` =
    `start` the batch doubles), or down by the same strides while they do not (at least to 1);
    then bisection between the largest fit and the smallest failure until they are at most
    `tolerance` apart. Returns (the largest batch found to fit, 0 if none; the smallest found not
    to, None if `limit` fits).
    """
    stride = step
    if fits(start):
        fit = start
        while True:
            probe = fit + stride if limit is None else min(fit + stride, limit)
            if probe == fit:
                return fit, None
            if not fits(probe):
                fail = probe
                break
            fit, stride = probe, stride * 2
    else:
        fail = start
        while True:
            if fail == 1:
                return 0, 1
            probe = max(1, fail - stride)
            if fits(probe):
                fit = probe
                break
            fail, stride = probe, stride * 2
    while fail - fit > tolerance:
        middle = (fit + fail) // 2
        if fits(middle):
            fit = middle
        else:
            fail = middle
    return fit, fail


def search_start(peaks: dict[int, int], capacity: int | None, step: int) -> tuple[int, int]:
    """(start, step) of the search from the measured peak bytes `{batch: bytes}` of the batches that
    fit: where the line through the two largest batches reaches `capacity` bytes, searched by `step`;
    with fewer points or no capacity (the CPU), from the largest batch that fits, doubling it."""
    batches = sorted(peaks)
    if capacity is None or len(batches) < 2 or peaks[batches[-1]] <= peaks[batches[-2]]:
        return batches[-1], batches[-1]
    small, large = batches[-2], batches[-1]
    per_row = (peaks[large] - peaks[small]) / (large - small)
    return max(large, large + int((capacity - peaks[large]) / per_row)), step


# ---- the time of a whole output --------------------------------------------------------------------

def schedule(policy: KVPolicy, held: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots a row holds before each of `steps` decode steps `[steps]`, and whether the step compresses
    `[steps]` bool, from `held` after prefill.

    Step methods fill their free slots, then hold steady. Interval methods compress when a row is
    full (the base class's `after_step`: the step that fills the last slot compresses, to
    `keep_after`; R-KV's `lf_repo` cut inside the step that would overfill, the same step).
    """
    capacity = policy.layers[0].slots
    if policy.schedule != "interval":
        return np.minimum(held + np.arange(steps), capacity), np.zeros(steps, dtype=bool)
    before, compresses = np.zeros(steps, dtype=np.int64), np.zeros(steps, dtype=bool)
    for step in range(steps):
        before[step] = held
        held += 1
        if held >= capacity:
            compresses[step], held = True, policy.keep_after
    return before, compresses


def step_sum(points: np.ndarray, seconds: np.ndarray, first: int, stop: int) -> float:
    """Sum over the steps first..stop-1 of the step time interpolated linearly between the timed
    `points` (steps, ascending) and held constant beyond them: the trapezoid rule at unit spacing."""
    return float(np.interp(np.arange(first, stop), points, seconds).sum())


def fast_forward(policy: KVPolicy, state: DecodeState, positions: torch.Tensor, held: int, step: int) -> None:
    """Sets a prefilled batch to the occupancy it has before decode step `step`, holding `held` slots
    per row and layer (at most the layer's): the lowest slots valid with the newest positions, the
    next slot the first free one, the host count of interval methods, and the decode state's
    positions (`positions` `[B]` after prefill, + step) and output index. Benchmark only (module
    docstring): the slots' K/V and scores are left as they are."""
    state.positions.copy_(positions + step)
    state.step.fill_(step + 1)
    newest = state.positions[:, None, None]  # [B, 1, 1], the position this step writes
    for slots, next_slot in zip(policy.layers, policy.next_slot, strict=True):
        count = min(held, slots.slots)
        index = torch.arange(slots.slots, device=newest.device)
        valid = index < count if slots.usable is None else (index < count) & slots.usable
        slots.valid.copy_(valid.expand_as(slots.valid))
        slots.positions.copy_(torch.where(slots.valid, newest - count + index, -1))
        next_slot.copy_(first_free(slots.valid, slots.usable))
    if policy.schedule == "interval":
        policy.held = [held] * len(policy.held)


@dataclass
class Estimate:
    """One batch's measured pieces and the whole output's time."""

    setup_seconds: float  # allocation, prefill and first token, as in `generate`
    first_seconds: float  # an eager decode step (the engine's first is one) and the graph capture
    points: np.ndarray  # the timed steps (window midpoints)
    step_seconds: np.ndarray  # mean time of a step without compression there
    compressions: int  # over the whole output
    compression_seconds: float  # added by one compression: the mean over the timed ones
    compressions_timed: int  # the compressions that fell in the timed windows
    peak_memory_bytes: int | None

    @property
    def compressions_seconds(self) -> float:
        """The whole output's compressions: their count x the time one adds."""
        return self.compressions * self.compression_seconds

    def total_seconds(self, new_tokens: int) -> float:
        return (self.setup_seconds + self.first_seconds + step_sum(self.points, self.step_seconds, 1, new_tokens - 1)
                + self.compressions_seconds)


def timed_steps(engine: Engine, cache, state, generation, graph, steps: range) -> list[float]:
    """Seconds of each step in `steps`, with the policy's host hooks, as `Engine.run_steps` runs them."""
    policy, timer = cache.policy, StepTimer(engine.device)
    for step in steps:
        timer.start()
        eager = policy.before_step(step)
        if graph is None or eager:
            engine.decode_one_token(cache, state, generation)
        else:
            graph.replay()
        policy.after_step(step)
        timer.stop()
    return timer.seconds()


@torch.inference_mode()
def measure(engine: Engine, factory: Callable[[], KVPolicy], prompts: list[list[int]], setting: Setting) -> Estimate:
    """Times one batch (module docstring); raises torch.OutOfMemoryError when it does not fit."""
    device, generation, last = engine.device, setting.generation, setting.new_tokens - 1  # decode steps
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    input_ids, pad = engine.batch_inputs(prompts)
    cache = engine.new_cache(factory, len(prompts), pad.shape[1], generation)
    state = DecodeState(len(prompts), setting.new_tokens, engine.vocab, list(range(len(prompts))), engine.pad_id,
                        device, track_seen=False)
    engine.prefill(cache, state, input_ids, pad, generation)
    synchronize(device)
    setup = time.perf_counter() - start
    policy, positions = cache.policy, state.positions.clone()
    held = int(policy.layers[0].valid[0].sum(dim=-1).max())
    before, compresses = schedule(policy, held, last)

    engine.decode_one_token(cache, state, generation)  # compiles what it must, untimed (as a warm-up would)
    graph = None
    synchronize(device)
    start = time.perf_counter()
    if on_gpu:  # not `longflow.engine.capture`, which decodes eagerly when capture fails: here it does not fit
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            engine.decode_one_token(cache, state, generation)
        synchronize(device)
    capture = time.perf_counter() - start
    fast_forward(policy, state, positions, int(before[0]), 0)
    (eager,) = timed_steps(engine, cache, state, generation, None, range(1))
    cuts = np.flatnonzero(compresses[1:]) + 1
    if len(cuts):
        # One compression untimed, at every batch: the process's first compiles its kernels (Triton's
        # JIT: 1.36 s at batch 8, the first measured, against 0.08 s at batch 32), and a batch's first
        # allocates its temporaries' blocks (batch 32 timed 80 ms without this, 57 ms with it).
        cut = int(cuts[0])
        fast_forward(policy, state, positions, int(before[cut]), cut)
        timed_steps(engine, cache, state, generation, graph, range(cut, cut + 1))

    # Window starts: evenly spaced, and the first step with a full cache or a compression.
    span = last - setting.steps
    starts = {round(span * i / max(1, setting.points - 1)) for i in range(setting.points)}
    event = np.flatnonzero((before >= policy.layers[0].slots) | compresses)
    starts |= {int(event[0])} if len(event) and event[0] <= span else set()
    points, seconds, extra = [], [], []
    for begin in sorted(starts):
        window = range(begin, begin + setting.steps)
        fast_forward(policy, state, positions, int(before[begin]), begin)
        times = np.array(timed_steps(engine, cache, state, generation, graph, window))
        spikes = compresses[begin:begin + setting.steps]
        plain = times[~spikes].mean()
        points.append(begin + (setting.steps - 1) / 2)
        seconds.append(plain)
        extra += list(times[spikes] - plain)
    return Estimate(
        setup_seconds=setup, first_seconds=eager + capture, points=np.array(points), step_seconds=np.array(seconds),
        compressions=int(compresses[1:].sum()), compression_seconds=float(np.mean(extra)) if extra else 0.0,
        compressions_timed=len(extra),
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if on_gpu else None,
    )


def try_measure(engine, factory, prompts, setting) -> Estimate | None:
    """`measure`, or None when the batch does not fit; frees the batch's memory either way."""
    try:
        return measure(engine, factory, prompts, setting)
    except RuntimeError as error:
        if not out_of_memory(error):
            raise
        return None
    finally:
        gc.collect()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()


# ---- the figure's runs -----------------------------------------------------------------------------

def estimate_row(method: str, budget: int | None, batch: int, setting: Setting, estimate: Estimate) -> dict:
    seconds = estimate.total_seconds(setting.new_tokens)
    peak = estimate.peak_memory_bytes
    return {
        "method": method, "budget": budget, "batch": batch,
        "tokens_per_s": batch * setting.new_tokens / seconds, "seconds": seconds,
        "setup_s": estimate.setup_seconds, "step_ms_first": estimate.step_seconds[0] * 1e3,
        "step_ms_last": estimate.step_seconds[-1] * 1e3, "compressions": estimate.compressions,
        "compression_ms": estimate.compression_seconds * 1e3, "compressions_timed": estimate.compressions_timed,
        "compressions_ms_total": estimate.compressions_seconds * 1e3,
        "compressions_share": estimate.compressions_seconds / seconds,
        "peak_memory_gib": peak / 2**30 if peak else None,
    }


def report(method: str, batch: int, row: dict | None) -> None:
    """One line per measurement: a full-size model's figure takes minutes."""
    if row is None:
        print(f"{method} batch {batch}: does not fit", flush=True)
        return
    memory = f", peak {row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] else ""
    print(f"{method} batch {batch}: {row['tokens_per_s']:.0f} tokens/s, step {row['step_ms_first']:.2f} -> "
          f"{row['step_ms_last']:.2f} ms{memory}", flush=True)


def allocator_capacity(device: torch.device) -> int | None:
    """Bytes the caching allocator can hold at most: free device memory plus what it holds now."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


def method_rows(model, method: str, setting: Setting, batches: list[int], tolerance: int,
                limit: int) -> list[dict]:
    """Every batch of `batches` up to the first that does not fit, then the search for the largest;
    a row per batch that fits, each with the method's `max_batch` and `oom_batch`."""
    policy = method_policy(method, setting.budget)
    engine = bench_engine(model, policy)
    factory = engine.policy_factory
    rows: dict[int, dict | None] = {}

    def fits(batch: int) -> bool:
        if batch not in rows:
            estimate = try_measure(engine, factory, random_prompts(batch, setting.prompt, engine.vocab), setting)
            rows[batch] = estimate_row(method, policy.budget, batch, setting, estimate) if estimate else None
            report(method, batch, rows[batch])
        return rows[batch] is not None

    for batch in sorted(batches):
        if not fits(batch):
            break
    peaks = {batch: row["peak_memory_gib"] * 2**30 for batch, row in rows.items() if row and row["peak_memory_gib"]}
    fitting = [batch for batch, row in rows.items() if row]
    if peaks:
        start, step = search_start(peaks, allocator_capacity(engine.device), tolerance)
    else:
        start = max(fitting, default=min(batches))
        step = start
    largest, smallest_failure = largest_fitting(fits, min(start, limit), step, tolerance, limit)
    print(f"{method}: largest batch {largest}" + (f", {smallest_failure} does not fit" if smallest_failure else
                                                   f" (the limit, --max-batch {limit})"), flush=True)
    return [{**row, "max_batch": largest, "oom_batch": smallest_failure}
            for _, row in sorted(rows.items()) if row]


def validate(model, methods: list[str], setting: Setting, batches: list[int]) -> pd.DataFrame:
    """The estimate against the wall time of a full `Engine.generate`, warm, at each method and batch."""
    rows = []
    for method in methods:
        policy = method_policy(method, setting.budget)
        engine = bench_engine(model, policy)
        factory = engine.policy_factory
        for batch in batches:
            prompts = random_prompts(batch, setting.prompt, engine.vocab)
            seeds = list(range(batch))
            engine.generate(prompts, GenerationConfig(max_new_tokens=4, ignore_eos=True), seeds)  # warm-up
            estimate = estimate_row(method, policy.budget, batch, setting, measure(engine, factory, prompts, setting))
            gc.collect()
            synchronize(engine.device)
            start = time.perf_counter()
            result = engine.generate(prompts, setting.generation, seeds)
            synchronize(engine.device)
            seconds = time.perf_counter() - start
            steps = np.array(result.step_seconds) * 1e3
            rows.append({
                "method": method, "batch": batch, "budget": estimate["budget"],
                "estimated_tokens_per_s": estimate["tokens_per_s"],
                "measured_tokens_per_s": batch * setting.new_tokens / seconds,
                "estimated_s": estimate["seconds"], "measured_s": seconds,
                "estimated_step_ms_first": estimate["step_ms_first"], "measured_step_ms_first": steps[2:10].mean(),
                "estimated_step_ms_last": estimate["step_ms_last"], "measured_step_ms_last": steps[-8:].mean(),
            })
            row = rows[-1]
            print(f"{method} batch {batch}: estimated {row['estimated_tokens_per_s']:.0f} tokens/s, measured "
                  f"{row['measured_tokens_per_s']:.0f} ({row['estimated_s'] / row['measured_s'] - 1:+.2%})", flush=True)
    return pd.DataFrame(rows)


# ---- the figure --------------------------------------------------------------------------------------

def title(table: pd.DataFrame) -> str:
    first = table.iloc[0]
    budgets = table["budget"].dropna()
    budget = (f", budget {int(budgets.iloc[0])} slots ({budgets.iloc[0] / (first['prompt'] + first['new_tokens']):.0%}"
              " of prompt + new)" if len(budgets) else "")
    return (f"{model_name(first['model'])} ({first['dtype']}, random weights) on {first['device']}: prompt "
            f"{first['prompt']}, {first['new_tokens']} new tokens{budget}; {first['steps_timed']} steps timed "
            "per point")


def plot(table: pd.DataFrame, path: Path) -> None:
    """Left: tokens/s against batch, a line per method, a star at its largest batch. Right: the largest batch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    methods = sorted(table["method"].unique(), key=lambda m: (method_rank(m), m))
    figure = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2, gridspec_kw=dict(width_ratios=[2, 1]))
    for i, method in enumerate(methods):
        rows = table[table["method"] == method].sort_values("batch")
        color, label = f"C{i}", METHOD_NAMES.get(method, method)
        left.plot(rows["batch"], rows["tokens_per_s"], marker="o", markersize=4, color=color, label=label)
        largest = rows[rows["batch"] == rows["max_batch"]]
        left.plot(largest["batch"], largest["tokens_per_s"], marker="*", markersize=13, color=color, linestyle="none")
        bar = right.barh(i, rows["max_batch"].iloc[0], color=color)
        right.bar_label(bar, fmt="%d", padding=3, fontsize=8)
    left.set_xscale("log", base=2)
    left.xaxis.set_major_formatter(ScalarFormatter())
    left.set_xlabel("batch size (sequences)")
    left.set_ylabel("decode throughput (generated tokens/s)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8, title="★ largest batch that fits", title_fontsize=8)
    right.set_yticks(range(len(methods)), [METHOD_NAMES.get(m, m) for m in methods])
    right.invert_yaxis()
    right.set_xlabel("largest batch that fits")
    right.margins(x=0.15)
    figure.suptitle(title(table), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=150)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_8b")
    parser.add_argument("--methods", default=",".join(PAPER_METHODS), help="comma-separated configs of conf/method/")
    parser.add_argument("--batches", default="8,32,128,256",
                        help="batch sizes measured before the search for the largest (comma-separated)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=None, help="KV slots of the compressing methods")
    parser.add_argument("--budget-fraction", type=float, default=0.2,
                        help="without --budget: this fraction of prompt + new, rounded to a multiple of 16")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed at each point")
    parser.add_argument("--points", type=int, default=5, help="evenly spaced points timed along the output")
    parser.add_argument("--tolerance", type=int, default=4, help="rows between the largest fit and a failure")
    parser.add_argument("--max-batch", type=int, default=4096, help="the search stops here")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: the model config's")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--validate", action="store_true",
                        help="compare the estimate with full Engine.generate runs at --batches (fig3_validation.csv)")
    parser.add_argument("--replot", type=Path, metavar="CSV", help="redraw the figure from a fig3.csv; no GPU needed")
    args = parser.parse_args(argv)
    if args.replot:
        plot(pd.read_csv(args.replot), args.replot.with_suffix(".png"))
        print(f"wrote {args.replot.with_suffix('.png')}")
        return
    if args.steps < 2 or args.new < args.steps + 3:
        parser.error("--steps must be at least 2 (a window may hold a compression) and --new at least --steps + 3")
    methods, batches = args.methods.split(","), [int(b) for b in args.batches.split(",")]
    budget = args.budget or default_budget(args.prompt, args.new, args.budget_fraction)
    setting = Setting(args.prompt, args.new, budget, args.steps, args.points)

    model, spec, device = bench_model(args.model, args.device, args.dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    about = dict(model=args.model, dtype=spec.dtype, prompt=args.prompt, new_tokens=args.new,
                 steps_timed=args.steps, device=gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{args.model} ({spec.dtype}, random weights) on {gpu}: prompt {args.prompt}, {args.new} new tokens, "
          f"budget {budget}", flush=True)
    if args.validate:
        table = validate(model, methods, setting, batches).assign(prompt=args.prompt, new_tokens=args.new,
                                                                  device=gpu)
        table.to_csv(args.out / "fig3_validation.csv", index=False)
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print(f"wrote {args.out / 'fig3_validation.csv'}")
        return
    rows = []
    for method in methods:
        rows += method_rows(model, method, setting, batches, args.tolerance, args.max_batch)
        table = pd.DataFrame(rows).assign(**about)
        table.to_csv(args.out / "fig3.csv", index=False)  # after every method: the run takes minutes
    plot(table, args.out / "fig3.png")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {args.out / 'fig3.csv'} and {args.out / 'fig3.png'}")


if __name__ == "__main__":
    run(main)

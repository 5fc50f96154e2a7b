"""The throughput benchmark's CPU-side parts: the largest-batch search, the step-time sum, the
fast-forward against a real decode, and the script end to end on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from evals.bench import throughput as bench_throughput
from evals.bench.common import bench_engine, method_policy, random_prompts
from evals.bench.throughput import Setting, fast_forward, largest_fitting, schedule, search_start, step_sum
from evals.configs import model_spec
from longflow.engine import DecodeState
from longflow.models import load_model

pytestmark = pytest.mark.filterwarnings("ignore:rkv. budget")  # the tiny budgets shrink R-KV's interval

TINY = ["--model", "tiny_qwen3", "--device", "cpu", "--prompt", "16", "--new", "40", "--budget", "32",
        "--steps", "2", "--points", "3"]


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny model's steps are microseconds of work, and threads fight over
    the cores of a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_qwen3():
    model, _ = load_model(model_spec("tiny_qwen3"), torch.device("cpu"))
    return model


class Fits:
    """A fake "the batch fits" predicate: up to `largest`, counting its calls."""

    def __init__(self, largest: int):
        self.largest, self.calls = largest, []

    def __call__(self, batch: int) -> bool:
        self.calls.append(batch)
        return batch <= self.largest


@pytest.mark.parametrize("largest", [1, 7, 100, 413, 1000])
@pytest.mark.parametrize("start,step", [(8, 8), (400, 4), (1, 1)])
def test_search_finds_the_largest_batch_exactly_with_tolerance_one(largest, start, step):
    fits = Fits(largest)
    assert largest_fitting(fits, start, step) == (largest, largest + 1)
    # Doubling (strides of step, 2 step, ...) then bisection of the last stride: logarithmic in the
    # distance from the start, never a scan.
    distance = abs(largest - start)
    assert len(fits.calls) <= math.log2(distance / step + 2) + math.log2(distance + 2) + 3
    assert len(set(fits.calls)) == len(fits.calls)


def test_search_stops_within_the_tolerance_and_at_the_limit():
    fits = Fits(413)
    fit, fail = largest_fitting(fits, 400, 4, tolerance=4)
    assert fit <= 413 < fail and fail - fit <= 4 and fits(fit) and not fits(fail)
    assert largest_fitting(Fits(10**9), 8, 8, limit=100) == (100, None)
    assert largest_fitting(Fits(0), 8, 8) == (0, 1)


def test_search_starts_where_the_affine_peak_reaches_the_capacity():
    base, per_row = 16 * 2**30, 0.3 * 2**30  # model weights, bytes per row
    peaks = {batch: base + per_row * batch for batch in (8, 32, 128)}
    assert search_start(peaks, int(base + per_row * 413.5), 4) == (413, 4)
    assert search_start({32: peaks[32]}, 2**40, 4) == (32, 32)  # one point: double from it
    assert search_start(peaks, None, 4) == (128, 128)  # no capacity known (the CPU)


def test_step_sum_against_a_hand_computed_case():
    # Steps 0-9 on the line from 1 s (step 0) to 2 s (step 10): 10 + 4.5; steps 10-19 at 2 s: 20.
    assert step_sum(np.array([0.0, 10.0]), np.array([1.0, 2.0]), 0, 20) == pytest.approx(34.5)
    # Beyond the timed points the time is held: 3 steps before 2.5 at 1 s, 2 steps between.
    assert step_sum(np.array([2.5, 4.5]), np.array([1.0, 3.0]), 0, 5) == pytest.approx(3 * 1.0 + 1.5 + 2.5)


def prefilled(model, method: str, budget: int, prompt: int, new_tokens: int, batch: int = 2):
    setting = Setting(prompt, new_tokens, budget)
    engine = bench_engine(model, method_policy(method, budget), cuda_graph=False)
    factory = engine.policy_factory
    input_ids, pad = engine.batch_inputs(random_prompts(batch, prompt, engine.vocab))
    cache = engine.new_cache(factory, batch, pad.shape[1], setting.generation)
    state = DecodeState(batch, new_tokens, engine.vocab, list(range(batch)), 0, engine.device, track_seen=False)
    engine.prefill(cache, state, input_ids, pad, setting.generation)
    return engine, cache, state, setting


@pytest.mark.parametrize("method", ["vanilla", "longflow", "rkv"])
@torch.inference_mode()
def test_fast_forward_reaches_the_occupancy_of_a_real_decode(tiny_qwen3, method, one_thread):
    prompt, new_tokens, budget, steps = 16, 48, 32, 37  # R-KV: interval 8, compressions after steps 15, 23, 31
    engine, cache, state, setting = prefilled(tiny_qwen3, method, budget, prompt, new_tokens)
    policy = cache.policy
    held = int(policy.layers[0].valid[0].sum(dim=-1).max())
    before, compresses = schedule(policy, held, steps)
    capacity, real_held, real_compressions = policy.layers[0].slots, [], []
    for _ in range(steps):
        real_held.append(int(policy.layers[0].valid[0, 0].sum()))
        engine.decode_n_tokens(cache, state, setting.generation, 1)  # one step with the policy's hooks
        real_compressions.append(int(policy.layers[0].valid[0, 0].sum()) < min(capacity, real_held[-1] + 1))
    assert list(before) == real_held
    assert list(compresses) == real_compressions
    assert compresses.sum() == (3 if method == "rkv" else 0)

    _, forwarded, forwarded_state, _ = prefilled(tiny_qwen3, method, budget, prompt, new_tokens)
    fast_forward(forwarded.policy, forwarded_state, forwarded_state.positions.clone(),
                 int(schedule(forwarded.policy, held, steps + 1)[0][steps]), steps)
    assert torch.equal(forwarded_state.positions, state.positions)
    assert torch.equal(forwarded_state.step, state.step)
    for real, fast in zip(policy.layers, forwarded.policy.layers, strict=True):
        assert torch.equal(fast.valid.sum(dim=-1), real.valid.sum(dim=-1))
        # The held positions are a row's newest ones: exactly the real ones for the full cache.
        assert bool((fast.positions.amax(dim=-1) == state.positions[:, None] - 1).all())
        if method == "vanilla":
            assert torch.equal(fast.valid, real.valid) and torch.equal(fast.positions, real.positions)
    if method != "longflow":  # LongFlow's next slot is its eviction choice, computed by the step itself
        for real, fast in zip(policy.next_slot, forwarded.policy.next_slot, strict=True):
            assert torch.equal(fast, real)
    if method == "rkv":
        assert forwarded.policy.held == policy.held


def test_main_writes_the_figure_csv_and_validation(tmp_path, one_thread):
    bench_throughput.main([*TINY, "--methods", "vanilla,rkv", "--batches", "1,2", "--max-batch", "3",
                           "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "fig3.csv")
    assert sorted(zip(table["method"], table["batch"], strict=True)) == [
        ("rkv", 1), ("rkv", 2), ("rkv", 3), ("vanilla", 1), ("vanilla", 2), ("vanilla", 3)]
    assert (table["max_batch"] == 3).all() and table["oom_batch"].isna().all()
    assert (table["tokens_per_s"] > 0).all()
    # Prompt 16 in 32 slots, cut to 24 every 8 steps: after decode steps 15, 23 and 31 of 39.
    assert set(table.loc[table["method"] == "rkv", "compressions"]) == {3}
    assert set(table.loc[table["method"] == "vanilla", "compressions"]) == {0}
    rkv = table[table["method"] == "rkv"]
    assert (rkv["compressions_timed"] >= 1).all()  # the window at the first compression
    assert ((rkv["compressions_ms_total"] - 3 * rkv["compression_ms"]).abs() < 1e-9).all()
    assert (rkv["compressions_share"] - rkv["compressions_ms_total"] / 1e3 / rkv["seconds"]).abs().max() < 1e-12
    assert (table.loc[table["method"] == "vanilla", ["compressions_timed", "compressions_ms_total"]] == 0).all().all()
    assert (tmp_path / "fig3.png").stat().st_size > 10_000

    (tmp_path / "fig3.png").unlink()
    bench_throughput.main(["--replot", str(tmp_path / "fig3.csv")])
    assert (tmp_path / "fig3.png").stat().st_size > 10_000

    bench_throughput.main([*TINY, "--methods", "longflow", "--batches", "2", "--validate", "--out", str(tmp_path)])
    validation = pd.read_csv(tmp_path / "fig3_validation.csv")
    assert list(validation["method"]) == ["longflow"] and (validation["measured_tokens_per_s"] > 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_a_full_size_model_is_refused_on_the_cpu_before_its_weights_are_made(capsys):
    """`make fig3` on a machine without a GPU: one line, exit code 2, where it used to make Qwen3-8B's
    16 GB of random weights in host memory."""
    with pytest.raises(SystemExit) as stopped:
        bench_throughput.run(lambda: bench_throughput.main([]))
    assert stopped.value.code == 2
    assert "error: model qwen3_8b (8.2B parameters, 16 GB in bfloat16) would run on the CPU" in capsys.readouterr().err

"""`python -m evals.bench.vericache` on the tiny model on the CPU, and its projection formula."""

from __future__ import annotations

import pytest

from evals.bench.vericache import main, projected_ms


def test_the_projection_is_the_round_cost_over_the_tokens_it_commits():
    # h = 4, draft 1 ms, verify 3 ms, replay 1 ms: a = 1 replays 2 steps, a = h one.
    assert projected_ms(1.0, 3.0, 1.0, 4, 1.0) == pytest.approx((4 + 3 + 2) / 2)
    assert projected_ms(1.0, 3.0, 1.0, 4, 4.0) == pytest.approx((4 + 3 + 1) / 5)


def test_the_bench_times_every_part_on_the_tiny_model(tmp_path):
    out = tmp_path / "vericache.csv"
    table = main(["--model", "tiny_qwen3", "--device", "cpu", "--batch", "2", "--prompt", "16", "--new", "16",
                  "--budget", "16", "--methods", "h2o", "--horizon", "3", "--acceptance", "0,3", "--out", str(out)])
    row = table.iloc[0]
    assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["replay_ms"] > 0 and row["vanilla_step_ms"] > 0
    assert row["ms_per_token_a3"] < row["ms_per_token_a0"]
    assert out.exists() and "ms_per_token_a0" in out.read_text()

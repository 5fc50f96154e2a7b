"""The workload benchmark: its length distribution against the log-normal it names, and a whole run on
the tiny model (CPU), where every item must stop at its drawn length in both modes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from evals.bench.workload import continuous_schedule, main, normal_quantile, output_lengths, predicted_steps


def test_normal_quantile_inverts_the_cdf():
    for probability in (0.025, 0.5, 0.8, 0.975):
        assert 0.5 * (1 + math.erf(normal_quantile(probability) / math.sqrt(2))) == pytest.approx(probability)
    assert normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-5)


def test_lengths_have_the_median_and_the_share_at_the_cap():
    lengths = np.array(output_lengths(40_000, median=2500, cap=8192, at_cap=0.2, seed=1))
    assert lengths.min() >= 1 and lengths.max() == 8192
    assert np.median(lengths) == pytest.approx(2500, rel=0.03)
    assert np.mean(lengths == 8192) == pytest.approx(0.2, abs=0.01)


def test_predicted_steps_by_hand():
    # Static, rows of 2, checks every 4: batches (9, 3) and (5, 1) need 8 and 4 decode steps, both
    # whole checks. Continuous, refill at 1: rows take 9 and 3 (8 and 2 steps owed); after the check
    # at 4 the second row takes 5 (4 owed); at 8 both are free and take 1, the last, owing nothing;
    # it is found at the check at 12.
    assert predicted_steps([9, 3, 5, 1], rows=2, cap=16, check_every=4, refill_rows=1) == (12, 12)
    # The cap bounds a static batch's steps (cap - 1 = 7, not two checks of 4).
    assert predicted_steps([8, 8], rows=2, cap=8, check_every=4, refill_rows=1)[0] == 7
    # The same queue, admissions by hand: both rows at first; 5 at the check at 4; then 1.
    assert continuous_schedule([9, 3, 5, 1], rows=2, check_every=4, refill_rows=1) == (12, [2, 1, 1])
    # Refilling two rows at once: 5 waits for the first row to be free too (at 8), then 5 and 1 go in
    # together; 5 owes 4 steps, done at the check at 12.
    assert continuous_schedule([9, 3, 5, 1], rows=2, check_every=4, refill_rows=2) == (12, [2, 2])


def test_a_run_on_the_tiny_model_writes_both_modes_and_takes_the_predicted_steps(tmp_path):
    out = tmp_path / "workload.csv"
    table = main(["--model", "tiny_qwen3", "--methods", "longflow,vanilla", "--budget", "24", "--batch", "3",
                  "--items", "10", "--prompt", "16", "--median", "6", "--cap", "40", "--device", "cpu",
                  "--out", str(out)])
    assert out.exists()
    assert list(table["mode"]) == ["static", "continuous"] * 2
    assert (table["items_per_hour"] > 0).all() and table["speedup"].notna().sum() == 2
    assert (table["decode_steps"] == table["predicted_steps"]).all()


def test_one_mode_alone(tmp_path):
    table = main(["--model", "tiny_qwen3", "--methods", "longflow", "--budget", "24", "--batch", "2", "--items", "4",
                  "--prompt", "16", "--median", "6", "--cap", "16", "--device", "cpu", "--modes", "continuous",
                  "--refill-rows", "2", "--out", str(tmp_path / "workload.csv")])
    assert list(table["mode"]) == ["continuous"] and "speedup" not in table
    assert (table["decode_steps"] == table["predicted_steps"]).all()


def test_modes_run_in_the_order_given_and_the_speedup_is_continuous_over_static(tmp_path):
    table = main(["--model", "tiny_qwen3", "--methods", "longflow", "--budget", "24", "--batch", "2", "--items", "6",
                  "--prompt", "16", "--median", "6", "--cap", "16", "--device", "cpu", "--modes", "continuous,static",
                  "--out", str(tmp_path / "workload.csv")])
    assert list(table["mode"]) == ["continuous", "static"]
    continuous, static = table.iloc[0], table.iloc[1]
    assert continuous["speedup"] == pytest.approx(continuous["items_per_hour"] / static["items_per_hour"])
    assert pd.isna(static["speedup"])

"""The workload benchmark: its length distribution against the log-normal it names, and a whole run on
the tiny model (CPU), where every item must stop at its drawn length in both modes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from evals.bench import workload
from evals.bench.workload import (
    batch_range,
    continuous_schedule,
    main,
    normal_quantile,
    output_lengths,
    predicted_steps,
)


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


RUN = ["--model", "tiny_qwen3", "--methods", "longflow,vanilla", "--budget", "24", "--batch", "3", "--items", "10",
       "--prompt", "16", "--median", "6", "--cap", "24", "--device", "cpu"]


def test_predicted_steps_with_overlapped_admissions_by_hand():
    # Rows of 2, checks every 4, refill at 1. The first admission (no row decoding) goes before its
    # round: 9 and 3 (8 and 2 owed). At the check at 4 the second row is free and 5 is prefilled
    # beside the next round; it owes 4 from the check at 8, where the first row is free and 1 goes
    # beside the round to 12, owing nothing from there; found at the check at 16.
    assert continuous_schedule([9, 3, 5, 1], rows=2, check_every=4, refill_rows=1, overlap=True) == (16, [2, 1, 1])


def test_a_run_with_overlapped_admissions_takes_the_predicted_steps(tmp_path):
    out = tmp_path / "workload.csv"
    table = main([*RUN, "--modes", "continuous", "--overlap-admissions", "--out", str(out)])
    assert (table["decode_steps"] == table["predicted_steps"]).all()
    assert pd.read_csv(out)["overlap_admissions"].all()


def test_batch_ranges():
    assert batch_range(":", 4) == range(4) and batch_range("1:", 4) == range(1, 4) and batch_range(":2", 4) == range(2)
    for value in ("2", "3:1", "5:"):
        with pytest.raises(ValueError):
            batch_range(value, 4)


def test_a_static_run_in_parts_combines_into_the_whole_runs_counts(tmp_path):
    """Static batches 0-1 and 2-3 in two processes' tables and continuous in a third: the combined
    table holds the steps, tokens and items of the run in one piece, and the speedup from them."""
    whole = main([*RUN, "--out", str(tmp_path / "whole.csv")])
    parts = [tmp_path / name for name in ("static_a.csv", "static_b.csv", "continuous.csv")]
    main([*RUN, "--modes", "static", "--static-batches", ":2", "--out", str(parts[0])])
    first = pd.read_csv(parts[0])
    assert list(first["items_timed"]) == [6, 6] and list(first["static_batches"]) == ["0:2", "0:2"]
    main([*RUN, "--modes", "static", "--static-batches", "2:", "--out", str(parts[1])])
    main([*RUN, "--modes", "continuous", "--out", str(parts[2])])
    combined = main(["--combine", *map(str, parts), "--out", str(tmp_path / "combined.csv")])
    counts = ["mode", "items_timed", "useful_tokens", "decode_steps", "predicted_steps"]
    assert combined[counts].to_dict("records") == whole[counts].to_dict("records")
    assert (combined["decode_steps"] == combined["predicted_steps"]).all()
    for method, rows in combined.groupby("method"):  # vanilla has no budget: NaN in the tables
        continuous, static = rows.set_index("mode").loc["continuous"], rows.set_index("mode").loc["static"]
        assert continuous["speedup"] == pytest.approx(continuous["items_per_hour"] / static["items_per_hour"])
        assert static["seconds"] == pytest.approx(sum(
            pd.read_csv(p).set_index("method").loc[method, "seconds"] for p in parts[:2]))


def test_combining_refuses_parts_that_do_not_make_one_run(tmp_path):
    a, b, other = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "other.csv"
    main([*RUN, "--modes", "static", "--static-batches", ":3", "--out", str(a)])
    main([*RUN, "--modes", "static", "--static-batches", "2:", "--out", str(b)])
    with pytest.raises(ValueError, match="cover"):  # batch 2 twice
        main(["--combine", str(a), str(b), "--out", str(tmp_path / "c.csv")])
    with pytest.raises(ValueError, match="cover"):  # batch 3 missing
        main(["--combine", str(a), "--out", str(tmp_path / "c.csv")])
    main([*RUN[:-4], "--cap", "20", "--device", "cpu", "--modes", "static", "--static-batches", "3:",
          "--out", str(other)])
    with pytest.raises(ValueError, match="settings"):
        main(["--combine", str(a), str(other), "--out", str(tmp_path / "c.csv")])


def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The CSV is rewritten after every row: a process stopped during its second mode (a device
    call's time limit) leaves the first mode's row behind."""
    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(workload, "run_continuous", stopped)
    out = tmp_path / "workload.csv"
    with pytest.raises(KeyboardInterrupt):
        main([*RUN, "--out", str(out)])
    kept = pd.read_csv(out)
    assert list(kept["mode"]) == ["static"] and kept["method"].item() == "longflow"
    assert kept["decode_steps"].item() == kept["predicted_steps"].item() > 0

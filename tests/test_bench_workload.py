"""The workload benchmark: its length distribution against the log-normal it names, and a whole run on
the tiny model (CPU), where every item must stop at its drawn length in both modes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evals.bench_workload import main, normal_quantile, output_lengths


def test_normal_quantile_inverts_the_cdf():
    for probability in (0.025, 0.5, 0.8, 0.975):
        assert 0.5 * (1 + math.erf(normal_quantile(probability) / math.sqrt(2))) == pytest.approx(probability)
    assert normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-5)


def test_lengths_have_the_median_and_the_share_at_the_cap():
    lengths = np.array(output_lengths(40_000, median=2500, cap=8192, at_cap=0.2, seed=1))
    assert lengths.min() >= 1 and lengths.max() == 8192
    assert np.median(lengths) == pytest.approx(2500, rel=0.03)
    assert np.mean(lengths == 8192) == pytest.approx(0.2, abs=0.01)


def test_a_run_on_the_tiny_model_writes_both_modes(tmp_path):
    out = tmp_path / "workload.csv"
    table = main(["--model", "tiny_qwen3", "--methods", "longflow,vanilla", "--budget", "24", "--batch", "2",
                  "--items", "6", "--prompt", "16", "--median", "6", "--cap", "16", "--device", "cpu",
                  "--out", str(out)])
    assert out.exists()
    assert list(table["mode"]) == ["static", "continuous"] * 2
    assert (table["items_per_hour"] > 0).all() and table["speedup"].notna().sum() == 2

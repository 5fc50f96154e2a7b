"""The admission profiler on the tiny model (CPU): every part timed for every row count, the wall
time of a part never below its host time (it waits for the host's work and then the device's)."""

from __future__ import annotations

import pytest

from evals.bench.profile_admission import PARTS, main


def test_every_part_of_every_row_count_is_timed(tmp_path, capsys):
    out = tmp_path / "admission.csv"
    table = main(["--model", "tiny_qwen3", "--device", "cpu", "--rows", "1,3", "--prompt", "16", "--new", "8",
                  "--budget", "8", "--repeats", "2", "--profile", "2", "--out", str(out)])
    assert sorted(zip(table["rows"], table["part"], strict=True)) == sorted((n, p) for n in (1, 3) for p in PARTS)
    assert (table["host_ms"] > 0).all() and (table["wall_ms"] >= table["host_ms"]).all()
    assert out.exists() and "Self CPU" in capsys.readouterr().out  # the profiler's table
    assert (table["prefill"] == "eager").all()


def test_a_compiled_prefill_is_refused_off_the_gpu():
    """The engine compiles on CUDA only: timing `compiled` on the CPU would time the eager forward."""
    with pytest.raises(SystemExit):
        main(["--model", "tiny_qwen3", "--device", "cpu", "--rows", "1", "--prefill", "eager,compiled"])

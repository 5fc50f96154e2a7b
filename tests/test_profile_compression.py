"""The compression profile on the tiny model, on the CPU: a row per interval method with the cut's
sizes and both steps' times; a step method is refused."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from evals.bench import profile_compression

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning", "ignore:rkv. budget")


def test_main_writes_a_row_per_method(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile_compression.main(["--model", "tiny_qwen3", "--device", "cpu", "--methods", "rkv,keydiff",
                                  "--batch", "3", "--prompt", "8", "--budget", "32", "--repeats", "1",
                                  "--out", str(tmp_path / "profile.csv")])
    finally:
        torch.set_num_threads(threads)
    table = pd.read_csv(tmp_path / "profile.csv")
    assert list(table["method"]) == ["rkv", "keydiff"] and (table["batch"] == 3).all()
    assert (table["slots"] == 32).all() and (table["kept"] < 32).all()
    assert (table["compressing_step_ms"] > 0).all() and (table["plain_step_ms"] > 0).all()
    assert (table["device"] == "cpu").all()
    with pytest.raises(SystemExit, match="not an interval method"):
        profile_compression.main(["--model", "tiny_qwen3", "--device", "cpu", "--methods", "h2o", "--batch", "1",
                                  "--budget", "32", "--out", str(tmp_path / "h2o.csv")])

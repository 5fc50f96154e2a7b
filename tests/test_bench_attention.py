"""The attention microbenchmark's CPU-side parts: the memory floor, the CSV round trip, `--replot`, and
vanilla's two step forms (in Triton's interpreter) attending as the softmax over the cache says."""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers import filled_attention  # noqa: E402

from evals.bench import attention as bench_attention  # noqa: E402
from longflow.errors import UserError  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig  # noqa: E402

pytestmark = pytest.mark.kernels


def grid_rows() -> list[dict]:
    rows = []
    for batch, slots in ((1, 1024), (128, 3200)):
        floor = bench_attention.floor_bytes(batch, slots) / 4.25e12 * 1e3
        times = {"sdpa": 2.0 * floor, "sdpa_packed": 2.1 * floor, "sdpa_cudnn": 1.9 * floor, "h2o": 3.0 * floor,
                 "longflow_fused": 1.5 * floor, "flash_decode": 1.7 * floor}
        for method, ms in times.items():
            rows.append(dict(batch=batch, slots=slots, method=method, backend="flash", ms=ms, floor_ms=floor,
                             x_floor=ms / floor, x_sdpa=ms / times["sdpa_cudnn"], copy_tb_s=4.25, input_sets=1,
                             timer="cuda_graph"))
    return rows


def test_floor_counts_k_v_mask_q_and_out_once():
    batch, slots = 128, 3200
    k_and_v = 2 * batch * 8 * slots * 128 * 2  # Qwen3-8B: 8 KV heads, head dim 128, bf16
    assert bench_attention.floor_bytes(batch, slots) == k_and_v + batch * slots + 2 * batch * 32 * 128 * 2


def test_replot_redraws_the_figure_from_the_csv(tmp_path, capsys):
    rows = grid_rows()
    path = tmp_path / "fig1.csv"
    bench_attention.write_csv(rows, path)
    assert bench_attention.read_csv(path) == [
        {key: (str(value) if key in ("method", "backend", "timer") else value) for key, value in row.items()}
        for row in rows
    ]
    bench_attention.main(["--replot", str(path)])
    assert (tmp_path / "fig1.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "fused/best sdpa" in table and "0.789" in table  # 1.5 floor / min(2.0, 2.1, 1.9) floor
    assert "flash_decode/best sdpa" in table and "0.895" in table  # 1.7 / 1.9


def test_the_figure_marks_where_longflow_took_the_on_chip_pass(tmp_path, monkeypatch):
    """The CSV's backend `gluon` (the on-chip pass) names LongFlow's bar at the figure's point and
    outlines its ratio bars in black, with a legend entry; the Triton call's points stay unmarked."""
    from matplotlib.figure import Figure

    rows = grid_rows()
    for row in rows:
        if row["method"] == "longflow_fused" and row["batch"] == 128:
            row["backend"] = "gluon"
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, path, **_: saved.append(figure))
    bench_attention.plot(rows, tmp_path / "fig1.png")
    point, ratios = saved[0].axes
    assert "LongFlow\n(fused, on chip)" in [label.get_text() for label in point.get_xticklabels()]
    assert "LongFlow on chip" in [text.get_text() for text in ratios.get_legend().get_texts()]
    outlined = [bar.get_x() for bar in ratios.patches if bar.get_edgecolor()[:3] == (0.0, 0.0, 0.0)]
    assert len(outlined) == 1 and outlined[0] > 1  # batch 128's fused bar, the second group


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_timing_without_a_gpu_says_so():
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        bench_attention.main(["--quick"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="small shapes for Triton's interpreter")
def test_vanilla_steps_write_the_last_slot_and_attend_over_the_cache(monkeypatch):
    """Both forms of `STEPS`, called twice on one input set: each call writes the token at the last slot
    (the cache's own last key and value) and returns the softmax over the valid slots before it, and the
    token in one launch (the three launches, as vanilla's `decode`, read up to next_slot, which stays at
    the last slot)."""
    monkeypatch.setattr(bench_attention, "Q_HEADS", 4)
    monkeypatch.setattr(bench_attention, "KV_HEADS", 2)
    monkeypatch.setattr(bench_attention, "HEAD_DIM", 16)
    monkeypatch.setattr(bench_attention, "DTYPE", torch.float32)
    q, k, v, valid = bench_attention.make_cache(2, 100, torch.device("cpu"))
    for method, read in zip(bench_attention.STEPS, (99, 100), strict=True):
        expected = filled_attention(q, k, v, valid, torch.full((2,), read), 16**-0.5)
        call, backend = bench_attention.method_calls(method, q, k.clone(), v.clone(), valid)
        assert backend == "triton"
        for _ in range(2):
            torch.testing.assert_close(call().double(), expected, rtol=1e-5, atol=1e-5)
    # `--sweep-step`'s configurations reach the one launch
    call = bench_attention.vanilla_step_call(q, k.clone(), v.clone(), valid, one_launch=True,
                                             config=LaunchConfig(block_n=16, splits=5))
    torch.testing.assert_close(call().double(), filled_attention(q, k, v, valid, torch.full((2,), 100), 16**-0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="small shapes for Triton's interpreter")
def test_nvtx_puts_one_call_of_each_method_in_the_profile_range(monkeypatch):
    """`--nvtx`: the warm-up calls run outside any NVTX range and exactly one call of each method at each
    point inside `profile`, under a nested range naming the method and the point (what `ncu
    --nvtx-include profile/` records)."""
    monkeypatch.setattr(bench_attention, "Q_HEADS", 4)
    monkeypatch.setattr(bench_attention, "KV_HEADS", 2)
    monkeypatch.setattr(bench_attention, "HEAD_DIM", 16)
    monkeypatch.setattr(bench_attention, "DTYPE", torch.float32)
    stack, seen = [], []
    real_method_calls = bench_attention.method_calls

    @contextlib.contextmanager
    def nvtx_range(name):
        stack.append(name)
        yield
        stack.pop()

    def recording(method, *inputs):
        call, backend = real_method_calls(method, *inputs)

        def recorded():
            seen.append((method, tuple(stack)))
            return call()
        return recorded, backend

    monkeypatch.setattr(bench_attention, "method_calls", recording)
    monkeypatch.setattr(torch.cuda.nvtx, "range", nvtx_range)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    bench_attention.nvtx_calls([1, 2], [80], ["flash_decode", "longflow_fused"], torch.device("cpu"), warmups=2)
    expected = [call for batch in (1, 2) for method in ("flash_decode", "longflow_fused")
                for call in ((method, ()), (method, ()), (method, ("profile", f"{method} {batch}x80")))]
    assert seen == expected and stack == []

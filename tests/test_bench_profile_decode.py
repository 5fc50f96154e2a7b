"""`evals.bench.profile_decode`: kernels filed by their names (Inductor's GEMM templates apart from its
fused reductions, which carry the matmuls at one row), and `--options` refused where nothing compiles."""

from __future__ import annotations

import sys

import pytest

from evals.bench import profile_decode
from evals.bench.profile_decode import category


@pytest.mark.parametrize("kernel, label", [
    ("triton_tem_fused__unsafe_view_mm_mul_silu_t_view_11", "matmul (Inductor template)"),
    ("triton_red_fused__unsafe_view_mm_mul_silu_t_view_8", "Inductor fused (Triton)"),
    ("nvjet_sm90_tst_192x64_64x6_1x2_h_bz_TNT", "matmul (cuBLAS)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "matmul (cuBLAS)"),
    ("_partial_kernel", "policy attention (Triton)"),
    ("_write_kernel", "slot write (Triton)"),
    ("something_new", "other"),
])
def test_kernels_are_filed_by_name(kernel, label):
    assert category(kernel) == label


@pytest.mark.parametrize("argv", [["--compile", "off,on", "--options", "{}"], ["--compile", "on", "--options", "[1]"]])
def test_options_need_an_object_and_a_compiled_setting(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_decode", *argv])
    with pytest.raises(SystemExit):
        profile_decode.main()
    assert "--options takes a JSON object" in capsys.readouterr().err

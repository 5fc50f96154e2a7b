"""Every Triton kernel of `longflow.kernels` compiles for sm_90 (H100/H200) on this machine, GPU or not.

The CPU tests run the kernels through Triton's interpreter, which accepts code that the compiler
refuses; `helpers/sm90.py` calls every host function, records the launches and compiles each for
sm_90 with Triton's own ptxas, in a process of its own (the kernels must be defined with the
interpreter off). It runs with the installed Triton and, where `make install` put it
(`$(VENV)/gpu-triton`, on machines without a GPU), with the GPU image's Triton 3.6 too: a jit
helper's constexpr default compiled under 3.9 and not under 3.6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SM90_TRITONS, sm90_process

pytest.importorskip("triton")  # a Linux-only dependency: elsewhere there is no kernel to compile

SCRIPT = Path(__file__).parent / "helpers" / "sm90.py"


@pytest.mark.parametrize("triton", list(SM90_TRITONS))
def test_every_kernel_compiles_for_sm90(triton):
    result = sm90_process(triton, str(SCRIPT))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kernels"], "no kernel found"
    assert sorted(report["compiled"]) == report["kernels"], "a kernel no host call launched"
    if SM90_TRITONS[triton] is not None:  # the second Triton was the one imported
        [dist_info] = SM90_TRITONS[triton].glob("triton-*.dist-info")
        assert report["triton"] == dist_info.name.removeprefix("triton-").removesuffix(".dist-info")

"""`evals.bench.sass_loop` on this machine, GPU or not, with the installed Triton and the GPU image's
(as `tests/test_kernels_compile.py`): it finds the attention pass's loop in the sm_90 machine code, and
that code has the properties the kernels' notes claim of it (longflow/kernels/NOTES.md): LongFlow's
log2 ||v||_1 on the multi-function unit, not libdevice's polynomial."""

from __future__ import annotations

import json

import pytest
from helpers import SM90_TRITONS, sm90_process

from evals.bench.sass_loop import main_loop
from longflow.kernels.onchip import REGISTERS, shared_bytes

pytest.importorskip("triton")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, RZ ;
        /*0020*/                   MUFU.EX2 R2, R3 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   FFMA R2, R3, R4, R5 ;
        /*0060*/                   BRA 0x40 ;
        /*0070*/                   EXIT ;
"""


def run(triton: str, *args: str) -> list[dict]:
    result = sm90_process(triton, "-m", "evals.bench.sass_loop", *args, "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_the_loop_is_the_longest_backward_branch_with_products():
    """The second loop (0x40-0x60) is as long, but holds no tensor-core product."""
    loop = main_loop(SASS)
    assert loop.instructions == 3 and loop.kinds["HMMA"] == 1 and loop.kinds["BAR"] == 0
    assert loop.mufu == {"EX2": 1}


@pytest.mark.parametrize("triton", list(SM90_TRITONS))
def test_the_attention_loops_machine_code(triton):
    rows = {row["name"]: row for row in run(triton, "--batch", "16", "--slots", "320")}
    assert set(rows) == {"LongFlow", "H2O", "flash_decode", "on chip", "on chip 32"}
    for row in rows.values():
        assert row["body"]["instructions"] > 100 and min(row["programs"].values()) >= 1
    longflow = rows["LongFlow"]["body"]
    assert longflow["mufu"].get("LG2", 0) > 0 and longflow["kinds"]["FFMA"] < 8  # no log2f polynomial
    assert longflow["kinds"]["HMMA"] == rows["H2O"]["body"]["kinds"]["HMMA"] * 3 // 2  # ||v||_1 products
    assert rows["flash_decode"]["body"]["kinds"]["STG"] == 0  # no scratch
    on_chip = rows["on chip"]
    # Its scratch stays in shared memory (no global store in the loop, its K/V through asynchronous
    # copies), and two programs share a multiprocessor, so that one's epilogue overlaps the other's loads.
    assert on_chip["body"]["kinds"]["STG"] == 0 and on_chip["body"]["kinds"]["LDGSTS"] > 0
    assert on_chip["body"]["mufu"].get("LG2", 0) > 0 and on_chip["body"]["kinds"]["STS"] > 0
    assert min(on_chip["programs"].values()) >= 2
    # `onchip.tiling` counts resident programs from the pass's shared memory and registers: the compiler's.
    for name, block_n in (("on chip", 64), ("on chip 32", 32)):
        assert rows[name]["shared"] == shared_bytes(block_n, 2, 320)
        if triton == "gpu image":  # the registers of the Triton that runs the pass on the GPU
            assert rows[name]["registers"] == REGISTERS[block_n]

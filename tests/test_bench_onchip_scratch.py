"""`evals.bench.onchip_scratch`, the Gluon pass with its scratch in shared memory, on this machine: its
float32 reference against the library's, its row argmin (through Triton's interpreter) against the
shared selection rule, and the pass compiled for sm_90 with the installed Triton and the GPU image's
(Gluon has no interpreter; the pass itself runs on a GPU only, where the benchmark checks it before
it times it)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SM90_TRITONS, sm90_process

pytest.importorskip("triton")

from evals.bench.attention import HEAD_DIM, make_cache  # noqa: E402
from evals.bench.onchip_scratch import TIMED, _row_argmin, float32_reference  # noqa: E402
from longflow.kernels.reference import reference  # noqa: E402
from longflow.selection import choose_next  # noqa: E402


def caches(batch: int, slots: int):
    """Left-padded rows (free slots to take first) and rows without a free slot."""
    q, k, v, valid = make_cache(batch, slots, torch.device("cpu"), seed=3)
    valid[0::2, :3] = False
    valid[1::2] = True
    return q, k, v, valid


def test_the_float32_reference_is_the_librarys():
    q, k, v, valid = caches(4, 200)
    scale = HEAD_DIM**-0.5
    out, score, next_slot = float32_reference(q, k, v, valid, scale)
    library_out, library_next = reference(q, k, v, valid, scale)
    torch.testing.assert_close(out.to(q.dtype), library_out, atol=2e-2, rtol=0)
    assert torch.equal(next_slot, library_next)
    assert next_slot[0] == 0  # the lowest free slot first
    assert valid[1].all() and score[1, next_slot[1]] == score[1].min()


def test_the_row_argmin_follows_the_shared_rule():
    """Per-KV-head partials `[B, Hkv, S]` summed over the heads, then `choose_next`'s rule; a tie on
    the minimum goes to the lower slot."""
    batch, kv_heads, slots = 4, 8, 1100  # more than one of the kernel's 1024-slot tiles
    partials = torch.rand(batch, kv_heads, slots, generator=torch.Generator().manual_seed(0))
    partials[1, :, 700] = partials[1, :, 50] = 0.0  # a tie, across tiles of the loop's lanes
    valid = torch.ones(batch, slots, dtype=torch.bool)
    valid[2, 1050] = False  # a free slot in the last, partial tile
    next_slot = torch.empty(batch, dtype=torch.int64)
    _row_argmin[(batch,)](partials, valid.to(torch.uint8), next_slot, slots, KV_HEADS=kv_heads, BLOCK=1024)
    assert torch.equal(next_slot, choose_next(partials.sum(1), valid))
    assert next_slot[1] == 50 and next_slot[2] == 1050


@pytest.mark.parametrize("triton", list(SM90_TRITONS))
def test_every_timed_configuration_compiles_for_sm90(triton):
    result = sm90_process(triton, "-m", "evals.bench.onchip_scratch", "--compile", "--slots", "1024", "8192")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {(row["slots"], row["name"]) for row in rows} == {(s, name) for s in (1024, 8192) for name in TIMED}
    assert all(row["fits"] for row in rows)  # in the shared memory one program may take on sm_90
    shared = {(row["slots"], row["name"]): row["shared"] for row in rows}
    # The compact scratch is the G = 4 real rows: 4 x 8192 fp16 more than the pass without a score,
    # and under half of what the sixteen rows of the MMA's tile would take.
    extra = shared[8192, "compact64_s2"] - shared[8192, "no_score64_s2"]
    assert 4 * 8192 * 2 <= extra < 16 * 8192 * 2 / 2

"""`evals.bench.onchip_scratch`'s float32 reference, which its GPU checks of the on-chip pass are
against, against the library's reference (the pass itself: `tests/test_onchip.py`)."""

from __future__ import annotations

import torch

from evals.bench.attention import HEAD_DIM, make_cache
from evals.bench.onchip_scratch import float32_reference
from longflow.kernels.reference import reference


def test_the_float32_reference_is_the_librarys():
    q, k, v, valid = make_cache(4, 200, torch.device("cpu"), seed=3)
    valid[0::2, :3] = False  # free slots to take first
    valid[1::2] = True  # rows whose next slot is chosen by its score
    scale = HEAD_DIM**-0.5
    out, score, next_slot = float32_reference(q, k, v, valid, scale)
    library_out, library_next = reference(q, k, v, valid, scale)
    torch.testing.assert_close(out.to(q.dtype), library_out, atol=2e-2, rtol=0)
    assert torch.equal(next_slot, library_next)
    assert next_slot[0] == 0  # the lowest free slot first
    assert valid[1].all() and score[1, next_slot[1]] == score[1].min()

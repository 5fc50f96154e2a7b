"""The fused R-KV window importance (`evals.bench.rkv_importance`; on the CPU through Triton's
interpreter) against `baselines.rkv.window_importance`, the PyTorch form R-KV's scores run: the mean
over the valid window queries of the softmax over the older keys of each KV head's max logit over its
query heads, -inf off the older keys."""

from __future__ import annotations

import pytest
import torch

from baselines.rkv import window_importance
from evals.bench.rkv_importance import fused_window_importance

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("group, window", [(4, 8), (3, 5), (1, 8)], ids=["g4_w8", "g3_w5", "g1_w8"])
@pytest.mark.parametrize("block_s", [16, 64])
def test_the_fused_importance_is_the_pytorch_one(group, window, block_s):
    """Two KV heads, 100 slots (a last tile cut short), left padding, a row with no older key at all
    (every softmax NaN in PyTorch, 0 here) and window queries not all valid."""
    generator = torch.Generator().manual_seed(group * 10 + window)
    batch, kv_heads, slots, head_dim = 3, 2, 100, 32
    queries = torch.randn(batch, kv_heads * group, window, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    index = torch.arange(slots)
    older = (index < slots - window).expand(batch, kv_heads, -1).clone()
    older[0, :, :13] = False
    older[2, 1] = False
    query_valid = torch.ones(batch, window, dtype=torch.bool)
    query_valid[1, :2] = False
    queries, keys, older, query_valid = (t.to(DEVICE) for t in (queries, keys, older, query_valid))
    want = window_importance(queries, query_valid, keys.float(), older, 0.2)
    got = fused_window_importance(queries, query_valid, keys, older, 0.2, block_s)
    assert torch.equal(got.isfinite(), want.isfinite()) and not want[2, 1].isfinite().any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

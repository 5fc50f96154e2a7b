"""R-KV's window importance kernel (`longflow.kernels.window_importance`; on the CPU through Triton's
interpreter) against `baselines.rkv.window_importance`, the PyTorch form: the mean over the valid
window queries of the softmax over the older keys of each KV head's max logit over its query heads,
-inf off the older keys."""

from __future__ import annotations

import pytest
import torch

from baselines.rkv import window_importance
from longflow import kernels

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def case(group: int, window: int, head_dim: int = 32, dtype=torch.float32):
    """Three rows of two KV heads over 100 slots (a last tile cut short): left padding, a head with no
    older key at all (every softmax NaN in PyTorch, 0 here) and window queries not all valid."""
    generator = torch.Generator().manual_seed(group * 10 + window + head_dim)
    batch, kv_heads, slots = 3, 2, 100
    queries = torch.randn(batch, kv_heads * group, window, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    index = torch.arange(slots)
    older = (index < slots - window).expand(batch, kv_heads, -1).clone()
    older[0, :, :13] = False
    older[2, 1] = False
    query_valid = torch.ones(batch, window, dtype=torch.bool)
    query_valid[1, :2] = False
    return queries.to(DEVICE, dtype), query_valid.to(DEVICE), keys.to(DEVICE, dtype), older.to(DEVICE)


@pytest.mark.parametrize("group, window, head_dim", [(4, 8, 32), (3, 5, 32), (1, 8, 32), (2, 4, 24)],
                         ids=["g4_w8", "g3_w5", "g1_w8", "g2_w4_d24"])
@pytest.mark.parametrize("block", [16, 64])
def test_the_kernel_is_the_pytorch_importance(group, window, head_dim, block):
    queries, query_valid, keys, older = case(group, window, head_dim)
    want = window_importance(queries, query_valid, keys, older, 0.2)
    got = kernels.window_importance(queries, query_valid, keys, older, 0.2, block=block)
    assert torch.equal(got.isfinite(), want.isfinite()) and not want[2, 1].isfinite().any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_kernel_reads_keys_in_place():
    """A slot cache's keys are a view with the slots not innermost-but-one contiguous; the kernel
    takes their strides as they are."""
    queries, query_valid, keys, older = case(4, 8)
    strided = keys.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hkv, S, D] with the heads inside the slots
    want = window_importance(queries, query_valid, keys, older, 0.2)
    torch.testing.assert_close(kernels.window_importance(queries, query_valid, strided, older, 0.2), want,
                               atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_on_16_bit_keys_is_the_pytorch_path(dtype):
    """The 16-bit GPU path `rkv_scores` takes: the PyTorch form's product with float32 output against
    the kernel's tensor-core products, both exact in float32, the softmax to float32 rounding."""
    queries, query_valid, keys, older = case(4, 8, 128, dtype)
    want = window_importance(queries, query_valid, keys, older, 128**-0.5)
    got = kernels.window_importance(queries, query_valid, keys, older, 128**-0.5)
    assert torch.equal(got.isfinite(), want.isfinite())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_kernel_refuses_what_does_not_fit():
    queries, query_valid, keys, older = case(4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.window_importance(queries.double(), query_valid, keys, older, 0.2)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.window_importance(queries, query_valid[:, :4], keys, older, 0.2)
    with pytest.raises(ValueError, match="power of two"):
        kernels.window_importance(queries, query_valid, keys, older, 0.2, block=48)

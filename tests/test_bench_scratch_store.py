"""The scratch-store study's stand-alone attention loop (`evals.bench.scratch_store`; on the CPU through
Triton's interpreter): whatever it stores and however it loads K and V, its output is the softmax
attention over the valid slots, written out in PyTorch; the folded score (store 6) is LongFlow's
score of docs/methods.md, p_hj ||v_j||_1 summed over the heads, and its slot the score's rule."""

from __future__ import annotations

import pytest
import torch

from evals.bench.scratch_store import pass_call
from longflow.kernels.longflow_attention import LOG2E
from longflow.kernels.reference import longflow_scores, reference

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def softmax_attention(q, k, v, valid):
    """q `[B, Hq, D]`, k, v `[B, Hkv, S, D]`, valid `[B, S]` -> `[B, Hq, D]`, in float64."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    logits = torch.einsum("bhd,bhsd->bhs", q.double(), keys) * q.shape[-1] ** -0.5
    weights = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", weights, values)


@pytest.mark.parametrize("store", [0, 1, 2, 3, 4, pytest.param(5, marks=pytest.mark.gpu), 6, 7])  # 5: inline PTX
@pytest.mark.parametrize("tma", [False, True])
def test_every_variant_computes_the_attention(store, tma):
    """Two rows, 2 KV heads of 4 query heads each, 200 slots (a last tile cut short), about 10% masked."""
    generator = torch.Generator().manual_seed(store)
    q = torch.randn(2, 8, 128, generator=generator)
    k, v = (torch.randn(2, 2, 200, 128, generator=generator) for _ in range(2))
    valid = torch.rand(2, 200, generator=generator) > 0.1
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter's dot is fp32-exact
    inputs = [t.to(DEVICE, dtype) for t in (q, k, v)] + [valid.to(DEVICE)]
    call = pass_call(*inputs, block_n=64, tma=tma, stages=2, warps=4, store=store)
    out = call()
    expected = softmax_attention(*(t.float().cpu() for t in inputs[:3]), valid)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double().cpu(), expected, atol=tolerance, rtol=tolerance)
    if store == 7:  # the bulk stores: every head's logits (log2 units) and -inf on masked slots, nothing more
        group = q.shape[1] // k.shape[1]
        keys = inputs[1].double().cpu().repeat_interleave(group, dim=1)
        logits = torch.einsum("bhd,bhsd->bhs", inputs[0].double().cpu(), keys) * 128**-0.5 * LOG2E
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        torch.testing.assert_close(call.scratch.view(2, 8, 200).double().cpu(), logits, atol=tolerance, rtol=tolerance)
    if store == 5:  # the inline stores write what `tl.store` writes
        plain = pass_call(*inputs, block_n=64, tma=tma, stages=2, warps=4, store=1)
        plain()
        torch.testing.assert_close(call.scratch, plain.scratch, atol=0, rtol=0)


@pytest.mark.parametrize("free", [False, True], ids=["every_slot_valid", "free_slots"])
def test_the_folded_score_is_longflows_and_picks_its_slot(free):
    """Store 6's partials against the plain PyTorch LongFlow score of each KV head's G query heads, and
    its slot against that reference's (`choose_next`: the first free one, else the lowest score)."""
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(3, 8, 64, generator=generator)
    k, v = (torch.randn(3, 2, 200, 64, generator=generator) for _ in range(2))
    valid = torch.ones(3, 200, dtype=torch.bool)
    if free:
        valid[1, 37] = valid[1, 150] = valid[2, :5] = False
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    inputs = [t.to(DEVICE, dtype) for t in (q, k, v)] + [valid.to(DEVICE)]
    call = pass_call(*inputs, block_n=64, tma=False, stages=2, warps=4, store=6)
    call()
    q, k, v = (t.float().cpu() for t in inputs[:3])
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    # Each KV head alone through the plain PyTorch LongFlow (whose score is the mean over its heads
    # and dimensions), so that the partial is that head's sum over its G query heads.
    group, head_dim = q.shape[1] // k.shape[1], q.shape[-1]
    expected = torch.stack([
        longflow_scores(q[:, h * group:(h + 1) * group], k[:, h:h + 1], v[:, h:h + 1], valid)[1] * group * head_dim
        for h in range(k.shape[1])], dim=1)  # [B, Hkv, S]
    torch.testing.assert_close(call.partial.view(3, 2, 200).cpu(), expected, atol=tolerance, rtol=tolerance)
    assert call.next_slot.cpu().tolist() == reference(q, k, v, valid)[1].tolist()

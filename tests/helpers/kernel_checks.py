"""What the LongFlow kernel test modules share: inputs of a given mask kind on the test device, and the
check of a call's output and next slot against the float32 reference (ties in score allowed)."""

from __future__ import annotations

import torch

from longflow.kernels.reference import longflow_scores, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def make_inputs(batch, q_heads, kv_heads, slots, head_dim, dtype, mask, seed):
    """Random q, k, v (never zeros) and a validity mask of the given kind."""
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(batch, q_heads, head_dim, generator=gen)  # peakier softmax than randn alone
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    if mask == "all_valid":
        valid = torch.ones(batch, slots, dtype=torch.bool)
    elif mask == "padding":  # left padding of a different length per row, never the whole row
        pad = torch.randint(0, slots, (batch,), generator=gen)
        valid = torch.arange(slots)[None, :] >= pad[:, None]
    elif mask == "one_free":
        valid = torch.ones(batch, slots, dtype=torch.bool)
        valid[torch.arange(batch), torch.randint(0, slots, (batch,), generator=gen)] = False
    else:
        raise ValueError(mask)
    to = dict(device=DEVICE)
    return q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), valid.to(**to)


def assert_longflow(q, k, v, valid, out, next_slot, protect=None, score_rtol=1e-3):
    """Output to the dtype's tolerance; next slot = the reference's, or tied with it in score."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert next_slot.shape == (q.shape[0],) and next_slot.dtype == torch.long
    assert torch.isfinite(out).all()
    ref_out, score = longflow_scores(q.float(), k.float(), v.float(), valid)  # float32 truth
    error = (out.float() - ref_out).norm() / ref_out.norm()
    assert error < OUT_TOLERANCE[q.dtype], f"relative error {error:.2e}"
    _, expected = reference(q, k, v, valid, protect=protect)
    score, next_slot, expected = score.cpu(), next_slot.cpu(), expected.cpu()
    valid, protect = valid.cpu(), None if protect is None else protect.cpu()
    for b in range(q.shape[0]):
        got, want = int(next_slot[b]), int(expected[b])
        if not valid[b].all() or got == want:
            assert got == want, f"row {b}: a free slot exists, expected the lowest {want}, got {got}"
            continue
        assert valid[b, got], f"row {b}: chose invalid slot {got}"
        if protect is not None and not protect[b].all():
            assert not protect[b, got], f"row {b}: chose protected slot {got}"
        tolerance = score_rtol * score[b, want] + 1e-6 * score[b].mean()
        assert score[b, got] <= score[b, want] + tolerance, (
            f"row {b}: slot {got} scores {score[b, got]:.6e}, the minimum is {score[b, want]:.6e} at {want}"
        )

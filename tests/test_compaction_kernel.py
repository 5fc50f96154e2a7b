"""The in-place compaction kernel (`longflow.kernels.compact_in_place`; on the CPU through Triton's
interpreter) against a per-slot transcription of the move, and, on a GPU, `SlotCache.compact` (which
takes the kernel there) against the CPU's compaction. Its premise, that an interval method's kept slots
never move up, is checked for every interval method in tests/test_interval_compression.py."""

from __future__ import annotations

import pytest
import torch

from longflow.kernels import compact_in_place
from longflow.slots import SlotCache, SlotState

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def move_by_hand(keys, values, order, kept, rows):
    """Row rows[i], head h: destination j gets slot order[i, h, j] of the buffers BEFORE the move where
    kept, zeros elsewhere; other rows unchanged. Plain loops; returns new tensors."""
    out_keys, out_values = keys.clone(), values.clone()
    for i, b in enumerate(rows):
        for h in range(keys.shape[1]):
            for j in range(keys.shape[2]):
                source = int(order[i, h, j])
                out_keys[b, h, j] = keys[b, h, source] if kept[i, h, j] else 0.0
                out_values[b, h, j] = values[b, h, source] if kept[i, h, j] else 0.0
    return out_keys, out_values


def kept_in_slot_order(generator, count, heads, slots, fraction):
    """Each (row, head) keeps a random subset, moved down in slot order: `order[j]` is the j-th kept
    slot (>= j), then the freed ones (any order: not read)."""
    keep = torch.rand(count, heads, slots, generator=generator) < fraction
    index = torch.arange(slots)
    order = torch.where(keep, index, slots + index).argsort(dim=-1)
    return order, keep.gather(-1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [None, [2, 0], [1]], ids=["every_row", "rows", "one_row"])
@pytest.mark.parametrize("slots, head_dim, block", [(13, 3, 4), (40, 24, 16), (7, 8, 64)])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.9, 1.0])
def test_matches_the_move_by_hand(dtype, rows, slots, head_dim, block, fraction):
    """Blocks whose sources lie in the same block (block 4 and 16: a block's destinations are
    overwritten by its own moves), a head dim that is no power of two, nothing kept, everything kept
    in place (fraction 1: no slot moves), rows not cut left as they are."""
    generator = torch.Generator().manual_seed(slots * 100 + head_dim)
    batch, heads = 3, 2
    keys = torch.randn(batch, heads, slots, head_dim, generator=generator).to(dtype)
    values = torch.randn(batch, heads, slots, head_dim, generator=generator).to(dtype)
    cut = list(range(batch)) if rows is None else rows
    order, kept = kept_in_slot_order(generator, len(cut), heads, slots, fraction)
    expected = move_by_hand(keys, values, order, kept, cut)
    on_device = [t.to(DEVICE) for t in (keys, values)]
    index = None if rows is None else torch.tensor(rows, device=DEVICE)
    compact_in_place(*on_device, order.to(DEVICE), kept.to(DEVICE), index, block=block)
    for got, want in zip(on_device, expected, strict=True):
        assert torch.equal(got.cpu(), want)


def test_rejects_bad_shapes():
    keys = torch.zeros(2, 2, 8, 4, device=DEVICE)
    order = torch.arange(8, device=DEVICE).expand(2, 2, 8).contiguous()
    kept = torch.ones(2, 2, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="order must be"):
        compact_in_place(keys, keys.clone(), order[:1], kept)
    with pytest.raises(ValueError, match="contiguous last dim"):
        compact_in_place(keys.transpose(-1, -2), keys.transpose(-1, -2), order, kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cut", [None, [0, 3, 2]], ids=["every_row", "rows"])
def test_gpu_compact_is_the_cpu_compact(dtype, cut):
    """`SlotCache.compact` on the GPU (the kernel) against the CPU's (gathers) on the same cache: rows
    at different fill levels, positions in slot order with gaps, a per-slot state, a kept subset."""
    generator = torch.Generator().manual_seed(1)
    batch, heads, slots, dim = 4, 8, 300, 128
    caches = [SlotCache(batch, heads, dim, dtype, torch.device(device), [slots],
                        states={"score": SlotState(fill=-2.0)}) for device in ("cpu", "cuda")]
    held = torch.tensor([300, 171, 64, 299])
    valid = (torch.arange(slots) < held[:, None])[:, None, :].expand(batch, heads, slots)
    positions = torch.where(valid, 3 * torch.arange(slots) + 5, -1)
    contents = {"keys": torch.randn(batch, heads, slots, dim, generator=generator).to(dtype),
                "values": torch.randn(batch, heads, slots, dim, generator=generator).to(dtype),
                "valid": valid, "positions": positions}
    keep = valid & (torch.rand(batch, heads, slots, generator=generator) < 0.7)
    rows = None if cut is None else torch.tensor(cut)
    for cache in caches:
        layer, device = cache.layers[0], cache.layers[0].keys.device
        for name, tensor in contents.items():
            getattr(layer, name).copy_(tensor)
        layer.state["score"].copy_(torch.randn(batch, heads, slots, generator=generator.manual_seed(2)))
        cache.compact(0, None if rows is None else rows.to(device),
                      (keep if rows is None else keep[rows]).to(device))
    cpu, gpu = (cache.layers[0] for cache in caches)
    for name in ("keys", "values", "valid", "positions"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    assert torch.equal(gpu.state["score"].cpu(), cpu.state["score"])
    assert torch.equal(caches[1].next_slot[0].cpu(), caches[0].next_slot[0])

"""The fused slot write (`longflow.kernels.slot_write`) against plain PyTorch indexing.

On a machine without CUDA the kernel runs in Triton's interpreter (set before Triton defines it, as
in test_kernel.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from longflow.kernels.slot_write import write_token  # noqa: E402
from longflow.selection import first_free  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def buffers(batch, kv_heads, slots, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype)
    valid = torch.rand(batch, kv_heads, slots, generator=gen) < 0.5
    positions = torch.randint(-1, 100, (batch, kv_heads, slots), generator=gen)
    return [t.to(DEVICE) for t in (keys, values, valid, positions)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: padded to 32 inside the kernel
def test_each_row_and_head_writes_its_next_slot_and_nothing_else(dtype, head_dim):
    batch, kv_heads, slots = 3, 4, 10
    keys, values, valid, positions = buffers(batch, kv_heads, slots, head_dim, dtype, seed=0)
    gen = torch.Generator().manual_seed(1)
    next_slot = torch.randint(0, slots, (batch, kv_heads), generator=gen).to(DEVICE)
    # The attention modules hand over k and v as transposed views: [B, 1, Hkv, D] memory.
    k = torch.randn(batch, 1, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    v = torch.randn(batch, 1, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    token_positions = torch.tensor([7, 200, 3], device=DEVICE)

    expected = [t.clone() for t in (keys, values, valid, positions)]
    for b in range(batch):
        for h in range(kv_heads):
            slot = int(next_slot[b, h])
            expected[0][b, h, slot] = k[b, h, 0]
            expected[1][b, h, slot] = v[b, h, 0]
            expected[2][b, h, slot] = True
            expected[3][b, h, slot] = token_positions[b]

    write_token(keys, values, valid, positions, next_slot, k, v, token_positions)
    for got, want in zip((keys, values, valid, positions), expected, strict=True):
        assert torch.equal(got, want)


def test_advance_moves_each_next_slot_on_and_stops_at_the_last():
    batch, kv_heads, slots = 2, 3, 6
    keys, values, valid, positions = buffers(batch, kv_heads, slots, 8, torch.float32, seed=2)
    next_slot = torch.tensor([[0, 2, 5], [4, 5, 1]], device=DEVICE)
    k = torch.randn(batch, kv_heads, 1, 8, device=DEVICE)
    write_token(keys, values, valid, positions, next_slot, k, k, torch.tensor([3, 9], device=DEVICE), advance=True)
    assert next_slot.tolist() == [[1, 3, 5], [5, 5, 2]]
    assert keys[1, 1, 5].equal(k[1, 1, 0]) and keys[0, 2, 5].equal(k[0, 2, 0])


def test_a_strided_last_dim_is_refused():
    keys, values, valid, positions = buffers(1, 2, 4, 8, torch.float32, seed=0)
    k = torch.randn(1, 2, 1, 16, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="contiguous last dim"):
        write_token(keys, values, valid, positions, torch.zeros(1, 2, dtype=torch.long, device=DEVICE), k, k,
                    torch.zeros(1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("slots", [10, 2500])  # 2500: the search runs over three blocks of 1024
@pytest.mark.parametrize("with_usable", [False, True])
def test_find_free_moves_each_next_slot_to_the_first_free_slot_after_the_write(slots, with_usable):
    """`find_free`: `longflow.selection.first_free` over the cache as the write leaves it, per row and KV
    head (within the head's usable slots), 0 where none is free; holes anywhere, a head filled in order
    whose free slots start past the first block, and a full head."""
    batch, kv_heads = 2, 3
    keys, values, valid, positions = buffers(batch, kv_heads, slots, 8, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    valid[0, 1] = torch.arange(slots, device=DEVICE) < slots - 3  # in order: free from slots - 3 on
    valid[1, 2] = True  # full once the write lands
    next_slot = torch.randint(0, slots, (batch, kv_heads), generator=gen).to(DEVICE)
    next_slot[0, 1] = slots - 3
    usable = None
    if with_usable:
        usable = torch.rand(kv_heads, slots, generator=gen).to(DEVICE) < 0.7
        usable[1] = True
    k = torch.randn(batch, kv_heads, 1, 8, device=DEVICE)
    write_token(keys, values, valid, positions, next_slot, k, k, torch.tensor([3, 9], device=DEVICE),
                find_free=True, usable=usable)
    assert torch.equal(next_slot, first_free(valid, usable))
    assert next_slot[0, 1] == slots - 2 and next_slot[1, 2] == 0


def test_advance_and_find_free_are_one_rule_or_the_other():
    keys, values, valid, positions = buffers(1, 2, 4, 8, torch.float32, seed=0)
    k = torch.randn(1, 2, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="take one"):
        write_token(keys, values, valid, positions, torch.zeros(1, 2, dtype=torch.long, device=DEVICE), k, k,
                    torch.zeros(1, dtype=torch.long, device=DEVICE), advance=True, find_free=True)

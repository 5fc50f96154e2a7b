"""Each key's newest near-duplicate among the keys of its head, without the S x S similarity matrix.

R-KV's redundancy (baselines/rkv.py, docs/methods.md "R-KV") needs, for every held key i, the
newest slot j != i whose cosine similarity with it exceeds a threshold. In PyTorch that is the
`[B, Hkv, S, S]` float32 similarity written, compared and searched: at Figure 3's batch (408 rows,
1744 slots, 8 KV heads) about 40 GB of temporaries per layer. Here the slots are cut into tiles of
`block`, the products run on the tensor cores, and nothing of size S x S is written.

The similarity is symmetric, so each pair of tiles is multiplied once, in two launches:
- `_newer_pass`: the program of row tile I walks the column tiles J >= I, newest first. Each product
  serves both sides: the rows of I take their newest duplicate in J (the newest tile holding one
  wins, as the walk goes newest first), and the rows of J (J > I) their newest duplicate among I's
  slots, all older than their own, through a 64-bit atomic max on (slot << 32 | similarity bits),
  in which the slot decides. A program stops as soon as each of its rows has found a duplicate,
  which a trained model's keys mostly do in the first tiles; it records the lowest tile it reached.
- `_older_pass`: a row with no duplicate in its own tile or newer ones takes the atomic's older
  one. Only where some program I stopped before reaching its tile does it multiply that pair
  itself, walking those tiles newest first and only while one of its rows could still find a newer
  older duplicate there. With independent keys (a random-weight model's: almost no pair passes)
  no program stops early, this pass multiplies nothing, and the search costs half the products of
  a walk of every tile pair.

Arithmetic: S_ij = ((k_i . k_j) * r_j) * r_i, with r = held / (||k|| + 1e-8), the unit keys'
similarity of the PyTorch path regrouped, on either side of a product. For bf16 / fp16 keys the
products are exact in the fp32 accumulator; fp32 keys are multiplied in IEEE fp32 (no TF32).
Either way S_ij can differ from the PyTorch value by a few float32 roundings, so a similarity
within ~1e-6 of the threshold may fall on the other side of it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.reductions import reduce_max, reduce_sum  # noqa: E402

_MAX_GRID_Y = 65535


@triton.jit
def _product(row_keys, col_keys, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(row_keys, tl.trans(col_keys), input_precision="ieee")
    return tl.dot(row_keys, tl.trans(col_keys))


@triton.jit
def _newest_above(similarity, slots_along, threshold, AXIS: tl.constexpr):
    """Along AXIS of `similarity`: the largest slot of `slots_along` (broadcast over the other
    axis) whose similarity passes the threshold (-1 where none) and that similarity."""
    newest = reduce_max(tl.where(similarity > threshold, slots_along, -1), AXIS)
    if AXIS == 1:
        at_newest = reduce_sum(tl.where(slots_along == newest[:, None], similarity, 0.0), 1)
    else:
        at_newest = reduce_sum(tl.where(slots_along == newest[None, :], similarity, 0.0), 0)
    return newest, at_newest


@triton.jit
def _newer_pass(
    KEYS, INVERSE_NORMS, INDEX, SIMILARITY, OLDER, LOWEST_TILE,
    stride_keys_n, stride_keys_s, stride_norms_n, stride_out_n, stride_lowest_n,
    slots, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (tile, n): rows `tile * BLOCK + [0, BLOCK)` of head n against the column tiles from
    the newest down to its own. Writes each row's duplicate in those tiles to INDEX / SIMILARITY
    (-1 / 0 where none), the older side's to OLDER by atomic max, and the lowest column tile it
    multiplied to LOWEST_TILE.

    The row tiles of one head are the grid's fastest axis, so the programs that read a head's keys
    run together and mostly find them in L2. The next column tile is loaded before the current one
    is multiplied (a `while` loop, which the early exit needs, is not software-pipelined by Triton)."""
    tile = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    rows = tile * BLOCK + offs
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < slots
    dim_ok = dims < HEAD_DIM
    head_keys = KEYS + n * stride_keys_n
    head_norms = INVERSE_NORMS + n * stride_norms_n
    row_keys = tl.load(head_keys + rows[:, None] * stride_keys_s + dims[None, :],
                       mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK, HEAD_DIM_PAD]
    row_norms = tl.load(head_norms + rows, mask=row_ok, other=0.0)
    found = tl.full([BLOCK], -1, tl.int32)
    value = tl.full([BLOCK], 0.0, tl.float32)
    last = (slots - 1) // BLOCK
    col_tile = last
    cols = last * BLOCK + offs
    col_ok = cols < slots
    col_keys = tl.load(head_keys + cols[:, None] * stride_keys_s + dims[None, :],
                       mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK, HEAD_DIM_PAD]
    col_norms = tl.load(head_norms + cols, mask=col_ok, other=0.0)
    missing = reduce_sum(row_ok.to(tl.int32), 0)
    while (col_tile >= tile) & (missing > 0):
        next_cols = cols - BLOCK
        next_ok = next_cols >= tile * BLOCK  # below the row tile: nothing loaded
        next_keys = tl.load(head_keys + next_cols[:, None] * stride_keys_s + dims[None, :],
                            mask=next_ok[:, None] & dim_ok[None, :], other=0.0)
        next_norms = tl.load(head_norms + next_cols, mask=next_ok, other=0.0)
        products = _product(row_keys, col_keys, IEEE)  # [BLOCK rows, BLOCK cols]
        # The epilogue runs on every element of the walk, beside a product on the tensor cores, so
        # it is one product and one maximum per element and side; what only some tiles need is
        # branched on per tile. S_ij = (k_i . k_j r_j) r_i, and r_i >= 0 keeps the order of a row:
        # its largest S_ij is its largest k_i . k_j r_j times r_i, so a row has a duplicate in the
        # tile iff that passes the threshold, and the duplicates are looked for only where one does.
        scaled = products * col_norms[None, :]
        if col_tile == tile:  # S_ii = 0, then compared
            scaled = tl.where(rows[:, None] == cols[None, :], 0.0, scaled)
        if col_tile == last:  # the newest tile: no slot past the last one
            largest = reduce_max(tl.where(col_ok[None, :], scaled, float("-inf")), 1)
        else:
            largest = reduce_max(scaled, 1)
        take = (found < 0) & (largest * row_norms > threshold)  # a newer tile's duplicate stands
        if reduce_max(take.to(tl.int32), 0) > 0:
            newest, at_newest = _newest_above(tl.where(col_ok[None, :], scaled * row_norms[:, None], float("-inf")),
                                              cols[None, :], threshold, 1)
            found = tl.where(take, newest, found)
            value = tl.where(take, at_newest, value)
            missing = reduce_sum(((found < 0) & row_ok).to(tl.int32), 0)
        if col_tile > tile:  # the columns' rows, whose candidates here are all older: S_ji = (k_j . k_i r_i) r_j
            across = products * row_norms[:, None]  # this row tile is below the newest: every row is a slot
            hit = col_ok & (reduce_max(across, 0) * col_norms > threshold)
            if reduce_max(hit.to(tl.int32), 0) > 0:
                older, at_older = _newest_above(across * col_norms[None, :], rows[:, None], threshold, 0)
                packed = (older.to(tl.int64) << 32) | (at_older.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
                tl.atomic_max(OLDER + n * stride_out_n + cols, packed, mask=hit)
        col_tile -= 1
        cols, col_ok, col_keys, col_norms = next_cols, next_ok, next_keys, next_norms
    tl.store(LOWEST_TILE + n * stride_lowest_n + tile, col_tile + 1)
    tl.store(INDEX + n * stride_out_n + rows, found.to(tl.int64), mask=row_ok)
    tl.store(SIMILARITY + n * stride_out_n + rows, value, mask=row_ok)


@triton.jit
def _older_pass(
    KEYS, INVERSE_NORMS, INDEX, SIMILARITY, OLDER, LOWEST_TILE,
    stride_keys_n, stride_keys_s, stride_norms_n, stride_out_n, stride_lowest_n,
    slots, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (tile, n): each row's answer, its newer side's duplicate or else its older side's,
    the latter completed in the tile pairs that `_newer_pass` left out; slot S - 1 and 0 where none."""
    tile = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    rows = tile * BLOCK + offs
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < slots
    dim_ok = dims < HEAD_DIM
    out = n * stride_out_n + rows
    found = tl.load(INDEX + out, mask=row_ok, other=0)
    value = tl.load(SIMILARITY + out, mask=row_ok, other=0.0)
    packed = tl.load(OLDER + out, mask=row_ok, other=-1)
    older = packed >> 32  # -1 where none
    at_older = (packed & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    older_tile = tl.where(older >= 0, older // BLOCK, -1)
    need = row_ok & (found < 0)
    other = tile - 1
    # A row is settled once its older duplicate lies in a tile at or above the next one searched.
    missing = reduce_sum((need & (older_tile < other)).to(tl.int32), 0)
    if missing > 0:
        head_keys = KEYS + n * stride_keys_n
        head_norms = INVERSE_NORMS + n * stride_norms_n
        row_keys = tl.load(head_keys + rows[:, None] * stride_keys_s + dims[None, :],
                           mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        row_norms = tl.load(head_norms + rows, mask=row_ok, other=0.0)
        while (other >= 0) & (missing > 0):
            if tile < tl.load(LOWEST_TILE + n * stride_lowest_n + other):  # a pair the newer pass left out
                cols = other * BLOCK + offs  # below this tile: every column is a slot
                col_keys = tl.load(head_keys + cols[:, None] * stride_keys_s + dims[None, :],
                                   mask=dim_ok[None, :], other=0.0)
                col_norms = tl.load(head_norms + cols)
                similarity = _product(row_keys, col_keys, IEEE) * col_norms[None, :] * row_norms[:, None]
                newest, at_newest = _newest_above(similarity, cols[None, :], threshold, 1)
                take = need & (older_tile < other) & (newest >= 0)
                older = tl.where(take, newest.to(tl.int64), older)
                at_older = tl.where(take, at_newest, at_older)
                older_tile = tl.where(take, other, older_tile)
            other -= 1
            missing = reduce_sum((need & (older_tile < other)).to(tl.int32), 0)
    index = tl.where(found >= 0, found, tl.where(older >= 0, older, slots - 1))
    similarity = tl.where(found >= 0, value, tl.where(older >= 0, at_older, 0.0))
    tl.store(INDEX + out, index, mask=row_ok)
    tl.store(SIMILARITY + out, similarity, mask=row_ok)


def newest_duplicates(keys: torch.Tensor, inverse_norms: torch.Tensor, threshold: float, *,
                      block: int = 128, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """For each key i of `keys` `[..., S, D]`: the newest (largest) slot j with
    S_ij = ((k_i . k_j) * r_j) * r_i > threshold, S_ii taken as 0, and that S_ij; slot S - 1 and 0
    where there is none.

    `inverse_norms` `[..., S]` float32 holds r (0 on a slot not held, so that it adds nothing).
    Returns (slot `[..., S]` int64, similarity `[..., S]` float32), as `baselines.rkv`'s PyTorch path.
    `block` (a power of two >= 16) is the slots of a tile, rows and columns; the defaults are the
    H200 sweep's (`python -m evals.bench.duplicates --sweep`, docs/benchmarks.md).
    """
    *lead, slots, head_dim = keys.shape
    if tuple(inverse_norms.shape) != (*lead, slots):
        raise ValueError(f"inverse_norms has shape {tuple(inverse_norms.shape)}, expected {(*lead, slots)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    flat = keys.reshape(-1, slots, head_dim)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    norms = inverse_norms.reshape(-1, slots).float().contiguous()
    index = torch.empty(norms.shape, dtype=torch.long, device=keys.device)
    similarity = torch.empty(norms.shape, dtype=torch.float32, device=keys.device)
    if index.numel() == 0:
        return index.view(*lead, slots), similarity.view(*lead, slots)
    tiles = triton.cdiv(slots, block)
    older = torch.full(norms.shape, -1, dtype=torch.long, device=keys.device)  # (slot << 32 | bits), -1: none
    lowest_tile = torch.empty(norms.shape[0], tiles, dtype=torch.int32, device=keys.device)
    # The heads are the grid's second axis, which CUDA caps at 65535 programs.
    for first in range(0, norms.shape[0], _MAX_GRID_Y):
        heads = slice(first, first + _MAX_GRID_Y)
        grid = (tiles, norms[heads].shape[0])
        arguments = (flat[heads], norms[heads], index[heads], similarity[heads], older[heads], lowest_tile[heads],
                     flat.stride(0), flat.stride(1), norms.stride(0), index.stride(0), lowest_tile.stride(0),
                     slots, float(threshold))
        constants = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK=block,
                         IEEE=keys.dtype == torch.float32, num_warps=num_warps)
        _newer_pass[grid](*arguments, **constants)
        _older_pass[grid](*arguments, **constants)
    return index.view(*lead, slots), similarity.view(*lead, slots)

"""Each key's newest near-duplicate among the keys of its head, without the S x S similarity matrix.

R-KV's redundancy (baselines/rkv.py, docs/methods.md "R-KV") needs, for every held key i, the
newest slot j != i whose cosine similarity with it exceeds a threshold. In PyTorch that is the
`[B, Hkv, S, S]` float32 similarity written, compared and searched: at Figure 3's batch (408 rows,
1744 slots, 8 KV heads) about 40 GB of temporaries per layer, and the whole compression costs about
140 decode steps. Here one program holds a tile of rows and walks the column tiles from the newest
slot down, with the products on the tensor cores; a tile stops as soon as each of its rows has
found a duplicate (its newest one lies in the newest tile that holds one), and nothing of size
S x S is written.

Arithmetic: S_ij = ((k_i . k_j) * r_j) * r_i, with r = held / (||k|| + 1e-8), the unit keys'
similarity of the PyTorch path regrouped. For bf16 / fp16 keys the products are exact in the fp32
accumulator; fp32 keys are multiplied in IEEE fp32 (no TF32), and so are 16-bit keys under the
interpreter (`longflow.kernels.precision`). Either way S_ij can differ from the
PyTorch value by a few float32 roundings, so a similarity within ~1e-6 of the threshold may fall on
the other side of it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # As in longflow_attention: the interpreter's switch is read when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from longflow.kernels.precision import ieee_products  # noqa: E402
from longflow.kernels.reductions import reduce_max, reduce_sum  # noqa: E402

_MAX_GRID_Y = 65535


@triton.jit
def _newest_duplicate_kernel(
    KEYS, INVERSE_NORMS, INDEX, SIMILARITY,
    stride_keys_n, stride_keys_s, stride_norms_n, stride_out_n,
    slots, threshold,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile, n): rows `tile * BLOCK_I + [0, BLOCK_I)` of head n, searched newest tile first.

    The row tiles of one head are the grid's fastest axis, so the programs that read a head's keys
    run together and mostly find them in L2: with the head first, each program read its columns
    from DRAM (all S / BLOCK_I row tiles of a head were B * Hkv programs apart). Each column tile
    is loaded where it is multiplied: the walk is bound by its products and epilogue taking turns,
    not by its loads (Nsight Compute on the H200: DRAM 5%, L2 21% busy), and staging the next tile
    through registers spilled more and ran 7% slower (longflow/kernels/NOTES.md)."""
    n = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < slots
    dim_ok = dims < HEAD_DIM
    head_keys = KEYS + n * stride_keys_n
    head_norms = INVERSE_NORMS + n * stride_norms_n
    row_keys = tl.load(head_keys + rows[:, None] * stride_keys_s + dims[None, :],
                       mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_I, HEAD_DIM_PAD]
    row_norms = tl.load(head_norms + rows, mask=row_ok, other=0.0)
    found = tl.full([BLOCK_I], -1, tl.int32)
    value = tl.full([BLOCK_I], 0.0, tl.float32)
    start = (slots - 1) // BLOCK_J * BLOCK_J  # the newest tile's first slot
    first_row = tl.program_id(0) * BLOCK_I
    missing = reduce_sum(row_ok.to(tl.int32), 0)
    while (start >= 0) & (missing > 0):
        cols = start + tl.arange(0, BLOCK_J)
        col_ok = cols < slots
        col_keys = tl.load(head_keys + cols[:, None] * stride_keys_s + dims[None, :],
                           mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_J, HEAD_DIM_PAD]
        col_norms = tl.load(head_norms + cols, mask=col_ok, other=0.0)
        if IEEE:
            products = tl.dot(row_keys.to(tl.float32), tl.trans(col_keys.to(tl.float32)), input_precision="ieee")
        else:
            products = tl.dot(row_keys, tl.trans(col_keys))
        # The epilogue runs on every element of the walk, beside a product on the tensor cores, so
        # it is one product and one maximum per element; what only some tiles need is branched on
        # per tile. S_ij = (k_i . k_j r_j) r_i, and r_i >= 0 keeps the order of a row: its largest
        # S_ij is its largest k_i . k_j r_j times r_i, so a row has a duplicate in the tile iff that
        # passes the threshold, and the duplicates are looked for only in the tiles where one does.
        scaled = products * col_norms[None, :]  # [BLOCK_I, BLOCK_J]
        if (start < first_row + BLOCK_I) & (start + BLOCK_J > first_row):  # S_ii = 0, then compared
            scaled = tl.where(rows[:, None] == cols[None, :], 0.0, scaled)
        if start + BLOCK_J > slots:  # the newest tile: no slot past the last one
            largest = reduce_max(tl.where(cols[None, :] < slots, scaled, float("-inf")), 1)
        else:
            largest = reduce_max(scaled, 1)
        take = (found < 0) & (largest * row_norms > threshold)  # a newer tile's duplicate stands
        if reduce_max(take.to(tl.int32), 0) > 0:
            similarity = scaled * row_norms[:, None]
            duplicate = (similarity > threshold) & (cols < slots)[None, :]
            newest = reduce_max(tl.where(duplicate, cols[None, :], -1), 1)
            at_newest = reduce_sum(tl.where(cols[None, :] == newest[:, None], similarity, 0.0), 1)
            found = tl.where(take, newest, found)
            value = tl.where(take, at_newest, value)
            missing = reduce_sum(((found < 0) & row_ok).to(tl.int32), 0)
        start -= BLOCK_J
    tl.store(INDEX + n * stride_out_n + rows, tl.where(found < 0, slots - 1, found).to(tl.int64), mask=row_ok)
    tl.store(SIMILARITY + n * stride_out_n + rows, value, mask=row_ok)


def newest_duplicates(keys: torch.Tensor, inverse_norms: torch.Tensor, threshold: float, *,
                      block_rows: int = 256, block_cols: int = 64, num_warps: int = 4
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each key i of `keys` `[..., S, D]`: the newest (largest) slot j != i with
    S_ij = ((k_i . k_j) * r_j) * r_i > threshold, and that S_ij; slot S - 1 and 0 where there is none.

    `inverse_norms` `[..., S]` float32 holds r (0 on a slot not held, so that it adds nothing).
    Returns (slot `[..., S]` int64, similarity `[..., S]` float32), as `baselines.rkv`'s PyTorch path.
    `block_rows` x `block_cols` (powers of two >= 16) is the tile of one product; the defaults are
    the H200 sweep's (`python -m evals.bench.duplicates --sweep`, docs/benchmarks.md).
    """
    *lead, slots, head_dim = keys.shape
    if tuple(inverse_norms.shape) != (*lead, slots):
        raise ValueError(f"inverse_norms has shape {tuple(inverse_norms.shape)}, expected {(*lead, slots)}")
    for name, block in (("block_rows", block_rows), ("block_cols", block_cols)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    flat = keys.reshape(-1, slots, head_dim)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    norms = inverse_norms.reshape(-1, slots).float().contiguous()
    index = torch.empty(norms.shape, dtype=torch.long, device=keys.device)
    similarity = torch.empty(norms.shape, dtype=torch.float32, device=keys.device)
    # The heads are the grid's second axis, which CUDA caps at 65535 programs.
    for first in range(0, norms.shape[0], _MAX_GRID_Y):
        heads = slice(first, first + _MAX_GRID_Y)
        grid = (triton.cdiv(slots, block_rows), norms[heads].shape[0])
        _newest_duplicate_kernel[grid](
            flat[heads], norms[heads], index[heads], similarity[heads], flat.stride(0), flat.stride(1),
            norms.stride(0), index.stride(0), slots, float(threshold),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_I=block_rows,
            BLOCK_J=block_cols, IEEE=ieee_products(keys.dtype), num_warps=num_warps,
        )
    return index.view(*lead, slots), similarity.view(*lead, slots)

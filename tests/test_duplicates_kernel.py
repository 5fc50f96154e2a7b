"""R-KV's newest-duplicate search as a Triton kernel (`longflow.kernels.newest_duplicates`; on the CPU
through Triton's interpreter): against the rule written out by hand (docs/methods.md, "R-KV": in each
row i the newest j != i with S_ij > threshold), against the blocked PyTorch search the CPU path keeps,
and, on a GPU, R-KV's scores and kept slots against the CPU's."""

from __future__ import annotations

import math

import pytest
import torch

from baselines.rkv import blocked_newest_duplicates, rkv_scores
from longflow.kernels import newest_duplicates
from longflow.selection import choose_keep, chosen_mask

pytestmark = pytest.mark.kernels

# The kernel runs on the GPU where there is one, else through the interpreter on CPU tensors.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def keys_with_duplicates(seed: int, lead: tuple[int, ...], slots: int, head_dim: int, shared: float = 1.2
                         ) -> torch.Tensor:
    """Keys around a shared direction of weight `shared` (at 1.2 many pairs pass 0.5 and row tiles
    stop early, at 0 few and they walk every column tile) with some exact copies planted."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(*lead, slots, head_dim, generator=generator)
    keys = keys + shared * torch.randn(*lead, 1, head_dim, generator=generator)
    if slots > 4:
        keys[..., slots // 2, :] = 2.0 * keys[..., 1, :]  # a far duplicate of an old key
    return keys


def inverse_norms(keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    return held / (keys.float().norm(dim=-1) + 1e-8)


@pytest.mark.parametrize("slots", [1, 2, 3, 17, 40, 100])
@pytest.mark.parametrize("block_rows, block_cols", [(16, 16), (64, 64), (16, 32), (32, 16)])
@pytest.mark.parametrize("threshold", [0.5, -0.1])
@pytest.mark.parametrize("shared", [1.2, 0.0])
def test_matches_the_rule_by_hand(slots, block_rows, block_cols, threshold, shared):
    """Several tiles of rows and columns (block 16), a tile that stops early, free slots (r = 0),
    and slot counts that no tile divides; keys with many duplicates and with few. Below zero every
    similarity of 0 passes: a free slot's, S_ii's, but not a column past the last slot's in the
    newest tile."""
    keys = keys_with_duplicates(slots, (2, 2), slots, 24, shared)
    held = torch.ones(2, 2, slots, dtype=torch.bool)
    held[0, 1, ::3] = False
    r = inverse_norms(keys, held)
    index, similarity = (t.cpu() for t in newest_duplicates(keys.to(DEVICE), r.to(DEVICE), threshold,
                                                            block_rows=block_rows, block_cols=block_cols))
    assert_the_rule_by_hand(index, similarity, keys * r[..., None], threshold)


def assert_the_rule_by_hand(index: torch.Tensor, similarity: torch.Tensor, unit: torch.Tensor, threshold: float):
    """The kernel's (slot, similarity) `[B, Hkv, S]` against the rule written out over unit keys
    `[B, Hkv, S, D]`: S_ii taken as 0, the newest j with S_ij > threshold (slot S - 1 and 0 where none)."""
    batch, kv_heads, slots, _ = unit.shape
    for b in range(batch):
        for h in range(kv_heads):
            for i in range(slots):
                sims = [float(unit[b, h, i] @ unit[b, h, j]) if j != i else 0.0 for j in range(slots)]
                above = [j for j in range(slots) if sims[j] > threshold]
                expected = max(above, default=slots - 1)
                assert int(index[b, h, i]) == expected, (b, h, i)
                value = sims[expected] if above else 0.0
                assert math.isclose(float(similarity[b, h, i]), value, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("cosine", [0.505, 0.9])
def test_a_duplicate_just_above_the_threshold_is_found(cosine):
    """Independent keys of one norm with slot 40 at the given cosine to slot 3, in tiles of 16 over
    70 slots: the pair is found from either side, however close to the threshold (a shortcut that
    rules a tile out by an upper bound of its similarities must be exact: one that is 1% low fails
    here)."""
    generator = torch.Generator().manual_seed(0)
    slots, head_dim = 70, 64
    keys = torch.nn.functional.normalize(torch.randn(1, 1, slots, head_dim, generator=generator), dim=-1)
    orthogonal = keys[0, 0, 40] - (keys[0, 0, 40] @ keys[0, 0, 3]) * keys[0, 0, 3]
    keys[0, 0, 40] = cosine * keys[0, 0, 3] + math.sqrt(1 - cosine**2) * orthogonal / orthogonal.norm()
    keys = 3.0 * keys
    r = inverse_norms(keys, torch.ones(1, 1, slots, dtype=torch.bool))
    index, similarity = (t.cpu() for t in newest_duplicates(keys.to(DEVICE), r.to(DEVICE), 0.5,
                                                            block_rows=16, block_cols=16))
    assert_the_rule_by_hand(index, similarity, keys * r[..., None], 0.5)
    assert int(index[0, 0, 3]) >= 40 and int(index[0, 0, 40]) >= 3


# On the interpreter 16-bit tiles are multiplied in float32 (numpy has no bf16); the GPU test below
# covers the tensor-core products.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_blocked_search(dtype):
    """The kernel on stored keys (half-precision products exact in fp32) against the PyTorch search
    on float32 unit keys; every row's duplicate is the same wherever no similarity sits at the
    threshold."""
    keys = keys_with_duplicates(7, (3, 2), 150, 32).to(dtype)
    held = torch.rand(3, 2, 150, generator=torch.Generator().manual_seed(3)) > 0.1
    norms = keys.float().norm(dim=-1, keepdim=True) + 1e-8
    unit = keys.float() / norms * held[..., None]
    expected_index, expected_similarity = blocked_newest_duplicates(unit, 0.5)
    index, similarity = (t.cpu() for t in newest_duplicates(keys.to(DEVICE), (held / norms[..., 0]).to(DEVICE), 0.5,
                                                            block_rows=32, block_cols=32))
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(similarity, expected_similarity, atol=1e-6, rtol=1e-5)


def test_rejects_mismatched_norms():
    keys = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="inverse_norms"):
        newest_duplicates(keys, torch.ones(2, 4), 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rkv_scores_on_the_gpu_keep_the_cpus_slots(dtype):
    """At Qwen3-8B's head shapes (Hq 32, Hkv 8, D 128) and a Figure 3 slot count: R-KV's scores on
    the GPU (kernel) against the CPU's (blocked search), and the slots a compression keeps."""
    generator = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, slots, window, head_dim = 3, 32, 8, 1744, 8, 128
    keys = keys_with_duplicates(1, (batch, kv_heads), slots, head_dim).to(dtype)
    queries = torch.randn(batch, q_heads, window, head_dim, generator=generator).to(dtype)
    held = torch.ones(batch, kv_heads, slots, dtype=torch.bool)
    held[1, :, :100] = False  # left padding
    query_valid = torch.ones(batch, window, dtype=torch.bool)
    args = dict(protect=8, kernel=7, lam=0.1, threshold=0.5)
    cpu = rkv_scores(queries, query_valid, keys, held, head_dim ** -0.5, **args)
    gpu = rkv_scores(queries.cuda(), query_valid.cuda(), keys.cuda(), held.cuda(), head_dim ** -0.5, **args).cpu()
    finite = torch.isfinite(cpu)
    assert torch.equal(finite, torch.isfinite(gpu)) and torch.equal(cpu[~finite], gpu[~finite])
    torch.testing.assert_close(gpu[finite], cpu[finite], atol=1e-6, rtol=1e-4)
    keep = 1024
    assert torch.equal(chosen_mask(choose_keep(gpu, held, keep), held), chosen_mask(choose_keep(cpu, held, keep), held))

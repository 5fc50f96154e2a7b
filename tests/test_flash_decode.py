"""Vanilla's flash-decoding kernel against a plain PyTorch softmax over exactly the filled, valid slots,
and vanilla through that kernel against HF `generate`.

On a machine without CUDA the kernel runs in Triton's interpreter (set before Triton defines it, as
in test_kernel.py); shapes stay small there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers import TEXTS, filled_attention, hf_generate, policy_of  # noqa: E402

from longflow.config import GenerationConfig  # noqa: E402
from longflow.engine import Engine  # noqa: E402
from longflow.kernels import flash_decode  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig  # noqa: E402
from longflow.models import eos_token_ids  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def ragged_inputs(batch, q_heads, kv_heads, slots, head_dim, dtype, seed):
    """Left padding and a filled length per row (not multiples of the tile), with large garbage in
    the slots past each length, marked valid, so that a kernel reading them would be caught."""
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(batch, q_heads, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=gen)
    pad = torch.randint(0, slots // 4, (batch,), generator=gen)
    lengths = torch.randint(slots // 4 + 1, slots + 1, (batch,), generator=gen)
    lengths[0] = slots // 4 + 3  # the shortest: later splits have nothing to read
    index = torch.arange(slots)
    valid = index[None, :] >= pad[:, None]
    past = index[None, :] >= lengths[:, None]  # [B, S]
    k = torch.where(past[:, None, :, None], 50.0, k)  # would dominate any softmax that saw them
    v = torch.where(past[:, None, :, None], 1e3, v)
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), valid.to(**to),
            lengths.to(**to))


CONFIGS = {
    "heuristic": None,
    "one_split": LaunchConfig(block_n=16, splits=1),
    "five_splits": LaunchConfig(block_n=16, splits=5),
    "mask_not_prefetched": LaunchConfig(block_n=32, splits=2, prefetch=False),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_filled_valid_slots(config, q_heads, kv_heads, dtype):
    q, k, v, valid, lengths = ragged_inputs(3, q_heads, kv_heads, 150, 32, dtype, seed=q_heads)
    scale = 32**-0.5
    out = flash_decode(q, k, v, valid, lengths, scale, config=CONFIGS[config])
    expected = filled_attention(q, k, v, valid, lengths, scale)
    assert out.shape == q.shape and out.dtype == dtype
    error = (out.double() - expected).norm() / expected.norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


def test_lengths_as_a_strided_view_and_past_the_end():
    """`next_slot[:, 0]` of a `[B, Hkv]` tensor, as vanilla passes it; a length past S means all slots."""
    q, k, v, valid, lengths = ragged_inputs(2, 4, 2, 70, 16, torch.float32, seed=7)
    lengths[1] = 500
    next_slot = lengths[:, None].expand(2, 2).contiguous()
    out = flash_decode(q, k, v, valid, next_slot[:, 0], config=LaunchConfig(block_n=16, splits=3))
    expected = filled_attention(q, k, v, valid, lengths.clamp(max=70), 16**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["heuristic", "five_splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_slot_with_a_validity_mask_per_kv_head(config, dtype):
    """No lengths (the interval methods' caches, whose free slots lie anywhere): every slot is read
    and each KV head's own mask decides, here holes at random and garbage in the invalid slots."""
    q, k, v, _, _ = ragged_inputs(3, 8, 2, 150, 32, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    valid = (torch.rand(3, 2, 150, generator=gen) < 0.6).to(DEVICE)
    valid[0, 1] = False  # a KV head holding nothing: its query heads come out 0
    k = torch.where(valid[..., None], k, torch.full_like(k, 50.0))
    v = torch.where(valid[..., None], v, torch.full_like(v, 1e3))
    out = flash_decode(q, k, v, valid, None, 32**-0.5, config=CONFIGS[config])
    group = 4
    expected = torch.stack([
        filled_attention(q[:, h * group:(h + 1) * group], k[:, h:h + 1], v[:, h:h + 1], valid[:, h],
                         torch.full((3,), 150, device=DEVICE), 32**-0.5)
        for h in range(2)], dim=1).flatten(1, 2)  # [B, Hq, D]
    expected = expected.nan_to_num(0.0)
    assert out.shape == q.shape and out.dtype == dtype
    assert out[0, group:].abs().max() == 0
    error = (out.double() - expected).norm() / expected.norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


def test_rejects_a_per_head_mask_of_the_wrong_shape():
    q, k, v, valid, lengths = ragged_inputs(2, 4, 2, 32, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="per-head valid"):
        flash_decode(q, k, v, valid[:, None, :].expand(2, 3, 32), None)


def test_rejects_bad_lengths():
    q, k, v, valid, lengths = ragged_inputs(2, 2, 2, 32, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="lengths"):
        flash_decode(q, k, v, valid, lengths.float())
    with pytest.raises(ValueError, match="lengths"):
        flash_decode(q, k, v, valid, lengths[:1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model; test_gpu.py runs it on the GPU")
def test_vanilla_through_the_kernel_matches_hf_generate(tiny):
    """The whole decode through the kernel, in the interpreter: HF's greedy tokens."""
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = Engine(model, lambda: policy_of("vanilla", None, use_kernel="triton"),
                    eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=12), [0, 1, 2])
    assert result.tokens == hf_generate(model, tokenizer, prompts, max_new_tokens=12, do_sample=False)

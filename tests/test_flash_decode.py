"""Vanilla's flash-decoding kernel against a plain PyTorch softmax over exactly the filled, valid slots,
with its combine in a second launch or in the pass; `append_decode` (the token's write, that pass and
its combine in one launch) against PyTorch's scatters and that softmax; and vanilla through these
kernels against HF `generate`.

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

from baselines import vanilla  # noqa: E402
from longflow.config import EngineConfig, GenerationConfig  # noqa: E402
from longflow.engine import Engine  # noqa: E402
from longflow.kernels import append_decode, flash_decode  # noqa: E402
from longflow.kernels.longflow_attention import LaunchConfig  # noqa: E402
from longflow.models import eos_token_ids  # noqa: E402

pytestmark = pytest.mark.kernels

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


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_combine_in_the_pass(config, dtype):
    """With `arrivals` the last program of each KV head combines its splits: the same softmax, with
    lengths or with every slot read under a per-head mask, and the counters back at 0 after each call."""
    q, k, v, valid, lengths = ragged_inputs(3, 8, 2, 150, 32, dtype, seed=11)
    arrivals = torch.zeros(3 * 2, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # a second call finds the counters as the first left them
        out = flash_decode(q, k, v, valid, lengths, 32**-0.5, config=CONFIGS[config], arrivals=arrivals)
        expected = filled_attention(q, k, v, valid, lengths, 32**-0.5)
        error = (out.double() - expected).norm() / expected.norm()
        assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
        assert arrivals.eq(0).all()
    per_head = valid[:, None, :].expand(3, 2, 150).clone()
    per_head[1, 0, :60] = False
    out = flash_decode(q, k, v, per_head, None, 32**-0.5, config=CONFIGS[config], arrivals=arrivals)
    expected = flash_decode(q, k, v, per_head, None, 32**-0.5, config=CONFIGS[config])  # the second launch's
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert arrivals.eq(0).all()


def scattered(keys, values, valid, positions, next_slot, new_k, new_v, token_positions):
    """The token's write as PyTorch's scatters (what `SlotCache.write` does without its kernel), on copies;
    next_slot advanced to at most the last slot."""
    keys, values, valid, positions, next_slot = (x.clone() for x in (keys, values, valid, positions, next_slot))
    batch, kv_heads, slots, head_dim = keys.shape
    where = next_slot[..., None, None].expand(batch, kv_heads, 1, head_dim)
    keys.scatter_(2, where, new_k)
    values.scatter_(2, where, new_v)
    valid.scatter_(2, next_slot[..., None], True)
    positions.scatter_(2, next_slot[..., None], token_positions[:, None, None].expand(-1, kv_heads, 1))
    return keys, values, valid, positions, (next_slot + 1).clamp(max=slots - 1)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_decode_writes_the_token_and_attends_over_it(config, q_heads, kv_heads, dtype):
    """Three steps: each writes the token where the scatters put it (cache, validity, position), moves
    next_slot on, and attends over the filled valid slots and the token. Row 1 starts at the last slot,
    where it stays and keeps being overwritten, attending over the slots before it and the token. The
    token comes as attention modules hand it over: a transposed `[B, 1, Hkv, D]` view."""
    batch, slots, head_dim, scale = 3, 150, 32, 32**-0.5
    q, keys, values, valid, lengths = ragged_inputs(batch, q_heads, kv_heads, slots, head_dim, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    valid = valid[:, None, :].expand(batch, kv_heads, slots).clone()
    positions = torch.randint(0, 1000, (batch, kv_heads, slots), generator=gen).to(DEVICE)
    lengths[1] = slots - 1
    next_slot = lengths[:, None].expand(batch, kv_heads).clone()
    arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32, device=DEVICE)
    expected_state = (keys, values, valid, positions, next_slot)
    for step in range(3):
        new_k, new_v = (torch.randn(batch, 1, kv_heads, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
                        for _ in range(2))
        token_positions = torch.tensor([600 + step, 700 + step, 800 + step], device=DEVICE)
        seen = expected_state[4][:, 0] + 1  # the slots before the token's and the token
        expected_state = scattered(*expected_state, new_k, new_v, token_positions)
        out = append_decode(q, new_k, new_v, keys, values, valid, positions, next_slot, token_positions, arrivals,
                            scale, config=CONFIGS[config])
        expected = filled_attention(q, expected_state[0], expected_state[1], expected_state[2][:, 0], seen, scale)
        error = (out.double() - expected).norm() / expected.norm()
        assert error < TOLERANCE[dtype], f"step {step}: relative error {error:.2e}"
        for name, got, want in zip(("keys", "values", "valid", "positions", "next_slot"),
                                   (keys, values, valid, positions, next_slot), expected_state, strict=True):
            assert torch.equal(got, want), f"step {step}: {name}"
        assert arrivals.eq(0).all()
    assert next_slot[1].eq(slots - 1).all()


def test_append_decode_rejects_what_it_cannot_write():
    q, k, v, valid, lengths = ragged_inputs(2, 4, 2, 32, 16, torch.float32, seed=0)
    valid = valid[:, None, :].expand(2, 2, 32).contiguous()
    positions = torch.zeros(2, 2, 32, dtype=torch.long, device=DEVICE)
    next_slot = lengths[:, None].expand(2, 2).contiguous()
    new = torch.randn(2, 2, 1, 16, device=DEVICE)
    tokens = torch.tensor([5, 6], device=DEVICE)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    good = dict(q=q, new_k=new, new_v=new, keys=k, values=v, valid=valid, positions=positions, next_slot=next_slot,
                token_positions=tokens, arrivals=arrivals)
    bad = {
        "arrivals": arrivals[:3], "next_slot": next_slot.int(), "positions": positions.int(),
        "valid": valid[:, 0], "token_positions": tokens.float(), "new_k": new[..., :8],
        "keys": k.transpose(2, 3).contiguous().transpose(2, 3),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            append_decode(**good | {name: value})
    with pytest.raises(TypeError, match="new_k"):
        append_decode(**good | {"new_k": new.double()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model; test_gpu.py runs it on the GPU")
@pytest.mark.parametrize("one_launch", [False, True])
def test_vanilla_through_the_kernel_matches_hf_generate(tiny, one_launch, monkeypatch):
    """The whole decode through the kernels, in the interpreter: HF's greedy tokens, with the step's
    write, attention and combine in three launches or in one (`one_launch`: every layer of the 11
    decode forwards)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return append_decode(*args, **kwargs)

    monkeypatch.setattr(vanilla, "append_decode", counted)
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = Engine(model, lambda: policy_of("vanilla", None, use_kernel="triton", one_launch=one_launch),
                    eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=12), [0, 1, 2])
    assert result.tokens == hf_generate(model, tokenizer, prompts, max_new_tokens=12, do_sample=False)
    assert len(calls) == (11 * model.config.num_hidden_layers if one_launch else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model; test_gpu.py runs it on the GPU")
def test_vanilla_in_one_launch_serves_continuously(tiny):
    """Continuous batching through `append_decode` in the interpreter: admissions into freed rows, and
    released rows decoding padding at their last slot, give every item the tokens of three launches."""
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]

    def served(one_launch):
        engine = Engine(model, lambda: policy_of("vanilla", None, use_kernel="triton", one_launch=one_launch),
                        [], tokenizer.pad_token_id, EngineConfig(batch_size=2, refill_rows=1, check_every=4))
        generation = GenerationConfig(max_new_tokens=20, ignore_eos=True)
        rounds = engine.serve(prompts, generation, [0, 1, 2], limits=[6, 20, 11])
        tokens = {item.index: item.tokens for round_ in rounds for item in round_.finished}
        return [tokens[i] for i in range(len(prompts))]

    assert served(True) == served(False)

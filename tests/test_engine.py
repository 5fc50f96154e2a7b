"""The engine against HF `generate`: same greedy tokens, batched with left padding, for every family."""

from __future__ import annotations

import pytest
import torch
from helpers import TEXTS, hf_generate

from baselines.vanilla import VanillaPolicy
from longflow.config import GenerationConfig
from longflow.engine import Engine
from longflow.models import eos_token_ids


def engine_for(model, tokenizer, eos=None):
    eos = eos_token_ids(model, tokenizer) if eos is None else eos
    return Engine(model, VanillaPolicy, eos, tokenizer.pad_token_id)


def prompts_of(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def test_greedy_matches_hf_generate_batched(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    result = engine_for(model, tokenizer).generate(prompts, GenerationConfig(max_new_tokens=24), [0, 1, 2])
    expected = hf_generate(model, tokenizer, prompts, max_new_tokens=24, do_sample=False)
    assert result.tokens == expected
    assert result.finish_reasons == ["eos" if len(t) < 24 else "length" for t in expected]


def test_repetition_penalty_matches_hf(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    config = GenerationConfig(max_new_tokens=16, repetition_penalty=1.3)
    result = engine_for(model, tokenizer).generate(prompts, config, [0, 1, 2])
    expected = hf_generate(model, tokenizer, prompts, max_new_tokens=16, do_sample=False,
                           repetition_penalty=1.3)
    assert result.tokens == expected


def test_per_row_eos_stops_that_row_only(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    free = engine_for(model, tokenizer, eos=[]).generate(prompts, GenerationConfig(max_new_tokens=12), [0, 1, 2])
    stop_token = free.tokens[0][4]  # make row 0's fifth token an end-of-sequence token
    result = engine_for(model, tokenizer, eos=[stop_token]).generate(
        prompts, GenerationConfig(max_new_tokens=12), [0, 1, 2])
    first = free.tokens[0].index(stop_token)
    assert result.tokens[0] == free.tokens[0][: first + 1]
    assert result.finish_reasons[0] == "eos"
    for row in (1, 2):
        if stop_token in free.tokens[row]:
            assert result.tokens[row] == free.tokens[row][: free.tokens[row].index(stop_token) + 1]
        else:
            assert result.tokens[row] == free.tokens[row] and result.finish_reasons[row] == "length"


def test_full_cache_holds_prompt_plus_generated_tokens(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    result = engine_for(model, tokenizer, eos=[]).generate(prompts, GenerationConfig(max_new_tokens=10), [0, 1, 2])
    assert result.peak_slots == [len(p) + 9 for p in prompts]  # the last token is never fed back


def test_ignore_eos_runs_to_max_new_tokens(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    free = engine_for(model, tokenizer, eos=[]).generate(prompts, GenerationConfig(max_new_tokens=8), [0, 1, 2])
    engine = engine_for(model, tokenizer, eos=[free.tokens[0][0]])
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=8, ignore_eos=True), [0, 1, 2])
    assert result.tokens == free.tokens


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.95)])
def test_sampling_is_seeded_and_independent_of_batch_mates(tiny, top_k, top_p):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer)
    config = GenerationConfig(max_new_tokens=16, temperature=0.8, top_k=top_k, top_p=top_p)
    engine = engine_for(model, tokenizer)
    batched = engine.generate(prompts, config, [11, 12, 13])
    again = engine.generate(prompts, config, [11, 12, 13])
    alone = engine.generate([prompts[1]], config, [12])
    other_seed = engine.generate(prompts, config, [21, 22, 23])
    assert batched.tokens == again.tokens
    assert alone.tokens[0] == batched.tokens[1]
    assert other_seed.tokens != batched.tokens


def test_sampling_follows_the_distribution():
    """The exponential race draws from softmax(logits / T): frequencies over many seeds."""
    from longflow.sampling import select_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    config = GenerationConfig(temperature=1.0)
    tokens = select_tokens(logits, config, torch.arange(4000), torch.tensor(3))
    frequencies = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(frequencies, torch.softmax(logits[0], dim=-1), atol=0.03)


def test_top_k_top_p_keep_only_the_nucleus():
    from longflow.sampling import filter_top_k_top_p

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.5)).tolist() == [[True, False, False, False]]

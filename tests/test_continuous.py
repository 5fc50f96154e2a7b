"""Continuous batching (`Engine.serve`) against each item generated alone (`Engine.generate` of a batch
of one): for every method, an item's tokens depend neither on the rows decoding beside it nor on the
order of the queue, while rows finish at different steps and take the next items mid-run (their
prefill through a separate policy, copied in) and, once the queue is empty, decode padding. The
budget stays a hard cap after every store, attention call and step of the shared rows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import capped_policy, method_variants, policy_of, tiny_model

from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.models import eos_token_ids

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")

# Prompts above and below the budget (prefill compression runs for some rows only), with limits that
# make rows finish at different steps, so that rows are refilled while others decode.
TEXTS = [
    "Solve for x: 3x + 7 = 22, then add five. " * 2,
    "hi",
    "A train leaves at noon at 60 mph; when? " * 3,
    "What is 2 + 3?",
    "Compute the sum of the first ten odd numbers, please.",
    "Name a prime between 20 and 30.",
]
LIMITS = [40, 9, 64, 23, 5, 31]
BUDGET = 40
MAX_NEW = 64
# Three rows, each refilled as soon as it is free, two prompts prefilled at a time, looked at every four steps.
SERVING = EngineConfig(batch_size=3, prefill_rows=2, refill_rows=1, check_every=4)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def prompts_of(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def alone(model, tokenizer, factory, generation, seeds):
    """Each item generated in a static batch of its own: the reference."""
    engine = Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    results = [engine.generate([prompt], generation, [seed], limits=[limit])
               for prompt, seed, limit in zip(prompts_of(tokenizer), seeds, LIMITS, strict=True)]
    return [(result.tokens[0], result.finish_reasons[0]) for result in results]


def served(model, tokenizer, factory, generation, seeds, order):
    """The items served continuously, queued in `order`; returns them in their own order."""
    engine = Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id, SERVING)
    prompts = prompts_of(tokenizer)
    rounds = list(engine.serve([prompts[i] for i in order], generation, [seeds[i] for i in order],
                               limits=[LIMITS[i] for i in order]))
    finished = {order[item.index]: item for round_ in rounds for item in round_.finished}
    assert sorted(finished) == list(range(len(TEXTS)))
    assert all(item.prompt_tokens == len(prompts[i]) for i, item in finished.items())
    return [(finished[i].tokens, finished[i].finish_reason) for i in range(len(TEXTS))], rounds


@pytest.mark.parametrize("method,variant", [("vanilla", None), *method_variants()])
def test_an_item_gets_the_tokens_it_gets_alone(qwen3, method, variant):
    model, tokenizer = qwen3
    fields = {} if variant is None else {"variant": variant}
    if method == "vanilla":
        def factory():
            return policy_of(method, None, **fields)
    else:
        def factory():
            return capped_policy(method, BUDGET, **fields)
    generation = GenerationConfig(max_new_tokens=MAX_NEW)
    seeds = list(range(len(TEXTS)))
    expected = alone(model, tokenizer, factory, generation, seeds)
    forward, rounds = served(model, tokenizer, factory, generation, seeds, order=range(len(TEXTS)))
    backward, _ = served(model, tokenizer, factory, generation, seeds, order=list(reversed(range(len(TEXTS)))))
    assert forward == expected
    assert backward == expected
    if method != "vanilla":
        assert all(item.peak_slots <= BUDGET for round_ in rounds for item in round_.finished)


def test_sampled_tokens_do_not_depend_on_the_queue(qwen3):
    """Each row samples from its own (seed, step) stream: serving reorders nothing."""
    model, tokenizer = qwen3
    generation = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20)
    seeds = [11, 5, 8, 2, 99, 7]
    expected = alone(model, tokenizer, lambda: policy_of("longflow", BUDGET), generation, seeds)
    result, _ = served(model, tokenizer, lambda: policy_of("longflow", BUDGET), generation, seeds,
                       order=[4, 0, 5, 1, 3, 2])
    assert result == expected


def test_rows_are_refilled_until_the_queue_is_empty(qwen3):
    """Three rows serve six items: every item is admitted once, and every round reports its steps."""
    model, tokenizer = qwen3
    engine = Engine(model, lambda: policy_of("vanilla", None), [], tokenizer.pad_token_id, SERVING)
    generation = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    rounds = list(engine.serve(prompts_of(tokenizer), generation, list(range(len(TEXTS))), limits=LIMITS))
    items = [item for round_ in rounds for item in round_.finished]
    assert sorted(len(item.tokens) for item in items) == sorted(LIMITS)
    assert all(item.finish_reason == "length" for item in items)
    assert all(round_.rows == 3 and len(round_.step_seconds) == SERVING.check_every for round_ in rounds)
    # Fewer decode steps than two static batches of three (each runs until its longest row ends).
    steps = sum(len(round_.step_seconds) for round_ in rounds)
    assert steps < (max(LIMITS[:3]) - 1) + (max(LIMITS[3:]) - 1)


def test_rows_wait_until_refill_rows_are_free(qwen3):
    """With refill_rows=2, a round refills only when two rows are free, or the queue's last item; once
    the queue is empty, every row is released once, as it frees."""
    model, tokenizer = qwen3
    released = []

    def factory():
        policy = policy_of("longflow", BUDGET)
        release = policy.release
        policy.release = lambda rows: (released.extend(rows), release(rows))
        return policy

    engine = Engine(model, factory, [], tokenizer.pad_token_id, replace(SERVING, refill_rows=2))
    generation = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    rounds = list(engine.serve(prompts_of(tokenizer), generation, list(range(len(TEXTS))), limits=LIMITS))
    admitted = [round_.admitted for round_ in rounds if round_.admitted]
    assert admitted[0] == 3 and sum(admitted) == len(TEXTS)
    assert all(count >= 2 for count in admitted[1:-1])
    items = {item.index: item for round_ in rounds for item in round_.finished}
    assert [len(items[i].tokens) for i in range(len(TEXTS))] == LIMITS
    assert sorted(released) == [0, 1, 2]


OVERLAPPED = replace(SERVING, overlap_admissions=True)


@pytest.mark.parametrize("method", ["vanilla", "longflow", "rkv", "h2o", "keydiff", "lkv"])
def test_overlapped_admissions_give_every_item_its_tokens_alone(qwen3, method):
    """Admissions prefilled beside the next round and adopted at its check: the same tokens as each
    item alone, whichever order the queue has."""
    model, tokenizer = qwen3

    def factory():
        return policy_of("vanilla", None) if method == "vanilla" else capped_policy(method, BUDGET)

    generation = GenerationConfig(max_new_tokens=MAX_NEW)
    seeds = list(range(len(TEXTS)))
    expected = alone(model, tokenizer, factory, generation, seeds)
    for order in (range(len(TEXTS)), [4, 0, 5, 1, 3, 2]):
        engine = Engine(model, factory, eos_token_ids(model, tokenizer), tokenizer.pad_token_id, OVERLAPPED)
        prompts = prompts_of(tokenizer)
        rounds = list(engine.serve([prompts[i] for i in order], generation, [seeds[i] for i in order],
                                   limits=[LIMITS[i] for i in order]))
        finished = {order[item.index]: item for round_ in rounds for item in round_.finished}
        assert [(finished[i].tokens, finished[i].finish_reason) for i in range(len(TEXTS))] == expected


@pytest.mark.parametrize("serving", [SERVING, replace(SERVING, batch_size=4, prefill_rows=1, refill_rows=2)],
                         ids=["three_rows", "four_rows_in_chunks_of_one"])
def test_overlapped_admissions_start_a_round_later(qwen3, serving):
    """EOS ignored, the steps are those of the schedule in which an admission made while rows decode
    joins after the next round (the workload benchmark's model of it), never fewer than without overlap;
    the first admission, with no row decoding, is prefilled before its round. With four rows and
    chunks of one prompt, an admission beside a round prefills several chunks."""
    from evals.bench.workload import continuous_schedule

    model, tokenizer = qwen3
    generation = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)

    def steps(config):
        engine = Engine(model, lambda: policy_of("longflow", BUDGET), [], tokenizer.pad_token_id, config)
        rounds = list(engine.serve(prompts_of(tokenizer), generation, list(range(len(TEXTS))), limits=LIMITS))
        items = {item.index: item for round_ in rounds for item in round_.finished}
        assert [len(items[i].tokens) for i in range(len(TEXTS))] == LIMITS
        assert all(round_.prefill_seconds >= 0 for round_ in rounds)
        return sum(len(round_.step_seconds) for round_ in rounds), [r.admitted for r in rounds if r.admitted]

    def predicted(overlap):
        return continuous_schedule(LIMITS, serving.batch_size, serving.check_every, serving.refill_rows, overlap)

    (overlapped, admitted), (plain, _) = steps(replace(serving, overlap_admissions=True)), steps(serving)
    assert (overlapped, admitted) == predicted(True)
    assert plain == predicted(False)[0] <= overlapped  # equal where the delayed rows end before the longest
    if serving.prefill_rows == 1:
        assert max(admitted[1:]) > 1  # several chunks beside one round


def test_verification_admits_before_the_round_whatever_overlap_says(qwen3):
    from longflow.config import VerifyConfig

    model, tokenizer = qwen3
    generation = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)

    def served_tokens(config):
        engine = Engine(model, lambda: policy_of("longflow", BUDGET), [], tokenizer.pad_token_id, config,
                        VerifyConfig(name="vericache", horizon=3))
        rounds = list(engine.serve(prompts_of(tokenizer), generation, list(range(len(TEXTS))), limits=LIMITS))
        return {item.index: item.tokens for round_ in rounds for item in round_.finished}, \
            [(round_.admitted, len(round_.step_seconds)) for round_ in rounds]

    assert served_tokens(OVERLAPPED) == served_tokens(SERVING)

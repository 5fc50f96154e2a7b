"""Prompts: the messages of each protocol, and their rendering with a chat template built in code."""

from __future__ import annotations

import pytest

from evals.datasets import Item
from evals.prompts import (
    GPQA_INSTRUCTION,
    GPQA_OPENING,
    LF_REPO_SYSTEM,
    MATH_INSTRUCTION,
    build_messages,
    render_prompt,
    truncate_prompt,
)
from longflow.errors import UserError
from longflow.tokenizer import build_tokenizer

MATH = Item(id="0", question="What is $1 + 1$?", gold="2")
GPQA = Item(id="1", question="Which is a noble gas?", gold="C", choices=("N2", "O2", "Ar", "H2"))


def test_math_default_is_the_question_then_the_box_instruction():
    assert MATH_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
    content = f"{MATH.question}\n{MATH_INSTRUCTION}"
    assert build_messages(MATH, "math") == [{"role": "user", "content": content}]


def test_gpqa_default_wraps_the_question_and_options_in_the_instruction():
    assert f"{GPQA_OPENING} {GPQA_INSTRUCTION}" == (
        "Answer the following multiple choice question. The last line of your response should be of the "
        "form 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
        "answering.")
    (message,) = build_messages(GPQA, "gpqa")
    assert message["role"] == "user"
    assert message["content"] == (f"{GPQA_OPENING}\n\nWhich is a noble gas?\n\nA) N2\nB) O2\nC) Ar\nD) H2\n\n"
                                  f"{GPQA_INSTRUCTION}")


def test_lf_repo_is_the_authors_system_prompt_and_the_bare_question():
    assert build_messages(MATH, "math", "lf_repo") == [
        {"role": "system", "content": LF_REPO_SYSTEM}, {"role": "user", "content": MATH.question}]
    assert LF_REPO_SYSTEM == "Please reason step by step, and must put your final answer within \\boxed{}"
    system, user = build_messages(GPQA, "gpqa", "lf_repo")
    assert user["content"] == "Which is a noble gas?\n\nA) N2\nB) O2\nC) Ar\nD) H2"


def test_unknown_kind_or_protocol_is_a_user_error():
    with pytest.raises(UserError, match="kind"):
        build_messages(MATH, "code")
    with pytest.raises(UserError, match="protocol"):
        build_messages(MATH, "math", "chatml")
    with pytest.raises(ValueError, match="4 choices"):
        build_messages(MATH, "gpqa")


@pytest.mark.parametrize("thinking", [True, False])
def test_render_prompt_returns_plain_ids_of_the_template(thinking):
    tokenizer = build_tokenizer(512, "qwen3")
    messages = build_messages(MATH, "math")
    ids = render_prompt(tokenizer, messages, thinking=thinking)
    assert type(ids) is list and all(type(token) is int for token in ids)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)
    assert tokenizer.decode(ids) == text
    assert text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_render_prompt_r1_template_opens_the_thinking():
    tokenizer = build_tokenizer(512, "r1_distill")
    ids = render_prompt(tokenizer, build_messages(MATH, "math", "lf_repo"), thinking=True)
    text = tokenizer.decode(ids)
    assert text.startswith(tokenizer.bos_token + LF_REPO_SYSTEM) and text.endswith("<think>\n")


def test_lf_repo_renders_text_then_tokenizes_with_the_tokenizer_defaults():
    """As the authors' scripts: a tokenizer that adds a BOS of its own (R1-Distill's) gives two."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_tokenizer(512, "r1_distill")
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    messages = build_messages(MATH, "math", "lf_repo")
    ours = render_prompt(tokenizer, messages, thinking=True)
    theirs = render_prompt(tokenizer, messages, thinking=True, protocol="lf_repo")
    assert ours[0] == tokenizer.bos_token_id != ours[1]
    assert theirs == [tokenizer.bos_token_id] + ours
    qwen = build_tokenizer(512, "qwen3")  # adds no special token: both renderings agree
    assert render_prompt(qwen, messages, True, "lf_repo") == render_prompt(qwen, messages, True)


def test_truncation_keeps_the_end_or_the_start():
    tokenizer = build_tokenizer(512, "qwen3")
    ids = render_prompt(tokenizer, build_messages(MATH, "math", "lf_repo"), thinking=True)
    assert truncate_prompt(ids, None, "right") == ids and truncate_prompt(ids, len(ids), "right") == ids
    assert truncate_prompt(ids, 10, "left") == ids[-10:]
    kept = truncate_prompt(ids, len(ids) - 5, "right")
    assert kept == ids[:-5]
    # right truncation of a chat prompt cuts the generation prompt: the model continues the user turn
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert not tokenizer.decode(kept).endswith("assistant\n")


def test_lf_repo_generation_is_the_authors_setting():
    from evals.configs import compose_config
    from longflow.config import GenerationConfig

    def generation_of(name: str) -> dict:  # with the paper's datasets (the canary bounds the output)
        return compose_config([f"generation={name}", "dataset=all"])["generation"]

    fields = generation_of("lf_repo")
    assert (fields.pop("name"), fields.pop("protocol")) == ("lf_repo", "lf_repo")
    generation = GenerationConfig(**fields)
    assert generation.greedy and generation.max_new_tokens == 8192 and generation.repetition_penalty == 1.2
    assert (generation.max_prompt_tokens, generation.truncation_side) == (1000, "right")
    for name in ("greedy", "sampling"):
        assert generation_of(name)["truncation_side"] == "left"
    with pytest.raises(UserError, match="truncation_side"):
        GenerationConfig(truncation_side="middle")

"""Prompts: the chat messages of an item, and their rendering with the model's own chat template.

Two protocols (see docs/protocol.md, "Prompts"):
  - "default": one user turn. Math: the question, then the \\boxed{} instruction. GPQA: the opening
    of the simple-evals instruction, the stem, the options as "A) ..." lines, then the rest of the
    instruction, which asks for a last line "Answer: $LETTER".
  - "lf_repo": the LongFlow authors' setting: their system prompt and the question alone as the user
    turn. A GPQA question there is the stem and its options, with no answer-format instruction (the
    grader also reads "\\boxed{X}"); the options are rendered as "A) ..." lines, after the seeded
    shuffle, rather than the "A: ..." lines of the paper's file. The template is rendered to text
    and tokenized with the tokenizer's defaults, as their scripts do (see `render_prompt`).
"""

from __future__ import annotations

from collections.abc import Mapping

from evals.datasets import KINDS, LETTERS, Item
from longflow.errors import UserError

PROTOCOLS = ("default", "lf_repo")
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GPQA_OPENING = "Answer the following multiple choice question."
GPQA_INSTRUCTION = (
    "The last line of your response should be of the form 'Answer: $LETTER' (without quotes) where "
    "LETTER is one of ABCD. Think step by step before answering."
)
LF_REPO_SYSTEM = "Please reason step by step, and must put your final answer within \\boxed{}"


def build_messages(item: Item, kind: str, protocol: str = "default") -> list[dict[str, str]]:
    """The chat messages (role, content) that ask `item` under `protocol`."""
    if kind not in KINDS:
        raise UserError(f"dataset kind must be one of {list(KINDS)}, got {kind!r}")
    if protocol not in PROTOCOLS:
        raise UserError(f"prompt protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
    if kind == "gpqa":
        if item.choices is None or len(item.choices) != len(LETTERS):
            raise ValueError(f"item {item.id}: a GPQA item needs 4 choices, got {item.choices}")
        options = "\n".join(f"{letter}) {choice}"
                            for letter, choice in zip(LETTERS, item.choices, strict=True))
        question = f"{item.question}\n\n{options}"
    else:
        question = item.question
    if protocol == "lf_repo":
        return [{"role": "system", "content": LF_REPO_SYSTEM}, {"role": "user", "content": question}]
    if kind == "gpqa":
        content = f"{GPQA_OPENING}\n\n{question}\n\n{GPQA_INSTRUCTION}"
    else:
        content = f"{question}\n{MATH_INSTRUCTION}"
    return [{"role": "user", "content": content}]


def render_prompt(tokenizer, messages: list[dict[str, str]], thinking: bool, protocol: str = "default") -> list[int]:
    """Prompt token ids from the tokenizer's chat template, generation prompt on.

    `enable_thinking` reaches the template as a variable: Qwen3's template reads it, templates that
    do not know it (R1-Distill's, which always opens "<think>\\n") ignore it.

    "lf_repo" reproduces what the LongFlow authors' scripts feed the model: the template rendered
    to text, then tokenized with the tokenizer's defaults (special tokens added). A tokenizer that
    adds a BOS of its own (R1-Distill's) thus puts a second one before the template's; Qwen's add
    none, and the ids equal the default rendering's.
    """
    if protocol == "lf_repo":
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=thinking)
        return [int(token) for token in tokenizer(text)["input_ids"]]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, enable_thinking=thinking)
    # transformers 5 returns a BatchEncoding unless told otherwise; accept one in case a tokenizer
    # class overrides `return_dict`.
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(token) for token in ids]


def truncate_prompt(ids: list[int], max_tokens: int | None, side: str) -> list[int]:
    """At most `max_tokens` ids; `side` is the end that is cut, in the tokenizer's terms.

    "left" keeps the end: the question's tail and the generation prompt. "right" keeps the start,
    as the LongFlow authors' `tokenizer(..., max_length=1000, truncation=True)` does: a chat prompt
    longer than that loses the end of its user turn AND the generation prompt (the assistant
    header, and "<think>\\n" for R1-Distill), so the model goes on writing the user's text.
    """
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    return ids[:max_tokens] if side == "right" else ids[-max_tokens:]

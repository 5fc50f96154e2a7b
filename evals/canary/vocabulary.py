"""The canary's tokenizer: bytes, Qwen3's chat tokens, and the task's words as single tokens.

Built in code (no download) and saved with the model, so that `AutoTokenizer.from_pretrained` on the
model folder gives it back. Every number below 100 is one token, and so are the prompt's words, the
harness's math instruction and "\\boxed{": a step of the task is then 19 tokens. Letters stay bytes:
they are the variable names. The suite's tokenizer (`build_suite`) is this one with four more words,
the tags of the suite's task families, on ids the canary's left as filler.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from evals.prompts import MATH_INSTRUCTION
from longflow.tokenizer import build_tokenizer

VOCAB_SIZE = 384
WORDS = [str(number) for number in range(10, 100)] + ["Start", "Steps", "user", "assistant", "\\boxed{",
                                                        MATH_INSTRUCTION]


# The task suite's prompt tags (`evals.canary.families`), appended: every id of the canary's
# tokenizer keeps its meaning, so the suite model starts from the canary model's weights.
SUITE_WORDS = WORDS + ["Lookup", "Plan", "Check", "Chain"]


def build() -> PreTrainedTokenizerFast:
    return build_tokenizer(VOCAB_SIZE, "qwen3", WORDS)


def build_suite() -> PreTrainedTokenizerFast:
    return build_tokenizer(VOCAB_SIZE, "qwen3", SUITE_WORDS)

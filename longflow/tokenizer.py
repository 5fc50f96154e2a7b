"""A tokenizer built in code, for models with random weights (tests, demo, GPU benchmarks).

Hub tokenizers cannot be downloaded offline, so random-weight models get a byte-level tokenizer
whose vocabulary is padded with filler tokens to the model's vocab size (every id decodes), and a
chat template that reproduces the format of the model family: Qwen3's ChatML with the thinking
switch, or R1-Distill's template that ends the generation prompt with "<think>\\n".
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

R1_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages if message['role'] == 'system' %}{{- message['content'] }}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)

# Single tokens, as in the real vocabularies, but not special: decoding with skip_special_tokens keeps
# them, and grading needs "</think>".
THINK_TAGS = ["<think>", "</think>"]

CHAT_FORMATS = {
    "qwen3": dict(
        template=CHATML_TEMPLATE,
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
    ),
    "r1_distill": dict(
        template=R1_TEMPLATE,
        special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        eos="<｜end▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
    ),
}


def build_tokenizer(vocab_size: int, chat_format: str = "qwen3", words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with exactly `vocab_size` ids and the family's chat template.

    `words` become single tokens wherever they occur in a text (the longest one wins where several
    start at the same place): the domain vocabulary of a model trained with this tokenizer, such as
    the canary's numbers. They are not special, so decoding keeps them.
    """
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat_format {chat_format!r}; choose one of {sorted(CHAT_FORMATS)}")
    fmt = CHAT_FORMATS[chat_format]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    whole = THINK_TAGS + [word for word in words if word not in vocab and word not in THINK_TAGS]
    for token in fmt["special"] + whole:
        vocab[token] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} byte and special tokens")
    for index in range(len(vocab), vocab_size):
        vocab[f"<|filler_{index}|>"] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=fmt["eos"],
        pad_token=fmt["pad"],
        bos_token=fmt["bos"],
        additional_special_tokens=[t for t in fmt["special"] if t not in (fmt["eos"], fmt["pad"], fmt["bos"])],
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in whole])
    tokenizer.chat_template = fmt["template"]
    return tokenizer

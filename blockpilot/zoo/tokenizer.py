"""Byte-level BPE tokenizers for the zoo, with a ChatML chat template and a `<|MASK|>` token."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from blockpilot.models.loading import MASK_TOKEN

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, MASK_TOKEN)

# ChatML, as Qwen3 uses it; generation stops at <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_byte_level_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on `texts` (no merges when `texts` is empty), as a transformers fast tokenizer.

    Ids: the special tokens first (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|MASK|>`), then the 256
    bytes, then merges up to `vocab_size`. eos is `<|im_end|>`, pad `<|endoftext|>`, mask `<|MASK|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )

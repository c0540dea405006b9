"""Byte-level BPE tokenizers trained locally with `tokenizers`, plus the ChatML chat template.

Tiny models in tests and demos need a tokenizer without any model hub: `train_tokenizer` builds one from texts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# ChatML, as used by Qwen: one block per message; the generation prompt opens an assistant block.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

DEFAULT_MODEL_MAX_LENGTH = 512


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens.

    Every byte is in the initial alphabet, so any text encodes and `decode(encode(x)) == x` (no prefix space is
    added). Training is deterministic for the same texts and settings. Special tokens get ids 0-3 in the order
    `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|pad|>`; eos is `<|im_end|>` (ends a chat turn), pad `<|pad|>`.

    Args:
        texts: training corpus, one document per item.
        vocab_size: target vocabulary size including the 256 byte tokens and the 4 special tokens.
        out_dir: if given, the tokenizer is saved there with `save_pretrained`.
        model_max_length: the longest sequence the tokenizer reports as supported (match the model's
            `max_position_embeddings`).

    Returns:
        A `PreTrainedTokenizerFast` with eos, pad, bos (`<|endoftext|>`) and the chat template set.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size} is below {min_size} (256 bytes + special tokens)")
    bpe = Tokenizer(models.BPE())
    # One token per digit (as Llama and Qwen tokenizers do): numbers keep a fixed, position-wise token structure,
    # which is what lets a small model learn carries instead of memorising a table of multi-digit tokens.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    bpe.train_from_iterator((str(t) for t in texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=ENDOFTEXT_TOKEN,
        eos_token=IM_END_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    # ByteLevel BPE has no bos in its post-processor: the bos token exists for models that want one, but
    # encode() adds nothing, which keeps decode(encode(x)) == x.
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer

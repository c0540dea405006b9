"""Chat rendering and tokenization with a loss mask, for any Hugging Face tokenizer that has a chat template.

Also packs raw texts into fixed-length blocks for continued pretraining. Takes a tokenizer object; imports nothing heavy.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

IGNORE_INDEX = -100  # label of a token that is not trained on (torch's cross_entropy ignore_index)


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat as text, rendered by the tokenizer's own chat template.

    Args:
        messages: [{"role", "content"}, ...].
        add_generation_prompt: append the header that starts an assistant turn (for prompting a model).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer: offsets are needed for the mask"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans [start, end) of every assistant turn's trained text.

    A span is what the template appends for the assistant message beyond its generation prompt: the content and the
    end-of-turn text (e.g. "82<|im_end|>\\n"), not the header.
    """
    full = render_chat(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_chat(tokenizer, messages[: i + 1])
        if not upto.startswith(prefix):
            raise ValueError(
                f"chat template is not prefix-consistent: the generation prompt after messages[:{i}] is not a prefix "
                f"of the rendering of messages[:{i + 1}] (got {prefix[-40:]!r} vs {upto[len(prefix) - 40 : len(prefix)]!r})"
            )
        if not full.startswith(upto):
            raise ValueError(
                f"chat template is not prefix-consistent: rendering messages[:{i + 1}] is not a prefix of rendering "
                "all messages (the template rewrites earlier turns, e.g. drops their reasoning)"
            )
        if len(upto) > len(prefix):
            spans.append((len(prefix), len(upto)))
    return full, spans


def tokenize_chat(tokenizer: Any, messages: list[dict], max_length: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a chat and labels that train on the assistant turns only.

    Method: render the whole chat once with the tokenizer's template. For each assistant message i, render
    `messages[:i]` with the generation prompt (everything up to and including the assistant header) and
    `messages[:i+1]`; both must be prefixes of the next rendering (else ValueError: the template rewrites history),
    and the characters between them, the content plus the template's end-of-turn text (so the model learns to stop),
    are trained. The full text is tokenized once (no extra special tokens: the template adds its own); a token is
    labelled with its id iff the character where it starts lies in a trained span, else `IGNORE_INDEX` (-100).

    Args:
        messages: [{"role", "content"}, ...]; every assistant message is trained on.
        max_length: keep only the first max_length tokens.

    Returns:
        (input_ids_T, labels_T), two lists of the same length T.
    """
    text, spans = assistant_spans(tokenizer, messages)
    input_ids, offsets = _encode_with_offsets(tokenizer, text)
    starts = [s for s, _ in spans]
    labels = []
    for token, (start, _end) in zip(input_ids, offsets, strict=True):
        k = bisect.bisect_right(starts, start) - 1
        labels.append(token if k >= 0 and start < spans[k][1] else IGNORE_INDEX)
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, labels


def tokenize_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a chat followed by the assistant generation prompt: what a policy continues."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def pack_texts(tokenizer: Any, texts: Iterable[str], seq_len: int, batch_size: int = 1000) -> list[list[int]]:
    """Raw texts as blocks of exactly seq_len token ids, for continued pretraining (every token is trained on).

    Each text is tokenized and followed by `eos_token_id`; the stream is cut into blocks of seq_len. The last
    partial block is dropped, unless it is the only block.

    Args:
        texts: any iterable of strings (read in batches of batch_size).
        seq_len: tokens per block.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos_token_id to separate texts")
    stream: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    blocks = [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]
    if len(blocks) > 1 and len(blocks[-1]) < seq_len:
        blocks.pop()
    return blocks

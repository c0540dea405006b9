"""Batched generation with Hugging Face `generate` (left padding, KV cache): the CPU engine."""

from __future__ import annotations

from collections.abc import Sequence


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[list[dict]],
    max_new_tokens: int,
    batch_size: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[str]:
    """Generate one completion per chat prompt; returns the decoded response texts (special tokens removed).

    Args:
        prompts: chats rendered with the tokenizer's chat template and a generation prompt.
    """
    import torch

    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.heads import left_padded

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [tokenize_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        ids, mask = left_padded(encoded, pad_id)  # every prompt ends where generation starts
        T = ids.shape[1]
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        out.extend(tokenizer.batch_decode(gen[:, T:], skip_special_tokens=True))
    return out

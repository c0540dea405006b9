"""Reward models: a causal-LM backbone with a scalar head, read at the last non-pad token of prompt + response.

`build_reward_model` turns a causal-LM folder into one, `load_reward_model` opens a trained one, `reward_scores`
scores (prompt, response) pairs; `last_token_scores` is the forward both training and scoring use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

from .loading import _is_peft, _unwrap, check_model_path, load_tokenizer

logger = logging.getLogger(__name__)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The ForSequenceClassification module under DDP / torch.compile / a peft wrapper (LoRA layers stay injected)."""
    model = _unwrap(model)
    return model.get_base_model() if _is_peft(model) else model


def last_token_scores(
    model: torch.nn.Module, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor
) -> torch.Tensor:
    """Scalar head at the last attended token of each right-padded row.

    The position comes from the attention mask, not from `pad_token_id` (HF's own pooling treats every token equal to
    the pad id as padding, which is wrong when pad == eos and the text ends with eos).

    Args:
        model: a `*ForSequenceClassification` with num_labels=1 and a `score` head (possibly peft/DDP-wrapped:
            call it on the unwrapped module only outside DDP's forward; training wraps this in an nn.Module).
        input_ids_B_T: token ids, right-padded.
        attention_mask_B_T: 1 for real tokens, 0 for padding; every row has at least one real token.

    Returns:
        scores_B in fp32.
    """
    inner = _inner(model)
    backbone = getattr(inner, inner.base_model_prefix)
    hidden_B_T_H = backbone(
        input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False
    ).last_hidden_state
    last_B = attention_mask_B_T.long().sum(-1) - 1
    if bool((last_B < 0).any()):
        raise ValueError("last_token_scores: a row has no attended token")
    hidden_B_H = hidden_B_T_H[torch.arange(hidden_B_T_H.shape[0], device=hidden_B_T_H.device), last_B]
    return inner.score(hidden_B_H).squeeze(-1).float()


def build_reward_model(base_path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal-LM checkpoint as a ForSequenceClassification with num_labels=1 (a fresh random scalar head).

    The backbone weights are the causal LM's (its LM head is dropped); `config.pad_token_id` is the tokenizer's.
    A LoRA adapter folder is merged into its base first.

    Args:
        base_path: local causal-LM folder (full model or adapter), with a tokenizer.
        dtype: weights dtype.

    Returns:
        The model, in eval mode.
    """
    info = check_model_path(base_path)
    tokenizer = load_tokenizer(base_path)
    if info["is_adapter"]:
        from peft import PeftModel

        causal = AutoModelForCausalLM.from_pretrained(info["base_model"], local_files_only=True, dtype=dtype)
        causal = PeftModel.from_pretrained(causal, str(base_path)).merge_and_unload()
        model = AutoModelForSequenceClassification.from_config(causal.config, num_labels=1, dtype=dtype)
        prefix = model.base_model_prefix
        getattr(model, prefix).load_state_dict(getattr(causal, causal.base_model_prefix).state_dict())
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(base_path), num_labels=1, local_files_only=True, dtype=dtype
        )
    if not hasattr(model, "score"):
        raise ValueError(f"build_reward_model('{base_path}'): {type(model).__name__} has no `score` head")
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """Open a trained reward model folder (from the reward-model stage) and its tokenizer.

    Returns:
        (model in eval mode, tokenizer with pad_token set); `model.config.pad_token_id` is the tokenizer's.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"reward model path '{path}' does not exist")
    check_model_path(p)
    tokenizer = load_tokenizer(p, require_chat_template=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(p), num_labels=1, local_files_only=True, dtype=dtype)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model '{path}' has num_labels={model.config.num_labels}, expected 1")
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def encode_pair(tokenizer: Any, prompt: list[dict], response: str, max_length: int | None = None) -> list[int]:
    """Token ids of prompt + {"role": "assistant", "content": response}, rendered by the chat template.

    Truncation keeps the first max_length tokens (the score is then read at the cut).
    """
    from ..data.chat import render_chat

    text = render_chat(tokenizer, [*prompt, {"role": "assistant", "content": response}])
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[:max_length] if max_length is not None else ids


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists into (input_ids_B_T, attention_mask_B_T) long tensors."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


@torch.no_grad()
def reward_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[dict]],
    responses: list[str],
    batch_size: int = 32,
    max_length: int | None = None,
) -> list[float]:
    """Score each (prompt, response): the scalar head at the last non-pad token of the chat-rendered pair.

    Args:
        model: from `load_reward_model` (any device; inputs follow the model's).
        tokenizer: its tokenizer (needs a chat template).
        prompts: message lists [{"role", "content"}, ...], one per response.
        responses: assistant replies, len(prompts).
        batch_size: pairs per forward.
        max_length: truncate each rendered pair to this many tokens (default: the model's context length).

    Returns:
        One fp32 score per pair, as Python floats, in input order.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"reward_scores: {len(prompts)} prompts but {len(responses)} responses")
    if batch_size < 1:
        raise ValueError(f"reward_scores: batch_size must be >= 1, got {batch_size}")
    if max_length is None:
        max_length = getattr(_inner(model).config, "max_position_embeddings", None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("reward_scores: tokenizer has neither pad_token_id nor eos_token_id")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    scores: list[float] = []
    try:
        for start in range(0, len(prompts), batch_size):
            rows = [
                encode_pair(tokenizer, p, r, max_length)
                for p, r in zip(prompts[start : start + batch_size], responses[start : start + batch_size], strict=True)
            ]
            ids, mask = pad_right(rows, pad_id)
            scores.extend(last_token_scores(model, ids.to(device), mask.to(device)).cpu().tolist())
    finally:
        model.train(was_training)
    return scores

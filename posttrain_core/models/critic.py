"""Critics (value models) for PPO and VAPO: a causal-LM backbone with a per-token scalar head.

A critic is a Hugging Face `*ForTokenClassification` folder with num_labels=1, so it saves and loads like any model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from .loading import check_model_path


def build_critic(path: str | Path) -> PreTrainedModel:
    """A critic from a causal-LM folder (fresh value head) or from a saved critic folder (trained head).

    A fresh head starts at zero weight and bias, so every initial value is 0: the first advantages are then the
    plain returns, not the noise of a random head. Dropout is off (values must be a deterministic function of the
    state for the clipped value loss). A LoRA adapter folder gives its base model's backbone.
    """
    info = check_model_path(path)
    source = info["base_model"] if info["is_adapter"] else str(path)
    fresh = "ForTokenClassification" not in "".join(info.get("architectures") or [])
    config = AutoConfig.from_pretrained(source, local_files_only=True, num_labels=1)
    config.classifier_dropout = 0.0  # read from the config, not a from_pretrained kwarg
    model = AutoModelForTokenClassification.from_pretrained(
        source, config=config, local_files_only=True, dtype=torch.float32
    )
    model.dropout = torch.nn.Identity()
    if fresh:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model


def token_values(critic: torch.nn.Module, input_ids_B_L: torch.Tensor, attention_mask_B_L: torch.Tensor) -> torch.Tensor:
    """values_B_L (fp32): the critic's value of the state after each token."""
    out = critic(input_ids=input_ids_B_L, attention_mask=attention_mask_B_L, use_cache=False)
    return out.logits[..., 0].float()

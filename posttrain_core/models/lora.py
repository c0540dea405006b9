"""LoRA adapters with peft: wrap a causal LM, merge it back.

For LoRA RL the reference policy needs no second copy: `with model.disable_adapter(): ref_logits = model(...)`
runs the frozen base model, outside the block the adapter is active again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (plain values, picklable: they cross Ray/Prefect boundaries).

    Attributes:
        r: rank of the update `B @ A` (A: r x in, B: out x r).
        alpha: scale numerator; the update is multiplied by alpha / r.
        dropout: dropout on the LoRA branch input.
        target_modules: leaf module names to adapt, e.g. ("q_proj", "v_proj"); add "gate_proj", "up_proj",
            "down_proj" for the MLP.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


def _leaf_linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def apply_lora(model: PreTrainedModel, settings: LoraSettings, seed: int | None = None) -> PeftModel:
    """Wrap `model` with a trainable LoRA adapter named "default"; all base weights are frozen.

    peft injects the LoRA layers into `model` in place. B starts at zero, so the wrapped model initially computes
    exactly what the base did. Use `with peft_model.disable_adapter():` to run the base (reference policy).

    Args:
        model: a causal LM (e.g. from `load_causal_lm` or `build_tiny_model`).
        settings: rank, alpha, dropout and target modules.
        seed: if given, the A matrices are initialised from this seed (global RNG state restored afterwards).

    Returns:
        The `PeftModel`; only `lora_A`/`lora_B` parameters have requires_grad.

    Raises:
        ValueError: none of `settings.target_modules` names a Linear layer of the model.
    """
    available = _leaf_linear_names(model)
    missing = [t for t in settings.target_modules if t not in available]
    if len(missing) == len(settings.target_modules):
        raise ValueError(
            f"apply_lora: target_modules {list(settings.target_modules)} match no Linear layer of "
            f"{type(model).__name__}; its Linear layers are {sorted(available)}"
        )
    if missing:
        logger.warning(
            "apply_lora: target_modules %s not found in %s; adapting the others", missing, type(model).__name__
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=[t for t in settings.target_modules if t in available],
        bias="none",
        task_type="CAUSAL_LM",
    )
    if seed is None:
        return get_peft_model(model, config)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return get_peft_model(model, config)
    finally:
        torch.random.set_rng_state(rng_state)


def merge_lora(model: PeftModel) -> PreTrainedModel:
    """Fold the LoRA update into the base weights (`W += alpha / r * B @ A`) and drop the adapter layers.

    In place: `model` must not be used afterwards. For a copy, use `save_checkpoint(..., merge_lora=True)`.

    Returns:
        The plain base `PreTrainedModel` with merged weights.
    """
    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_lora: expected a peft.PeftModel, got {type(model).__name__}")
    return model.merge_and_unload()

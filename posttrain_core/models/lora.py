"""LoRA adapters with peft: the one place a `LoraConfig` becomes peft's adapter, seeded; wrap a model, merge it back.

`config.LoraConfig` (rank, alpha, dropout, target modules) is the one description of an adapter: the pipeline's
trainers wrap their model with `apply_lora`, and `posttrain serve` adds many adapters to one base with
`add_adapter`. Both draw the A matrices from a seed through `seeded`, so the same config and seed give the same
adapter in either.

For LoRA RL the reference policy needs no second copy: `with model.disable_adapter(): ref_logits = model(...)`
runs the frozen base model, outside the block the adapter is active again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from posttrain_core.config import LoraConfig

logger = logging.getLogger(__name__)

# Where a VLM keeps its vision tower and projector (Qwen2-VL: visual; LLaVA: vision_tower, multi_modal_projector).
TOWER = ("visual", "vision_tower", "multi_modal_projector")


def linear_names(model: torch.nn.Module) -> set[str]:
    """The leaf names of the model's Linear layers ("q_proj", "lm_head", ...): what `target_modules` can name."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def lora_parameters(model: torch.nn.Module, lora: LoraConfig) -> int:
    """Parameters of an adapter `lora` on `model` (peft-wrapped or not): rank x (in + out) per adapted Linear."""
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in lora.target_modules and hasattr(module, "in_features") and hasattr(module, "out_features"):
            total += lora.r * (int(module.in_features) + int(module.out_features))
    return total


def peft_config(lora: LoraConfig, task_type: str = "CAUSAL_LM", **extra):
    """peft's `LoraConfig` of ours (no bias terms); `extra`: more peft fields (base_model_name_or_path, ...)."""
    import peft

    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type=task_type,
        **extra,
    )


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Adapters created in the block draw their A matrices from `seed` (None: the global RNG as it is); the global
    RNG state is restored afterwards, so creating an adapter changes no other random draw."""
    if seed is None:
        yield
        return
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        torch.random.set_rng_state(state)


def check_targets(model: torch.nn.Module, lora: LoraConfig, who: str = "apply_lora") -> LoraConfig:
    """`lora` with only the target modules the model has (a warning names the others).

    Raises:
        ValueError: none of `lora.target_modules` names a Linear layer of the model.
    """
    available = linear_names(model)
    missing = [t for t in lora.target_modules if t not in available]
    if len(missing) == len(lora.target_modules):
        raise ValueError(
            f"{who}: target_modules {list(lora.target_modules)} match no Linear layer of "
            f"{type(model).__name__}; its Linear layers are {sorted(available)}"
        )
    if missing:
        logger.warning("%s: target_modules %s not found in %s; adapting the others", who, missing, type(model).__name__)
    return lora.model_copy(update={"target_modules": [t for t in lora.target_modules if t in available]})


def apply_lora(model: PreTrainedModel, lora: LoraConfig, seed: int | None = None) -> PeftModel:
    """Wrap `model` with a trainable LoRA adapter named "default"; all base weights are frozen.

    peft injects the LoRA layers into `model` in place. B starts at zero, so the wrapped model initially computes
    exactly what the base did. Use `with peft_model.disable_adapter():` to run the base (reference policy).

    Args:
        model: a causal LM (e.g. from `load_causal_lm` or `build_tiny_model`).
        lora: rank, alpha, dropout and target modules.
        seed: if given, the A matrices are initialised from this seed (global RNG state restored afterwards).

    Returns:
        The `PeftModel`; only `lora_A`/`lora_B` parameters have requires_grad.

    Raises:
        ValueError: none of `lora.target_modules` names a Linear layer of the model.
    """
    # A VLM's adapter is the language model's: a CLIP tower's q_proj/v_proj carry the same leaf names as the LM's.
    vision = any(n in {f"model.{t}" for t in TOWER} for n, _ in model.named_modules())
    extra = {"exclude_modules": rf"model\.({'|'.join(TOWER)})\..*"} if vision else {}
    config = peft_config(check_targets(model, lora), **extra)
    with seeded(seed):
        return get_peft_model(model, config)


def add_adapter(model: PeftModel, name: str, lora: LoraConfig, seed: int | None) -> None:
    """Add a LoRA adapter `name` beside the model's others (the service's many adapters on one base), seeded."""
    with seeded(seed):
        model.add_adapter(name, peft_config(lora))


def merge_lora(model: PeftModel) -> PreTrainedModel:
    """Fold the LoRA update into the base weights (`W += alpha / r * B @ A`) and drop the adapter layers.

    In place: `model` must not be used afterwards. For a copy, use `save_checkpoint(..., merge_lora=True)`.

    Returns:
        The plain base `PreTrainedModel` with merged weights.
    """
    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_lora: expected a peft.PeftModel, got {type(model).__name__}")
    return model.merge_and_unload()

"""Load and save any Hugging Face causal LM (full model or LoRA adapter folder) by local path.

Stages exchange model folders, never objects: `check_model_path` validates one cheaply, `load_causal_lm` and
`load_tokenizer` open it, `save_checkpoint` writes the next one.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e


def _resolve_base(adapter_dir: Path, base: str | None) -> Path:
    """Where an adapter's base model lives: as written, else relative to the adapter folder."""
    if not base:
        raise ValueError(
            f"model path '{adapter_dir}': adapter_config.json has no base_model_name_or_path "
            f"(cannot find the base model)"
        )
    candidate = Path(base).expanduser()
    if not candidate.is_absolute() and not candidate.exists() and (adapter_dir / candidate).exists():
        candidate = adapter_dir / candidate
    if not candidate.exists() and (adapter_dir.parent / candidate.name).is_dir():
        # An artifact copied into another machine's cache of a remote store: the base artifact (recorded at the
        # path it had where the adapter was trained) is its sibling there (`artifacts.node.NodePath`).
        candidate = adapter_dir.parent / candidate.name
    return candidate


def check_model_path(path: str | Path) -> dict[str, Any]:
    """Validate a local model folder without loading weights.

    A full model needs `config.json` and a weights file; an adapter folder needs `adapter_config.json` and adapter
    weights, and its base (`base_model_name_or_path`) is checked the same way.

    Args:
        path: a Hugging Face model folder, or a PEFT adapter folder.

    Returns:
        {"model_type", "architectures", "is_adapter", "base_model" (resolved base path or None),
         "max_position_embeddings", "vocab_size", "dtype"}; shape fields come from the base for an adapter.

    Raises:
        FileNotFoundError: the folder (or an adapter's base) does not exist.
        ValueError: the folder is not a Hugging Face model folder, or lacks weights.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path '{path}' does not exist")
    if not p.is_dir():
        raise ValueError(f"model path '{path}' is a file, not a Hugging Face model folder")
    if (p / "adapter_config.json").exists():
        adapter = _read_json(p / "adapter_config.json")
        if not any((p / f).exists() for f in _ADAPTER_WEIGHT_FILES):
            raise ValueError(f"model path '{path}' has adapter_config.json but no {' or '.join(_ADAPTER_WEIGHT_FILES)}")
        base = _resolve_base(p, adapter.get("base_model_name_or_path"))
        try:
            info = check_model_path(base)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"model path '{path}' is an adapter whose base is unusable: {e}") from e
        if info["is_adapter"]:
            raise ValueError(f"model path '{path}' is an adapter on another adapter ('{base}'): not supported")
        return {**info, "is_adapter": True, "base_model": str(base)}
    if not (p / "config.json").exists():
        raise ValueError(f"model path '{path}' has no config.json (not a Hugging Face model folder)")
    config = _read_json(p / "config.json")
    if not any((p / f).exists() for f in _WEIGHT_FILES):
        raise ValueError(f"model path '{path}' has config.json but no weights ({', '.join(_WEIGHT_FILES)})")
    # Multimodal configs nest the language model's shape under text_config.
    text = config.get("text_config") or {}
    return {
        "model_type": config.get("model_type"),
        "architectures": list(config.get("architectures") or []),
        "is_adapter": False,
        "base_model": None,
        "max_position_embeddings": config.get("max_position_embeddings", text.get("max_position_embeddings")),
        "vocab_size": config.get("vocab_size", text.get("vocab_size")),
        "dtype": config.get("dtype") or config.get("torch_dtype") or text.get("dtype"),
    }


def load_tokenizer(path: str | Path, require_chat_template: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model folder (for an adapter folder without one: its base's).

    Args:
        path: model, adapter or tokenizer-only folder.
        require_chat_template: raise if the tokenizer has no chat template (chat SFT, RL on messages).

    Returns:
        The tokenizer, with `pad_token` falling back to `eos_token` when unset.
    """
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"tokenizer path '{path}' does not exist")
    # A tokenizer-only folder is fine here; an adapter folder saved without one uses its base's.
    if (source / "adapter_config.json").exists() and not any((source / f).exists() for f in _TOKENIZER_FILES):
        source = Path(check_model_path(source)["base_model"])
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            logger.warning("tokenizer at '%s' has neither pad_token nor eos_token", source)
        else:
            logger.warning("tokenizer at '%s' has no pad_token: using eos_token %r", source, tokenizer.eos_token)
            tokenizer.pad_token = tokenizer.eos_token
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer at '{source}' has no chat_template (needed to render messages); "
            f"use an instruct/chat model or set tokenizer.chat_template"
        )
    return tokenizer


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)} or 'auto'") from None


def load_causal_lm(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    trainable_adapter: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a local folder: a full model, or a LoRA adapter on top of its base.

    Args:
        path: model or adapter folder (see `check_model_path`).
        dtype: "float32", "bfloat16", "float16" (or a torch.dtype, or "auto" for the folder's dtype).
        trainable_adapter: for an adapter folder, keep the LoRA weights trainable (resume training).

    Returns:
        A `PreTrainedModel` in eval mode, or a `peft.PeftModel` for an adapter folder.
    """
    info = check_model_path(path)
    torch_dtype = _torch_dtype(dtype)
    auto = _auto_class(info["model_type"])
    if info["is_adapter"]:
        from peft import PeftModel

        base = auto.from_pretrained(info["base_model"], local_files_only=True, dtype=torch_dtype)
        return PeftModel.from_pretrained(base, str(path), is_trainable=trainable_adapter)
    return auto.from_pretrained(str(path), local_files_only=True, dtype=torch_dtype)


def _auto_class(model_type: str | None):
    """AutoModelForCausalLM, or for a vision-language model (Qwen2-VL, LLaVA, ...) the image-text-to-text class:
    both give a model whose forward returns next-token logits."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP/FSDP1 wrap as `.module`, torch.compile as `._orig_mod`.
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_peft(model: torch.nn.Module) -> bool:
    # Avoid importing peft just to ask: a PeftModel always carries `peft_config`.
    return type(model).__module__.startswith("peft.") and hasattr(model, "peft_config")


def num_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (tied weights counted once); only those with requires_grad if `trainable_only`."""
    return sum(p.numel() for p in _unwrap(model).parameters() if p.requires_grad or not trainable_only)


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
    merge_lora: bool = False,
    base_model: str | Path | None = None,
) -> dict[str, Any]:
    """Save a model (+ tokenizer) as a Hugging Face folder with safetensors weights.

    A `PeftModel` is saved as an adapter folder whose `adapter_config.json` points `base_model_name_or_path` at
    the base folder (so `load_causal_lm(out_dir)` works), unless `merge_lora`: then the LoRA weights are merged
    into a copy of the model (the caller's model stays a trainable PeftModel) and the full model is saved.

    Args:
        model: a PreTrainedModel or PeftModel, possibly wrapped in DDP or torch.compile.
        tokenizer: saved next to the weights (skipped if None).
        out_dir: folder to write (created if missing).
        merge_lora: save the merged full model instead of the adapter.
        base_model: for an adapter, the base folder to record; default the path the base was loaded from.

    Returns:
        {"architecture", "dtype", "adapter", "base_model", "num_parameters"} where num_parameters counts what
        `load_causal_lm(out_dir)` returns (base + adapter for an adapter folder).
    """
    model = _unwrap(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    is_adapter = _is_peft(model) and not merge_lora
    base_path: str | None = None
    if _is_peft(model) and merge_lora:
        model = copy.deepcopy(model).merge_and_unload()
    if is_adapter:
        configs = model.peft_config
        recorded = base_model or next(iter(configs.values())).base_model_name_or_path
        if not recorded:
            raise ValueError(
                f"save_checkpoint('{out_dir}'): the adapter's base model path is unknown (built in memory?); "
                f"pass base_model= or merge_lora=True"
            )
        # An absolute path keeps the adapter loadable from any working directory.
        base_path = str(Path(recorded).resolve()) if Path(recorded).exists() else str(recorded)
        previous = {name: cfg.base_model_name_or_path for name, cfg in configs.items()}
        try:
            for cfg in configs.values():
                cfg.base_model_name_or_path = base_path
            model.save_pretrained(str(out), safe_serialization=True)
        finally:
            for name, cfg in configs.items():
                cfg.base_model_name_or_path = previous[name]
        inner = model.get_base_model()
    else:
        model.save_pretrained(str(out), safe_serialization=True)
        inner = model
        _copy_processor(Path(str(getattr(inner, "name_or_path", "") or "")), out)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    architectures = getattr(inner.config, "architectures", None) or [type(inner).__name__]
    first_param = next(inner.parameters(), None)
    return {
        "architecture": architectures[0],
        "dtype": str(first_param.dtype).removeprefix("torch.") if first_param is not None else None,
        "adapter": is_adapter,
        "base_model": base_path,
        "num_parameters": num_parameters(model),
    }


# A vision-language model's preprocessing settings (image size limits, patch and merge sizes): every model folder
# made from it carries them, so its engine and trainer make the same image tokens.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def _copy_processor(source: Path, out: Path) -> None:
    """The processor files of the folder a model was loaded from, next to its saved weights."""
    if not source.is_dir() or source.resolve() == out.resolve():
        return
    for name in PROCESSOR_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant checkpoints, which need no
    input that requires grad, so they also work with frozen embeddings under LoRA)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns, removed in 6)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

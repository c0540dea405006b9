"""Models layer: local tokenizers, tiny random-init models, loading/saving any HF causal LM folder, LoRA.

Names are re-exported lazily, so `import posttrain_core.models` imports neither torch, transformers nor peft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CHAT_TEMPLATE": "tokenizer",
    "SPECIAL_TOKENS": "tokenizer",
    "train_tokenizer": "tokenizer",
    "TINY_PRESETS": "tiny",
    "VLLM_CPU_HEAD_SIZES": "tiny",
    "build_tiny_model": "tiny",
    "build_tiny_checkpoint": "tiny",
    "check_model_path": "loading",
    "load_tokenizer": "loading",
    "load_causal_lm": "loading",
    "save_checkpoint": "loading",
    "num_parameters": "loading",
    "apply_lora": "lora",
    "merge_lora": "lora",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .loading import check_model_path, load_causal_lm, load_tokenizer, num_parameters, save_checkpoint  # noqa: F401
    from .lora import apply_lora, merge_lora  # noqa: F401
    from .tiny import TINY_PRESETS, VLLM_CPU_HEAD_SIZES, build_tiny_checkpoint, build_tiny_model  # noqa: F401
    from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain_core.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Tiny random-init Llama / Qwen2 causal LMs for tests, demos and CI, built without any model hub.

`build_tiny_checkpoint` writes a complete HF folder (weights + tokenizer) that every stage can load by path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

# Head sizes the vLLM CPU attention kernel supports; other sizes build in HF but fail in the rollout engine.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

TINY_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
    "small": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2),
}

Arch = Literal["llama", "qwen2"]


def _default_intermediate_size(hidden_size: int) -> int:
    # Llama's SwiGLU convention: 8/3 * hidden, rounded up to a multiple of 32.
    return ((8 * hidden_size // 3 + 31) // 32) * 32


def _check_shape(hidden_size: int, num_heads: int, num_kv_heads: int) -> int:
    if num_heads <= 0 or hidden_size % num_heads != 0:
        raise ValueError(
            f"build_tiny_model: hidden_size={hidden_size} is not divisible by num_heads={num_heads}"
        )
    head_dim = hidden_size // num_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"build_tiny_model: head_dim = hidden_size / num_heads = {hidden_size} / {num_heads} = {head_dim}, "
            f"but vLLM's CPU attention supports only head sizes {list(VLLM_CPU_HEAD_SIZES)}; "
            f"change hidden_size or num_heads"
        )
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"build_tiny_model: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
        )
    return head_dim


def build_tiny_model(
    arch: Arch = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> PreTrainedModel:
    """Build a random-init fp32 `LlamaForCausalLM` or `Qwen2ForCausalLM`.

    The weights depend only on the arguments (the seed is applied inside; the caller's global torch RNG state is
    restored afterwards). `head_dim = hidden_size / num_heads` must be a size vLLM's CPU kernel supports.

    Args:
        arch: "llama" or "qwen2" (Qwen2 adds biases to q/k/v projections).
        vocab_size: embedding rows; use `len(tokenizer)`.
        hidden_size, num_layers, num_heads, num_kv_heads: transformer shape (GQA when num_kv_heads < num_heads).
        intermediate_size: MLP width; default 8/3 * hidden_size rounded up to a multiple of 32.
        max_position_embeddings: longest supported sequence (RoPE).
        tie_word_embeddings: share the input embedding with the LM head.
        seed: initialisation seed.
        pad_token_id, eos_token_id, bos_token_id: special ids written into the config.

    Returns:
        The model in eval mode, on CPU, fp32.
    """
    head_dim = _check_shape(hidden_size, num_heads, num_kv_heads)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _default_intermediate_size(hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        dtype="float32",
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        common.pop("head_dim")  # Qwen2Config derives it from hidden_size / num_attention_heads
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        raise ValueError(f"build_tiny_model: arch={arch!r} is not one of 'llama', 'qwen2'")

    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model = model.to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id if pad_token_id is not None else eos_token_id,
        bos_token_id=bos_token_id,
    )
    return model


def build_tiny_checkpoint(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    arch: Arch = "llama",
    **kw: Any,
) -> Path:
    """Build a tiny model matched to `tokenizer` and save model + tokenizer (safetensors) to `out_dir`.

    Args:
        out_dir: folder to write (created if missing).
        tokenizer: e.g. from `train_tokenizer`; sets vocab_size and the special ids.
        arch: "llama" or "qwen2".
        **kw: other `build_tiny_model` arguments, e.g. `**TINY_PRESETS["small"]`, `seed=1`.

    Returns:
        `out_dir` as a Path.
    """
    out = Path(out_dir)
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if kw.get("vocab_size", ids["vocab_size"]) < ids["vocab_size"]:
        raise ValueError(
            f"build_tiny_checkpoint: vocab_size={kw['vocab_size']} is smaller than len(tokenizer)={ids['vocab_size']}"
        )
    # A tokenizer without a real limit reports a huge model_max_length (int(1e30)): fall back to 512 then.
    max_length = int(tokenizer.model_max_length)
    kw.setdefault("max_position_embeddings", max_length if max_length <= 1 << 17 else 512)
    model = build_tiny_model(arch=arch, **{**ids, **kw})
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out

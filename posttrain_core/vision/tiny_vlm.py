"""Tiny random-init VLMs for tests and the VLM demo, on the project's own tokenizer, built without any hub.

Qwen2-VL is the family whose inputs exercise everything a real VLM needs: a vision tower, image tokens expanded from
the image's patch grid, and 3-D (M-RoPE) positions. LLaVA is the other common layout: a CLIP tower, a projector, every
image cropped to one size and spliced in as a fixed run of `<image>` tokens, plain 1-D positions. Each folder written
here is a complete Hugging Face VLM folder (model, tokenizer with the vision special tokens,
`preprocessor_config.json`), loaded like any user's VLM.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

# Qwen2-VL's own names for its vision tokens: a user's Qwen2-VL tokenizer has them already.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# 28 x 28 pixels make one image token (14-pixel patches, merged 2 x 2): 4 to 16 tokens per image. A 56 x 56 image is
# 4 tokens; larger ones are resized down to at most 16 (the processor's max_pixels), whatever the user sends.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16

PRESETS: dict[str, dict[str, int]] = {
    # head size 32 (a vLLM CPU attention size); mrope_section sums to head size / 2
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vision_depth=2, vision_dim=32),
    "small": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vision_depth=2, vision_dim=64),
}


# LLaVA's image token; its images are cropped to LLAVA_IMAGE x LLAVA_IMAGE pixels, LLAVA_PATCH-pixel patches: 16 tokens.
LLAVA_IMAGE_TOKEN, LLAVA_IMAGE, LLAVA_PATCH = "<image>", 56, 14


def add_vision_tokens(tokenizer: PreTrainedTokenizerBase, tokens=VISION_TOKENS) -> dict[str, int]:
    """Add the vision special tokens (kept whole by the tokenizer, never split) and return their ids."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}


def _text_config(tokenizer: PreTrainedTokenizerBase, p: dict[str, int], max_position_embeddings: int) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=p["hidden_size"],
        intermediate_size=((8 * p["hidden_size"] // 3 + 31) // 32) * 32,
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"],
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )


def _llava(tokenizer: PreTrainedTokenizerBase, p: dict[str, int], max_position_embeddings: int):
    """(config, model class, image processor) of a tiny LLaVA: CLIP tower, projector, Llama language model."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    ids = add_vision_tokens(tokenizer, (LLAVA_IMAGE_TOKEN,))
    side = LLAVA_IMAGE // LLAVA_PATCH
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=p["vision_dim"],
        intermediate_size=2 * p["vision_dim"],
        num_hidden_layers=p["vision_depth"],
        num_attention_heads=2,
        image_size=LLAVA_IMAGE,
        patch_size=LLAVA_PATCH,
    )
    config = LlavaConfig(
        text_config={"model_type": "llama", **_text_config(tokenizer, p, max_position_embeddings)},
        vision_config=vision,
        image_token_index=ids[LLAVA_IMAGE_TOKEN],
        image_seq_length=side * side,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    processor = LlavaImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE}, crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE}
    )
    return config, LlavaForConditionalGeneration, processor


def _qwen2_vl(tokenizer: PreTrainedTokenizerBase, p: dict[str, int], max_position_embeddings: int):
    """(config, model class, image processor) of a tiny Qwen2-VL."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = add_vision_tokens(tokenizer)
    head = p["hidden_size"] // p["num_heads"]
    # M-RoPE splits the rotary half of a head into (time, height, width) sections, in Qwen2-VL's proportions
    t = head // 8
    hw = (head // 2 - t) // 2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [t, hw, head // 2 - t - hw]}
    text = {**_text_config(tokenizer, p, max_position_embeddings), "rope_parameters": rope}
    vision = dict(
        depth=p["vision_depth"],
        embed_dim=p["vision_dim"],
        hidden_size=p["hidden_size"],  # what the merger projects the image tokens to: the language model's width
        num_heads=2,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_chans=3,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    return (
        config,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    )


ARCHS = {"qwen2_vl": _qwen2_vl, "llava": _llava}


def build_tiny_vlm_checkpoint(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    arch: str = "qwen2_vl",
    size: str = "tiny",
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny random-init VLM (model, tokenizer with the vision tokens, image processor) to `out_dir`.

    Args:
        tokenizer: the project's BPE tokenizer (`train_tokenizer`); the vision tokens are added to it.
        arch: an `ARCHS` name.
        size: a `PRESETS` name.
    """
    config, model_class, processor = ARCHS[arch](tokenizer, PRESETS[size], max_position_embeddings)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out

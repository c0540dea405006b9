"""What a vision-language model's forward takes beyond token ids, built one way for the engine and the trainer.

A prompt's images ride in the datasets as PNG bytes, with one `<image>` marker per image in the message text
(`vision.images`). To run the model:

- each marker becomes the model's placeholder with its image token repeated n times, n = the token count the
  model's image processor gives that image. Qwen2-VL / Qwen2.5-VL: `<|vision_start|><|image_pad|> x n<|vision_end|>`,
  n = the image's patch grid / merge^2; LLaVA: `<image> x n`, n = (image size / patch size)^2 for every image (its
  processor resizes and crops them all to one size). The processor's settings (min/max pixels, patch and merge
  sizes, crop size) are read from the model folder, so the engine and the trainer make the same tokens; the
  expanded ids are what the rollouts store, ready for training;
- the forward takes the batch's pixel values (every image of every row, in row order) and positions that count
  real tokens only, as a left-padded row alone would see them: Qwen's 3-D (M-RoPE) positions from the model's own
  `get_rope_index`, with its grids and image-token mask; LLaVA's 1-D ones. Positions are always passed: a model left
  to derive them caches a rope offset on itself that a later call could reuse;
- before every forward the image-token count is checked against the images: a mismatch fails naming the row here,
  not deep inside the model ("image features and image tokens do not match");
- the vision tokens are never sampled: the engine bans them and the trainer's log-softmax leaves them out alike
  (`banned_ids`), so a policy cannot emit a token that breaks the next forward, and the two log-probs stay equal.

An image's size in tokens is carried as a grid (t, h, w) for every family: Qwen's patch grid, or (1, side, side) for
LLaVA, whose merge is 1.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from posttrain_core.vision.images import IMAGE_MARKER

# Families whose inputs are built here. M-RoPE families: a patch grid per image, vision start/end tokens and 3-D
# positions from the model's own `get_rope_index`. Fixed-size families: every image resized to one square of patches,
# the image token alone as its placeholder, 1-D positions.
MROPE = ("qwen2_vl", "qwen2_5_vl")
FIXED = ("llava",)
SUPPORTED = MROPE + FIXED


@dataclass(frozen=True)
class VisionSpec:
    """A VLM folder's vision tokens and image processor."""

    folder: str
    family: str  # a SUPPORTED model type
    image_token: int
    video_token: int | None
    start_token: int | None  # M-RoPE families: around each image's tokens
    end_token: int | None
    merge: int
    side: int = 0  # fixed-size families: an image is side x side tokens

    @classmethod
    def of(cls, path: str | Path) -> VisionSpec | None:
        """The spec of the model (or adapter) folder at `path`; None for a text-only model."""
        from posttrain_core.models.loading import check_model_path

        info = check_model_path(path)
        folder = Path(info["base_model"] or path)
        config = json.loads((folder / "config.json").read_text())
        family = config.get("model_type")
        image = config.get("image_token_id", config.get("image_token_index"))
        if image is None:
            return None
        if family not in SUPPORTED or (family in MROPE and config.get("vision_start_token_id") is None):
            raise ValueError(
                f"model {path}: {family} is a vision-language model of a family posttrain does not run yet "
                f"(supported: {', '.join(SUPPORTED)}; docs/vlm.md)"
            )
        if family in FIXED:
            from transformers import AutoConfig

            full = AutoConfig.from_pretrained(folder, local_files_only=True)  # the vision config's defaults filled in
            if full.vision_feature_select_strategy != "default":
                raise ValueError(
                    f"model {path}: vision_feature_select_strategy={full.vision_feature_select_strategy!r}; posttrain "
                    "runs LLaVA models with 'default' (the image's patches without the class token)"
                )
            side = full.vision_config.image_size // full.vision_config.patch_size
            return cls(str(folder), family, int(image), None, None, None, merge=1, side=side)
        vision = config.get("vision_config") or {}
        return cls(
            folder=str(folder),
            family=family,
            image_token=int(image),
            video_token=int(config.get("video_token_id", image)),
            start_token=int(config["vision_start_token_id"]),
            end_token=int(config["vision_end_token_id"]),
            merge=int(vision.get("spatial_merge_size", 2)),
        )

    @cached_property
    def processor(self) -> Any:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.folder, local_files_only=True)

    @property
    def banned_ids(self) -> list[int]:
        """`banned_ids` of this model: the vision tokens the spec holds (no second read of its config)."""
        return sorted(
            {t for t in (self.image_token, self.video_token, self.start_token, self.end_token) if t is not None}
        )

    def pixels(self, images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grids: images x 3) of PNG-encoded images. pixel_values: patches x features for M-RoPE
        families, images x channels x height x width for fixed-size ones."""
        from PIL import Image

        opened = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        out = self.processor(images=opened, return_tensors="pt")
        if self.family in FIXED:
            return out["pixel_values"], torch.tensor([[1, self.side, self.side]] * len(images))
        return out["pixel_values"], out["image_grid_thw"]

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        return (grid_thw.prod(-1) // (self.merge**2)).tolist()

    def _render(self, tokenizer, messages: list[dict], images: list[bytes], where: str) -> list[dict]:
        """`messages` with each marker replaced by the model's one-image placeholder (start, one pad, end; or the
        image token alone)."""
        from posttrain_core.vision.images import check_markers

        check_markers(messages, images, where)
        around = [self.start_token, self.image_token, self.end_token] if self.family in MROPE else [self.image_token]
        placeholder = "".join(tokenizer.convert_ids_to_tokens(around))
        return [{**m, "content": str(m["content"]).replace(IMAGE_MARKER, placeholder)} for m in messages]

    def prompt(self, tokenizer, messages: list[dict], images: list[bytes] | None, where: str, encode=None) -> Prompt:
        """The expanded prompt ids (chat template, generation prompt) and pixels of one row's messages; `encode`
        renders and tokenizes the messages (default `data.chat.tokenize_prompt`; the tool loop's adds its tools)."""
        from posttrain_core.data.chat import tokenize_prompt

        images = images or []
        rendered = self._render(tokenizer, messages, images, where)
        ids = encode(rendered) if encode is not None else tokenize_prompt(tokenizer, rendered)
        if not images:
            return Prompt(ids, None, None)
        pixel_values, grid = self.pixels(images)
        return Prompt(self.expand(ids, grid, where), pixel_values, grid)

    def chat(
        self, tokenizer, messages: list[dict], images: list[bytes] | None, max_length: int, where: str
    ) -> tuple[list[int], list[int], tuple[torch.Tensor, torch.Tensor] | None]:
        """`data.chat.tokenize_chat` of a chat with images: (input ids, labels, (pixel_values, grid_thw) or None).

        Raises:
            ValueError: `max_length` would cut through an image's tokens (the rest of the image would be lost).
        """
        from posttrain_core.data.chat import tokenize_chat

        images = images or []
        ids, labels = tokenize_chat(tokenizer, self._render(tokenizer, messages, images, where))
        px = None
        if images:
            pixel_values, grid = self.pixels(images)
            ids, labels = self.expand(ids, grid, where, labels)
            px = (pixel_values, grid)
        if len(ids) > max_length:
            if any(t in ids[max_length:] for t in (self.image_token, self.end_token) if t is not None):
                raise ValueError(
                    f"{where}: {len(ids)} tokens with its image tokens, and max_seq_len={max_length} would cut "
                    "through an image: raise max_seq_len or use smaller images"
                )
            ids, labels = ids[:max_length], labels[:max_length]
        return ids, labels, px

    def expand(self, ids: list[int], grid_thw: torch.Tensor, where: str, labels: list[int] | None = None):
        """Each single image token of `ids` repeated to its image's token count, in order; with `labels` (aligned to
        `ids`), (ids, labels) expanded alike, the image tokens' labels IGNORE_INDEX (never trained on)."""
        from posttrain_core.data.chat import IGNORE_INDEX

        counts = self.tokens_per_image(grid_thw)
        if ids.count(self.image_token) != len(counts):
            raise ValueError(f"{where}: {ids.count(self.image_token)} image tokens for {len(counts)} images")
        out, out_labels, k = [], [], 0
        for j, t in enumerate(ids):
            n = counts[k] if t == self.image_token else 1
            k += int(t == self.image_token)
            out += [t] * n
            if labels is not None:
                out_labels += [IGNORE_INDEX] * n if t == self.image_token else [labels[j]]
        return out if labels is None else (out, out_labels)

    def check(self, ids: list[int], grid_thw: torch.Tensor | None, where: str) -> None:
        """The row's image tokens are exactly what its images expand to."""
        want = sum(self.tokens_per_image(grid_thw)) if grid_thw is not None else 0
        have = sum(1 for t in ids if t == self.image_token)
        if have != want:
            raise ValueError(f"{where}: {have} image tokens, but its images expand to {want} (grids {grid_thw})")


# What a banned token's logit becomes: exp() of it is exactly 0 in fp32, as for -inf, without -inf's 0 * inf = nan in
# an entropy.
BANNED_LOGIT = -1e9


def banned_ids(config: Any) -> list[int]:
    """Tokens a VLM policy must never sample, from its config (an object or a dict): its image/video pad and vision
    start/end tokens, each of which claims an image the next forward has no pixels for. [] for a text model."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    names = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(get(k)) for k in names if get(k) is not None})


def ban(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the `ids` columns at `BANNED_LOGIT`: neither sampled nor part of any log-softmax's mass."""
    return logits if ids is None else logits.index_fill(-1, ids, BANNED_LOGIT)


@dataclass
class Prompt:
    ids: list[int]
    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The VLM's backbone (vision tower + language model, returning hidden states) under a peft wrapper or not."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model.model


def forward_inputs(
    model: torch.nn.Module,
    spec: VisionSpec,
    ids_B_L: torch.Tensor,
    mask_B_L: torch.Tensor,
    pixels: list[torch.Tensor | None],
    grids: list[torch.Tensor | None],
    where: str,
) -> dict[str, torch.Tensor]:
    """The keyword arguments of a VLM forward over a (left- or right-) padded batch: the rows' pixels in row order and
    the positions (3 x B x L for M-RoPE families, with the grids and image-token mask; else B x L).

    Raises:
        ValueError: a row's image tokens do not match its images (`VisionSpec.check`).
    """
    for b in range(ids_B_L.shape[0]):
        spec.check(ids_B_L[b].tolist(), grids[b], f"{where}, row {b}")
    present = [b for b in range(len(grids)) if grids[b] is not None]
    kwargs: dict[str, torch.Tensor] = {}
    if present:
        kwargs["pixel_values"] = torch.cat([pixels[b] for b in present])
    if spec.family in FIXED:
        kwargs["position_ids"] = (mask_B_L.cumsum(-1) - 1).clamp(min=0)
        return kwargs
    mm_B_L = (ids_B_L == spec.image_token).int()
    grid = torch.cat([grids[b] for b in present]) if present else None
    kwargs["mm_token_type_ids"] = mm_B_L
    if present:
        kwargs["image_grid_thw"] = grid
    pos_3_B_L, _ = backbone(model).get_rope_index(ids_B_L, mm_B_L, image_grid_thw=grid, attention_mask=mask_B_L)
    kwargs["position_ids"] = pos_3_B_L
    return kwargs


def batch_inputs(
    model: torch.nn.Module,
    spec: VisionSpec,
    ids_B_L: torch.Tensor,
    mask_B_L: torch.Tensor,
    images: list[tuple[torch.Tensor, torch.Tensor] | None],
    where: str,
) -> dict[str, torch.Tensor]:
    """`forward_inputs` of rows whose images are given as (pixel_values, grid_thw) pairs (None: no image)."""
    pixels = [im[0] if im is not None else None for im in images]
    grids = [im[1] if im is not None else None for im in images]
    return forward_inputs(model, spec, ids_B_L, mask_B_L, pixels, grids, where)


def freeze_tower(model: torch.nn.Module) -> int:
    """Freeze a VLM's vision tower (every parameter under a `visual` or `vision_tower` module); returns how many were
    frozen. LLaVA's projector stays trainable: it is the bridge the language model learns to read through.

    The default for training: the task's signal trains the language model, which learns to read what a pretrained
    tower sees (`train_vision` trains the tower too)."""
    frozen = 0
    for name, p in model.named_parameters():
        if any(f".{t}." in f".{name}" for t in ("visual", "vision_tower")) and p.requires_grad:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen

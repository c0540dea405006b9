"""A model worker's memory budget: what it leaves for one pass, and what a pass of a given shape takes.

What a worker holds all the time is the process with its base model loaded (measured once, at start: libraries,
weights, tokenizer) plus its resident adapters: fp32 weights, gradients and AdamW's two moments, 16 bytes per
parameter (4 for a frozen sampler snapshot). What its budget leaves beyond that, less `RESERVE`, is the room for one
pass, and every pass is sized to fit it:

- a forward/backward pass keeps, for its backward, activations in proportion to its padded tokens (`token_bytes`, from
  the model's shape) plus the additive attention mask of a padded batch (rows x longest^2 floats). The LM head's
  logits are computed a bounded chunk at a time (`models.heads`), whatever the pass;
- a decode batch keeps each sample's KV cache, one layer's prefill activations and a few rows of vocabulary-sized
  tensors per step (`sample_bytes`).

The per-token figure is an estimate on the safe side, not a measurement: on SmolLM2-135M (30 layers, hidden 576,
intermediate 1536) a pass of a rank-8 adapter on every linear layer and the head grows the worker by 1.2 MB per padded
token, for 400 datums of 10 tokens and for one of 2,000 alike; `token_bytes` says 2.1 MB. That holds with the
worker's allocator set as `worker` sets it (large blocks returned at once): with glibc's default, the heap fragments
and the same short-datum pass grew the process by 3 MB per token. It assumes attention through torch's
scaled-dot-product kernel (no [T x T] scores kept per layer), as transformers' default `sdpa` does on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain_core.models.heads import LOGIT_CHUNK_BYTES

MiB, GiB = 2**20, 2**30
FLOAT = 4  # activations are counted in fp32 (a bf16 model keeps some in fp32: norms, softmax, the head's logits)
# Beyond the estimates: one head chunk's logits, their softmax, gradient and log-softmax, and allocator slack.
RESERVE = 256 * MiB + 4 * LOGIT_CHUNK_BYTES


@dataclass(frozen=True)
class Shape:
    """What a transformer's memory per token depends on, read from its config."""

    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head size
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            kv_width=kv_heads * head_dim,
            vocab=int(config.vocab_size),
        )


def token_bytes(shape: Shape, rank: int) -> int:
    """Bytes one padded token of a forward/backward pass keeps until its backward: per layer, the inputs of its
    norms, projections and attention, the MLP's gate/up/activation outputs, and the LoRA branches of rank `rank`."""
    return FLOAT * shape.layers * (18 * shape.hidden + 5 * shape.intermediate + 16 * rank)


def pass_bytes(shape: Shape, rows: int, longest: int, rank: int) -> int:
    """A forward/backward pass over `rows` sequences padded to `longest` tokens."""
    return rows * longest * token_bytes(shape, rank) + FLOAT * rows * longest * longest


def sample_bytes(shape: Shape, rows: int, prompt: int, max_tokens: int) -> int:
    """A decode batch of `rows` samples of a `prompt`-token prompt and up to `max_tokens` new tokens."""
    kv = FLOAT * shape.layers * 2 * shape.kv_width * (prompt + max_tokens)
    prefill = FLOAT * prompt * (8 * shape.hidden + 4 * shape.intermediate) + FLOAT * prompt * prompt
    per_step = FLOAT * 8 * shape.vocab  # logits, probabilities, sorted probabilities and indices, log-softmax
    return rows * (kv + prefill + per_step)


def adapter_bytes(parameters: int, trainable: bool) -> int:
    """An adapter's resident bytes: fp32 weights, and for a trainable one their gradients and AdamW's moments."""
    return parameters * FLOAT * (4 if trainable else 1)


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"

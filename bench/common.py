"""What the side-by-side benchmarks share: the benchmark model, synthetic chats of realistic lengths, prompts, timing.

Everything is made locally and deterministically from seeds (nothing comes from a model hub): a byte-level BPE
tokenizer trained on the synthetic corpus, a random-init Llama built by posttrain's own model builder, SFT chats whose
token lengths spread over [~48, max_seq_len] (so padding behaves as on real chat data), and the synthetic arithmetic
prompts for rollouts and GRPO.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The benchmark model: Llama shape (RoPE, RMSNorm, SwiGLU, GQA), head_dim 64. ~10.2M parameters with vocab 2048.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "bench": dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2),
}
VOCAB_SIZE = 2048

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "qu", "ng"]


@dataclass(frozen=True)
class ModelInfo:
    path: str
    params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def as_dict(self) -> dict:
        return asdict(self)


def _words(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(w)
    text = " ".join(out)
    return text[0].upper() + text[1:] + "."


def long_chats(n: int, seed: int = 0) -> list[list[dict]]:
    """n [user, assistant] chats of pseudo-words; user 6-60 words, assistant 10-110 words (~1.3 tokens a word)."""
    rng = random.Random(seed)
    return [
        [
            {"role": "user", "content": _words(rng, rng.randint(6, 60))},
            {"role": "assistant", "content": _words(rng, rng.randint(10, 110))},
        ]
        for _ in range(n)
    ]


def build_model(out_dir: Path, preset: str = "bench", vocab_size: int = VOCAB_SIZE, max_len: int = 512) -> ModelInfo:
    """Tokenizer (trained on chats + the synthetic task corpus) and a random-init Llama, saved as an HF folder."""
    from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems
    from posttrain_core.models.loading import load_causal_lm, num_parameters
    from posttrain_core.models.tiny import TINY_PRESETS, _default_intermediate_size, build_tiny_checkpoint
    from posttrain_core.models.tokenizer import train_tokenizer

    shape = {**TINY_PRESETS, **MODEL_PRESETS}[preset]
    corpus = corpus_for_tokenizer(make_problems(n=2000)) + [
        m["content"] for chat in long_chats(2000, seed=999) for m in chat
    ]
    tokenizer = train_tokenizer(corpus, vocab_size=vocab_size, model_max_length=max_len)
    build_tiny_checkpoint(out_dir, tokenizer, max_position_embeddings=max_len, **shape)
    params = num_parameters(load_causal_lm(str(out_dir)))
    return ModelInfo(
        path=str(out_dir),
        params=params,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        num_heads=shape["num_heads"],
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["hidden_size"] // shape["num_heads"],
        intermediate_size=_default_intermediate_size(shape["hidden_size"]),
        vocab_size=len(tokenizer),
    )


def tokenized(model_path: str, chats: list[list[dict]], max_len: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) exactly as posttrain's SFT loop builds them (assistant tokens trained, truncated)."""
    from posttrain_core.data.chat import tokenize_chat
    from posttrain_core.models.loading import load_tokenizer

    tok = load_tokenizer(model_path)
    return [tokenize_chat(tok, m, max_length=max_len) for m in chats]


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def write_json(path: str | Path, obj) -> None:
    Path(path).write_text(json.dumps(obj))

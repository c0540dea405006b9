"""Rollout throughput, side by side in one run: HFEngine vs a plain `model.generate` loop (vs vLLM when installed).

    python -m bench.rollout_bench                       # tiny random-init Llama built on the fly, ~1 min on 2 cores
    python -m bench.rollout_bench --model PATH --prompts 128 --n 8 --max-tokens 64

Every backend samples the same prompts with the same settings (n samples per prompt, temperature, top_p,
max_tokens) and the same torch thread count; rounds alternate between backends so that machine load hits them
alike. Reported: generated tokens (eos included, padding excluded) per second of generation, best of the rounds,
and each backend's ratio to the plain generate loop. vLLM runs in its own environment through a Ray actor
(`posttrain_core.rollout.vllm_engine`) and is skipped, with the reason, when that is missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa


def build_model(out_dir: Path, size: str) -> str:
    from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems
    from posttrain_core.models.tiny import TINY_PRESETS, build_tiny_checkpoint
    from posttrain_core.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(corpus_for_tokenizer(make_problems(n=400)), vocab_size=512)
    build_tiny_checkpoint(out_dir, tokenizer, **TINY_PRESETS[size])
    return str(out_dir)


def make_prompts(n: int) -> pa.Table:
    from posttrain_core.data.synthetic import make_problems, prompts_table

    return prompts_table(make_problems(n=n, seed=123))


def plain_generate(model_path: str, prompts: pa.Table, args) -> Callable[[], int]:
    """The baseline: one process, `model.generate(do_sample=True, num_return_sequences=n)` per batch of prompts."""
    import torch

    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokenize_prompt(tokenizer, m) for m in prompts.column("messages").to_pylist()]

    def run() -> int:
        tokens = 0
        for start in range(0, len(encoded), args.batch_size):
            batch = encoded[start : start + args.batch_size]
            T = max(len(x) for x in batch)
            ids = torch.full((len(batch), T), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), T), dtype=torch.long)
            for i, x in enumerate(batch):
                ids[i, T - len(x) :] = torch.tensor(x)
                mask[i, T - len(x) :] = 1
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=args.temperature > 0,
                    temperature=args.temperature if args.temperature > 0 else None,
                    top_p=args.top_p if args.temperature > 0 else None,
                    num_return_sequences=args.n,
                    max_new_tokens=args.max_tokens,
                    pad_token_id=pad,
                    eos_token_id=tokenizer.eos_token_id,
                )
            new = out[:, T:]
            # generated tokens: up to and including the first eos (generate pads after it)
            is_eos = new == tokenizer.eos_token_id
            first = torch.where(
                is_eos.any(1),
                is_eos.float().argmax(1) + 1,
                torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long),
            )
            tokens += int(first.sum())
        return tokens

    return run


def hf_engine(model_path: str, prompts: pa.Table, args) -> Callable[[], int]:
    from posttrain_core.rollout.engine import SamplingSettings
    from posttrain_core.rollout.hf_engine import HFEngine

    engine = HFEngine(model_path)
    params = SamplingSettings(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)

    def run() -> int:
        tokens = 0
        for start in range(0, prompts.num_rows, args.batch_size):
            out = engine.generate(prompts.slice(start, args.batch_size), params)
            tokens += sum(len(x) for x in out.column("response_ids").to_pylist())
        return tokens

    return run


def vllm_engine(model_path: str, prompts: pa.Table, args) -> Callable[[], int]:
    """vLLM in its own environment, in one Ray actor; raises (with the reason) where it is not available."""
    import ray

    from posttrain_core.cluster import connect
    from posttrain_core.config import RolloutConfig
    from posttrain_core.rollout.engine import SamplingSettings
    from posttrain_core.rollout.vllm_env import vllm_options

    cfg = RolloutConfig(
        engine="vllm", n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    options = vllm_options(cfg)  # ValueError naming what is missing
    options["num_cpus"] = args.threads  # Ray gives the actor OMP_NUM_THREADS = num_cpus: the others' thread count
    from posttrain_core.rollout.vllm_engine import VLLMEngine

    connect()
    actor = ray.remote(**options)(VLLMEngine).remote(model_path, dtype=cfg.dtype, seed=cfg.seed)
    params = SamplingSettings(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)

    def run() -> int:
        tokens = 0
        for start in range(0, prompts.num_rows, args.batch_size):  # the same batches as the other backends
            out = ray.get(actor.generate.remote(prompts.slice(start, args.batch_size), params))
            tokens += sum(len(x) for x in out.column("response_ids").to_pylist())
        return tokens

    run.actor = actor  # type: ignore[attr-defined]  # for callers that stop it (ray.kill) when done
    return run


BACKENDS = {"generate": plain_generate, "hf_engine": hf_engine, "vllm": vllm_engine}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model folder (default: build a tiny random-init Llama)")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="tiny model preset when --model is unset")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--backends", default="generate,hf_engine,vllm")
    args = p.parse_args(argv)

    from posttrain_core.env import apply_defaults

    apply_defaults()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or build_model(Path(tmp) / "model", args.size)
        prompts = make_prompts(args.prompts)
        runners: dict[str, Callable[[], int]] = {}
        for name in args.backends.split(","):
            try:
                runners[name] = BACKENDS[name](model_path, prompts, args)
                runners[name]()  # warm-up (first-call allocations, lazy imports, engine compilation)
            except Exception as err:  # noqa: BLE001 - a missing optional backend is reported, not fatal
                print(f"skipping {name}: {type(err).__name__}: {err}")
                runners.pop(name, None)
        rates: dict[str, list[float]] = {name: [] for name in runners}
        tokens: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, run in runners.items():
                start = time.perf_counter()
                tokens[name] = run()
                rates[name].append(tokens[name] / (time.perf_counter() - start))

    print(
        f"\nrollout throughput: {args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, "
        f"temperature={args.temperature}, top_p={args.top_p}, batch {args.batch_size} prompts, "
        f"{args.threads} threads, best of {args.rounds} rounds"
    )
    base = max(rates["generate"]) if rates.get("generate") else None
    print(f"{'backend':<12}{'tokens':>8}{'best tok/s':>12}{'median tok/s':>14}{'vs generate':>13}")
    best = {}
    for name, xs in rates.items():
        best[name] = max(xs)
        ratio = f"{best[name] / base:.2f}x" if base else "-"
        print(f"{name:<12}{tokens[name]:>8}{best[name]:>12.0f}{statistics.median(xs):>14.0f}{ratio:>13}")
    return best


if __name__ == "__main__":
    main()

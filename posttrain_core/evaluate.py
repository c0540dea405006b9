"""The evaluate stage: greedy answers of a model on held-out prompts, checked by a verifier, on Ray tasks.

Publishes an `eval` dataset (one row per prompt) whose manifest carries the accuracy; per-family accuracy is reported
when the prompts' `meta` names a family.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict

import pyarrow as pa

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import EvalConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage

log = logging.getLogger(__name__)

STAGE = "evaluate"


def eval_shard(model_path: str, rows: list[dict], cfg: EvalConfig) -> list[dict]:
    """Generate and verify one shard of prompts (runs inside a Ray task)."""
    import os

    import torch

    from posttrain_core.data.synthetic import VERIFIERS
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer
    from posttrain_core.rollout.hf import generate_texts

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.num_workers))
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    texts = generate_texts(model, tokenizer, [r["messages"] for r in rows], cfg.max_new_tokens, cfg.batch_size)
    verify = VERIFIERS[cfg.verifier]
    results = []
    for row, text in zip(rows, texts, strict=True):
        v = verify(text, row["answer"])
        results.append(
            {
                "prompt_id": row["prompt_id"],
                "sample_index": 0,
                "response_text": text,
                "answer": row["answer"],
                "correct": bool(v["correct"]),
                "reward": float(v["reward"]),
                "parse_failed": bool(v["parse_failed"]),
                "family": (json.loads(row["meta"]) if row.get("meta") else {}).get("family"),
            }
        )
    return results


def run_evaluate(cfg: EvalConfig, prompts: ArtifactRef, model: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """Exact-match (or numeric) accuracy of `model` on a `prompts` dataset with answers."""
    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import check_model_path

    if prompts.schema_kind != "prompts":
        raise ValueError(f"{STAGE}: input must be a 'prompts' dataset, got {prompts.schema_kind}")
    check_model_path(model.uri)

    def build(ctx: StageContext) -> StageOutput:
        import ray

        from posttrain_core.cluster import connect, split
        from posttrain_core.data.io import write_dataset

        table = read_dataset(store.local_path(prompts), "prompts")
        rows = [r for r in table.to_pylist() if r["answer"] is not None]
        if cfg.max_prompts:
            rows = rows[: cfg.max_prompts]
        if not rows:
            raise ValueError(f"{STAGE}: {prompts.uri} has no prompt with an answer")
        connect()
        remote = ray.remote(num_cpus=1)(eval_shard)
        path = str(store.local_path(model))
        shards = split(rows, cfg.num_workers)
        results = [r for part in ray.get([remote.remote(path, s, cfg) for s in shards]) for r in part]
        write_dataset(pa.Table.from_pylist(results), "eval", ctx.outdir)
        metrics = summarize(results)
        log.info("%s: %s accuracy %.3f on %d prompts", STAGE, cfg.verifier, metrics["accuracy"], len(results))
        return StageOutput(manifest={"model": model.uri, "num_prompts": len(results)}, metrics=metrics)

    return run_stage(STAGE, cfg, {"prompts": prompts, "model": model}, store, "dataset", build, schema_kind="eval")


def summarize(results: list[dict]) -> dict[str, float]:
    """accuracy, parse-failure rate, and accuracy per family."""
    n = len(results)
    metrics = {
        "accuracy": sum(r["correct"] for r in results) / n,
        "parse_failure_rate": sum(r["parse_failed"] for r in results) / n,
        "num_prompts": float(n),
    }
    by_family: dict[str, list[bool]] = defaultdict(list)
    for r in results:
        if r.get("family"):
            by_family[r["family"]].append(r["correct"])
    for fam, xs in sorted(by_family.items()):
        metrics[f"accuracy/{fam}"] = sum(xs) / len(xs)
    return metrics

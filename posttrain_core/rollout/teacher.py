"""The teacher_logprobs stage: a teacher scores every token of a rollouts artifact (docs/distillation.md).

rollouts + teacher -> the same rows plus `teacher_logprobs` (the teacher's log-prob of each response token given
everything before it, 0.0 on tool tokens) and, with distill.topk > 0, `teacher_topk_ids` / `teacher_topk_logprobs`
(its k most likely tokens at each response position). One forward pass per batch on the teacher's engine actors
(hf: the trainer's own chunked log-prob path; vLLM: prompt log-probs), which stay warm for the flow run: the teacher
never changes. The key is the rollouts' and the teacher's digests and the scoring settings, so a rerun is a cache hit.

Only the top-k travels: the full distribution of 256 rows x 32 tokens over SmolLM2's 49,152-word vocabulary is
1.5 GB of float32, top-16 is 0.5 MB.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import pyarrow as pa

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.node import node_path
from posttrain_core.config import DistillConfig
from posttrain_core.data.schemas import SCHEMAS
from posttrain_core.rollout.engine import TEACHER_COLUMNS
from posttrain_core.rollout.pool import EnginePool, EngineSpec
from posttrain_core.warm import WarmGroup

log = logging.getLogger(__name__)

STAGE = "teacher_logprobs"
ROLE = "teacher"
_ROLLOUT_NAMES = SCHEMAS["rollouts"].names


def tokenizer_digest(model_path: str) -> str:
    """sha256 of a model folder's tokenizer as the models see it: every token's id, and the special tokens."""
    from posttrain_core.models.loading import load_tokenizer

    tok = load_tokenizer(model_path)
    special = {name: getattr(tok, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    raw = json.dumps([sorted(tok.get_vocab().items()), special], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()


def check_teacher(student: str, teacher: str, field: str = "rl.distill.teacher") -> None:
    """The teacher must score the student's token ids: the same vocabulary size and the same tokenizer. Checked
    from the folders alone, before any Ray work.

    Raises:
        ValueError: the vocabulary sizes or the tokenizers differ (naming both models).
    """
    from posttrain_core.models.loading import check_model_path

    s, t = check_model_path(student), check_model_path(teacher)
    if s["vocab_size"] != t["vocab_size"]:
        raise ValueError(
            f"{field}: the teacher {teacher} has a vocabulary of {t['vocab_size']} tokens, the student {student} of "
            f"{s['vocab_size']}: a teacher must share the student's tokenizer"
        )
    ds, dt = tokenizer_digest(student), tokenizer_digest(teacher)
    if ds != dt:
        raise ValueError(
            f"{field}: the teacher {teacher} (tokenizer {dt[:12]}) and the student {student} (tokenizer {ds[:12]}) "
            "tokenize differently: a teacher must share the student's tokenizer"
        )


def teacher_inputs(rollouts: ArtifactRef, teacher: ArtifactRef) -> dict[str, ArtifactRef]:
    """The stage's named inputs (part of its key; the Prefect task's cache key uses the same)."""
    return {"rollouts": rollouts, "teacher": teacher}


def score_batches(table: pa.Table, batch_size: int) -> list[pa.Table]:
    """The rows the teacher's engines get per call."""
    rows = table.select(["prompt_ids", "response_ids"])
    return [rows.slice(i, batch_size) for i in range(0, rows.num_rows, batch_size)]


def run_teacher_logprobs(
    cfg: DistillConfig,
    rollouts: ArtifactRef,
    teacher: ArtifactRef,
    store: ArtifactStore,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    """Score `rollouts` with `teacher`; publish the rows with the teacher columns as a `teacher_logprobs` dataset.

    Args:
        cfg: the distill settings; the stage uses (and is keyed on) `cfg.scoring()`: topk and the teacher's engine.
        rollouts: a `rollouts` (or `scored_rollouts`) dataset.
        teacher: a model artifact sharing the rollouts' tokenizer (`check_teacher`, run by the flow before Ray).
        warm: the warm group whose teacher engines score and outlive this stage; None: the process's.

    Manifest metrics: rows, tokens, teacher_tokens_per_s, teacher_load_s, and the rollouts' teacher_kl (the mean
    over policy tokens of the sampler's log-prob minus the teacher's, the reverse-KL estimate).
    """
    from posttrain_core.data.io import read_dataset, write_dataset
    from posttrain_core.models.loading import check_model_path
    from posttrain_core.stage import StageContext, StageOutput, run_stage

    scoring = cfg.scoring()
    if rollouts.kind != "dataset" or rollouts.schema_kind not in ("rollouts", "scored_rollouts"):
        raise ValueError(f"{STAGE}: input 'rollouts' must be a rollouts dataset, got {rollouts.schema_kind} at "
                         f"{rollouts.uri}")  # fmt: skip
    if teacher.kind != "model":
        raise ValueError(f"{STAGE}: the teacher must be a model, got a {teacher.kind} at {teacher.uri}")
    teacher_path = str(store.metadata_path(teacher))  # checks only
    check_model_path(teacher_path)
    if scoring.engine == "vllm":
        from posttrain_core.rollout.vllm_env import check_vllm_model, vllm_options

        check_vllm_model(teacher_path, "DistillConfig.engine='vllm'")
        vllm_options(scoring)

    def build(ctx: StageContext) -> StageOutput:
        table = read_dataset(store.local_path(rollouts), rollouts.schema_kind).select(_ROLLOUT_NAMES)
        started = time.perf_counter()
        pool = EnginePool(WarmGroup.use(warm), EngineSpec.of(scoring), role=ROLE)
        load = pool.serve(node_path(store, teacher), teacher.digest)
        parts = pool.score(score_batches(table, scoring.batch_size), scoring.topk)
        seconds = time.perf_counter() - started
        scored, out = pa.concat_tables(parts), table
        for name in TEACHER_COLUMNS:
            out = out.append_column(name, scored.column(name))
        out = _masked(out)
        write_dataset(out, "teacher_logprobs", ctx.outdir)
        metrics = _metrics(out, seconds, load["load_s"])
        log.info("%s: %d rows, %d tokens scored by %s at %.0f tokens/s; teacher_kl %.4f", STAGE, out.num_rows,
                 int(metrics["tokens"]), teacher.uri, metrics["teacher_tokens_per_s"], metrics["teacher_kl"])  # fmt: skip
        manifest = {"teacher": teacher.uri, "rollouts": rollouts.uri, "topk": scoring.topk, "engine": scoring.engine}
        return StageOutput(manifest=manifest, metrics=metrics)

    return run_stage(
        STAGE, scoring, teacher_inputs(rollouts, teacher), store, "dataset", build, schema_kind="teacher_logprobs"
    )


def _masked(table: pa.Table) -> pa.Table:
    """teacher_logprobs 0.0 on tool tokens (response_mask 0): no one should read a log-prob the policy never had."""
    masks = table.column("response_mask").to_pylist()
    if all(m is None for m in masks):
        return table
    logps = table.column("teacher_logprobs").to_pylist()
    fixed = [
        lp if m is None else [x if keep else 0.0 for x, keep in zip(lp, m, strict=True)]
        for lp, m in zip(logps, masks, strict=True)
    ]
    index = table.schema.get_field_index("teacher_logprobs")
    return table.set_column(index, "teacher_logprobs", pa.array(fixed, pa.list_(pa.float32())))


def _metrics(table: pa.Table, seconds: float, load_s: float) -> dict[str, Any]:
    ids = table.column("response_ids").to_pylist()
    masks = table.column("response_mask").to_pylist()
    sampled = table.column("logprobs").to_pylist()
    teacher = table.column("teacher_logprobs").to_pylist()
    gap, n = 0.0, 0
    for s, t, m in zip(sampled, teacher, masks, strict=True):
        for j, (a, b) in enumerate(zip(s, t, strict=True)):
            if m is None or m[j]:
                gap, n = gap + (a - b), n + 1
    tokens = sum(len(x) for x in ids)
    return {
        "rows": float(table.num_rows),
        "tokens": float(tokens),
        "teacher_tokens_per_s": tokens / max(seconds - load_s, 1e-9),
        "teacher_load_s": load_s,
        "teacher_kl": gap / max(n, 1),
    }

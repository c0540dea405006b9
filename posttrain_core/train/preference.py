"""Preference training on Ray workers: a Bradley-Terry reward model and DPO (IPO, cDPO), plus their stage functions.

What it really is. Each row is (prompt, chosen, rejected). The reward model scores prompt + response with a scalar head
at the last token and minimises -log sigmoid(r_c - r_r - margin). DPO minimises -log sigmoid(beta * Delta) with
Delta = (logp_c - ref_c) - (logp_r - ref_r), logp summed over the response tokens; the reference log-probs are
computed once, by their own cached stage (`run_reference_logprobs`), so a second DPO run (another beta) reuses them.
As in `train/loop.py`, a step's loss is the sum over the pairs of the *global* batch divided by its size (independent
of the worker count and of gradient accumulation), the batch of step s is `global_batch(s, ...)` (resume replays it),
and `eval_pairs` rows, split off by a seeded permutation, are scored at the end (RM: pairwise accuracy; DPO: reward
accuracy and mean margin).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import DPOConfig, RewardModelConfig
from posttrain_core.stage import StageContext, StageOutput, key_for, run_stage
from posttrain_core.tracking import MetricsFile, MetricsRelay
from posttrain_core.train.loop import (
    IGNORE,
    _fmt_eta,
    _save_checkpoint,
    build_optimizer,
    collate,
    data_parallel,
    global_batch,
    optimizer_step,
    resume_from_checkpoint,
)
from posttrain_core.train.sft import FAULT_ENV

log = logging.getLogger(__name__)

REF_COLUMNS = ("ref_chosen_logp", "ref_rejected_logp")
N_PROBES = 8  # held-out pairs whose RM scores are stored in the manifest (to check a reloaded checkpoint)

# (chosen_ids, chosen_labels, rejected_ids, rejected_labels, ref_chosen_logp, ref_rejected_logp)
Pair = tuple[list[int], list[int], list[int], list[int], float, float]


class ReferenceLogprobsConfig(BaseModel):
    """What the reference log-probs depend on besides the data and the model (their stage key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int = Field(128, ge=8, description="tokens per prompt + response (longer rows are truncated)")


@dataclass(frozen=True)
class PreferenceJob:
    """Everything a worker needs; plain and picklable (it crosses the Ray boundary)."""

    objective: Literal["rm", "dpo"]
    cfg: RewardModelConfig | DPOConfig
    data_path: str  # preferences; for DPO with the REF_COLUMNS
    model_path: str  # RM: the causal-LM backbone; DPO: the policy
    workdir: str
    outdir: str
    tracker: MetricsFile | None = None  # rank 0 appends step metrics; the driver relays them to MLflow
    fail_after_step: int | None = None  # fault injection for tests: rank 0 exits after this step's checkpoint
    stage: str = "rm"  # prefix of the progress lines


# ------------------------------------------------------------------------------------------------ data (pure)
def encode_response(
    tokenizer: Any, prompt: list[dict], response: list[dict], max_length: int
) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response and labels on the response's assistant tokens only (not the prompt's).

    Like `tokenize_chat`, but an assistant turn inside the prompt (multi-turn history) is not scored: only spans that
    start at or after the rendered prompt + generation header count. Truncated to the first max_length tokens.
    """
    from posttrain_core.data.chat import assistant_spans, render_chat

    text, spans = assistant_spans(tokenizer, [*prompt, *response])
    boundary = len(render_chat(tokenizer, prompt, add_generation_prompt=True)) if prompt else 0
    spans = [s for s in spans if s[0] >= boundary]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_length]
    labels = [
        tok if any(a <= start < b for a, b in spans) else IGNORE
        for tok, (start, _) in zip(ids, enc["offset_mapping"], strict=False)
    ]
    return ids, labels


def split_pairs(n_rows: int, eval_pairs: int, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows), both sorted: the held-out ones are the first `eval_pairs` of a seeded permutation."""
    import torch

    if eval_pairs >= n_rows:
        raise ValueError(f"eval_pairs={eval_pairs} leaves no training pair out of {n_rows} preference rows")
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[eval_pairs:]), sorted(perm[:eval_pairs])


def _scored(labels: list[int]) -> int:
    return sum(1 for y in labels[1:] if y != IGNORE)


def encode_pairs(tokenizer: Any, rows: list[dict], max_length: int) -> tuple[list[Pair], int]:
    """Encode preference rows; drop (and count) those whose chosen or rejected response is cut off entirely, whose
    two sides tokenize the same (no signal), or whose reference log-prob is missing (NaN)."""
    pairs, dropped = [], 0
    for row in rows:
        c_ids, c_lab = encode_response(tokenizer, row["prompt"], row["chosen"], max_length)
        r_ids, r_lab = encode_response(tokenizer, row["prompt"], row["rejected"], max_length)
        ref_c, ref_r = float(row.get(REF_COLUMNS[0], 0.0)), float(row.get(REF_COLUMNS[1], 0.0))
        if not _scored(c_lab) or not _scored(r_lab) or c_ids == r_ids or math.isnan(ref_c) or math.isnan(ref_r):
            dropped += 1
            continue
        pairs.append((c_ids, c_lab, r_ids, r_lab, ref_c, ref_r))
    return pairs, dropped


# ---------------------------------------------------------------------------------------------- worker side
def _per_row_module(objective: str, model: Any) -> Any:
    """An nn.Module mapping (input_ids, attention_mask, labels) to one number per row (what DDP wraps)."""
    import torch

    from posttrain_core.algorithms.preference import sequence_logprobs
    from posttrain_core.models.reward import last_token_scores

    class PerRow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, labels):
            if objective == "rm":
                return last_token_scores(self.model, input_ids, attention_mask)
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            return sequence_logprobs(logits, labels)

    return PerRow()


def _forward_pairs(net: Any, pairs: list[Pair], pad_id: int) -> tuple[Any, Any, int]:
    """Chosen and rejected rows in one padded batch: (out_chosen_B, out_rejected_B, tokens)."""
    rows = [(p[0], p[1]) for p in pairs] + [(p[2], p[3]) for p in pairs]
    ids, labels, mask = collate(rows, pad_id)
    out = net(ids, mask, labels)
    return out[: len(pairs)], out[len(pairs) :], int(mask.sum())


def _pair_loss(job: PreferenceJob, out_c, out_r, pairs: list[Pair]) -> tuple[Any, float, float]:
    """(mean loss with graph, accuracy, mean margin) of a micro-batch."""
    import torch

    from posttrain_core.algorithms.preference import bradley_terry_loss, dpo_loss

    cfg = job.cfg
    if job.objective == "rm":
        loss, acc = bradley_terry_loss(out_c, out_r, margin=cfg.margin)
        return loss, float(acc), float((out_c - out_r).detach().mean())
    ref_c = torch.tensor([p[4] for p in pairs], dtype=torch.float32)
    ref_r = torch.tensor([p[5] for p in pairs], dtype=torch.float32)
    out = dpo_loss(out_c, out_r, ref_c, ref_r, cfg.beta, cfg.loss_type, cfg.label_smoothing)
    return out["loss"], float(out["accuracy"]), float(out["margin"])


def _evaluate(job: PreferenceJob, net: Any, pairs: list[Pair], pad_id: int, rank: int, world: int) -> dict:
    """Held-out {"loss", "accuracy", "margin"} over all ranks (each scores pairs[rank::world]); empty if no pairs."""
    import torch
    import torch.distributed as dist

    if not pairs:
        return {}
    mine = pairs[rank::world]
    sums = torch.zeros(4, dtype=torch.float64)  # [loss, accuracy, margin, pairs], summed over pairs
    net.eval()
    with torch.no_grad():
        for i in range(0, len(mine), job.cfg.micro_batch_size):
            mb = mine[i : i + job.cfg.micro_batch_size]
            out_c, out_r, _ = _forward_pairs(net, mb, pad_id)
            loss, acc, margin = _pair_loss(job, out_c, out_r, mb)
            n = len(mb)
            sums += torch.tensor([loss.item() * n, acc * n, margin * n, n], dtype=torch.float64)
    net.train()
    if world > 1:
        dist.all_reduce(sums)
    n = float(sums[3])
    return {"loss": float(sums[0]) / n, "accuracy": float(sums[1]) / n, "margin": float(sums[2]) / n}


def _load(job: PreferenceJob) -> tuple[Any, Any]:
    from posttrain_core.models.loading import check_model_path, load_causal_lm, load_tokenizer
    from posttrain_core.models.lora import LoraSettings, apply_lora
    from posttrain_core.models.reward import build_reward_model

    cfg = job.cfg
    tokenizer = load_tokenizer(job.model_path, require_chat_template=True)
    is_adapter = check_model_path(job.model_path)["is_adapter"]
    if job.objective == "rm":
        model, is_adapter = build_reward_model(job.model_path), False  # an adapter base is merged first
    else:
        model = load_causal_lm(job.model_path, dtype="float32", trainable_adapter=is_adapter)
    if cfg.lora is not None and not is_adapter:
        settings = LoraSettings(cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.target_modules))
        model = _lora_reward_model(model, settings) if job.objective == "rm" else apply_lora(model, settings)
    return model, tokenizer


def _lora_reward_model(model: Any, settings: Any) -> Any:
    """LoRA on a reward model's backbone with its fresh `score` head fully trained.

    `models.lora.apply_lora` builds a CAUSAL_LM peft model, which needs generation methods a ForSequenceClassification
    lacks; SEQ_CLS makes peft keep a trainable copy of the `score` head (merged back by `merge_and_unload`).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="SEQ_CLS",
        modules_to_save=["score"],
    )
    return get_peft_model(model, config)


def preference_loop(job: PreferenceJob, rank: int, world: int) -> dict:
    """Run RM or DPO training on this rank; rank 0 saves the final model into job.outdir and returns the metrics."""
    import torch
    import torch.distributed as dist

    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import enable_gradient_checkpointing, save_checkpoint

    cfg = job.cfg
    torch.manual_seed(cfg.seed)  # also seeds the RM head's initialisation
    model, tokenizer = _load(job)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = read_dataset(job.data_path, "preferences").to_pylist()
    train_idx, eval_idx = split_pairs(len(rows), cfg.eval_pairs, cfg.seed)
    train, dropped = encode_pairs(tokenizer, [rows[i] for i in train_idx], cfg.max_seq_len)
    held_out, _ = encode_pairs(tokenizer, [rows[i] for i in eval_idx], cfg.max_seq_len)
    if not train:
        raise ValueError(f"{job.data_path}: no training pair has response tokens within max_seq_len={cfg.max_seq_len}")

    net = _per_row_module(job.objective, model)
    ddp = data_parallel(net, world)
    params, opt, sched = build_optimizer(model, cfg)
    start_step = resume_from_checkpoint(job, model, opt, sched, rank)
    initial = _evaluate(job, net, held_out, pad_id, rank, world) if job.objective == "rm" and start_step == 0 else {}

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else contextlib.nullcontext()
    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "margin": []}
    tokens_seen, compute_s, t_start = 0, 0.0, time.time()
    for step in range(start_step, cfg.max_steps):
        t0 = time.time()
        mine = global_batch(step, len(train), cfg.global_batch_size, cfg.seed)[rank::world]
        micro = [mine[i : i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
        stats = torch.zeros(4, dtype=torch.float64)  # [loss, accuracy, margin] summed over pairs, tokens
        for j, mb in enumerate(micro):
            batch = [train[i] for i in mb]
            with contextlib.nullcontext() if world == 1 or j == len(micro) - 1 else ddp.no_sync(), autocast:
                out_c, out_r, n_tok = _forward_pairs(ddp, batch, pad_id)
                loss, acc, margin = _pair_loss(job, out_c, out_r, batch)
                # mean over this micro-batch -> sum over the global batch / its size; DDP averages over ranks: x world.
                (loss * (len(batch) * world / cfg.global_batch_size)).backward()
            n = len(batch)
            stats += torch.tensor([loss.item() * n, acc * n, margin * n, n_tok], dtype=torch.float64)
        grad_norm, lr = optimizer_step(params, opt, sched, cfg.max_grad_norm)
        if world > 1:
            dist.all_reduce(stats)
        compute_s += time.time() - t0
        loss, acc, margin = (float(stats[k]) / cfg.global_batch_size for k in range(3))
        for name, value in zip(history, (loss, acc, margin), strict=True):
            history[name].append(value)
        tokens_seen += int(stats[3])
        done = step + 1
        if rank == 0 and (done % cfg.log_every == 0 or done == cfg.max_steps or done == start_step + 1):
            tps = tokens_seen / max(compute_s, 1e-9)
            eta = (time.time() - t_start) / (done - start_step) * (cfg.max_steps - done)
            shown = f" margin {margin:.4f}" if job.objective == "dpo" else ""
            print(
                f"[{job.stage}] step {done}/{cfg.max_steps} loss {loss:.4f} acc {acc:.3f}{shown} lr {lr:.2e} "
                f"grad_norm {grad_norm:.3f} tok/s {tps:,.0f} eta {_fmt_eta(eta)}",
                flush=True,
            )
            if job.tracker is not None:
                job.tracker.log_metrics(
                    {
                        "train/loss": loss,
                        "train/accuracy": acc,
                        "train/margin": margin,
                        "train/lr": lr,
                        "train/grad_norm": grad_norm,
                        "train/tokens_per_s": tps,
                    },
                    step=done,
                )
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
            if rank == 0:
                _save_checkpoint(job, model, opt, sched, done, cfg.keep_checkpoints)
            if world > 1:
                dist.barrier()
            if rank == 0 and job.fail_after_step is not None and done >= job.fail_after_step:
                (Path(job.workdir) / "fault-injected").write_text(str(done))
                print(f"[{job.stage}] fault injection: worker exits after step {done}", flush=True)
                os._exit(1)

    final = _evaluate(job, net, held_out, pad_id, rank, world)
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        if final:
            print(
                f"[{job.stage}] held-out {len(held_out)} pairs: " + " ".join(f"{k} {v:.4f}" for k, v in final.items())
            )
            if job.tracker is not None:
                job.tracker.log_metrics({f"eval/{k}": v for k, v in final.items()}, step=cfg.max_steps)
        # The RM's scalar head lives outside any adapter: an RM is always saved as a full (merged) model.
        merge = cfg.merge_lora or job.objective == "rm"
        info = save_checkpoint(model, tokenizer, job.outdir, merge_lora=merge)
        k = max(1, min(cfg.log_every, len(history["loss"]) // 2 or 1))
        result.update(
            model_info=info,
            history=history,
            probes=_probes(job, model, tokenizer, [rows[i] for i in eval_idx]) if job.objective == "rm" else [],
            resumed_from_step=start_step,
            steps_run=cfg.max_steps - start_step,
            train_pairs=len(train),
            eval_pairs=len(held_out),
            dropped_pairs=dropped,
            first_loss=sum(history["loss"][:k]) / k if history["loss"] else float("nan"),
            final_loss=sum(history["loss"][-k:]) / k if history["loss"] else float("nan"),
            first_margin=sum(history["margin"][:k]) / k if history["margin"] else float("nan"),
            final_margin=sum(history["margin"][-k:]) / k if history["margin"] else float("nan"),
            tokens_per_s=tokens_seen / max(compute_s, 1e-9),
            train_time_s=time.time() - t_start,
            **{f"eval_{k}": v for k, v in final.items()},
            **{f"eval_{k}_init": v for k, v in initial.items()},
        )
    if world > 1:
        dist.barrier()
    return result


def _probes(job: PreferenceJob, model: Any, tokenizer: Any, rows: list[dict]) -> list[dict]:
    """RM scores of a few held-out (prompt, chosen) pairs, as `reward_scores` computes them (reload check)."""
    from posttrain_core.models.reward import reward_scores

    picked = [r for r in rows if len(r["chosen"]) == 1][:N_PROBES]
    prompts, responses = [r["prompt"] for r in picked], [r["chosen"][0]["content"] for r in picked]
    if not picked:
        return []
    scores = reward_scores(model, tokenizer, prompts, responses, max_length=job.cfg.max_seq_len)
    return [
        {"prompt": p, "response": r, "score": s, "max_length": job.cfg.max_seq_len}
        for p, r, s in zip(prompts, responses, scores, strict=True)
    ]


class PreferenceTrainer:
    """The role of one data-parallel rank (`cluster.RankActor`) in reward-model and DPO training."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, world_size

    def train(self, job: PreferenceJob) -> dict:
        return preference_loop(job, self.rank, self.world)


def _reference_shard(
    model_path: str, data_path: str, rows: list[int], max_seq_len: int, batch_size: int, threads: int
) -> list[tuple[float, float]]:
    """Ray task: reference (chosen, rejected) summed response log-probs of `rows`; NaN where a response is cut off."""
    import torch

    from posttrain_core.algorithms.preference import sequence_logprobs
    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_path, require_chat_template=True)
    model = load_causal_lm(model_path, dtype="float32").eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    table = read_dataset(data_path, "preferences").select(["prompt", "chosen", "rejected"]).take(rows).to_pylist()
    seqs = []
    for row in table:
        for side in ("chosen", "rejected"):
            seqs.append(encode_response(tokenizer, row["prompt"], row[side], max_seq_len))
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            ids, labels, mask = collate(seqs[i : i + batch_size], pad_id)
            logp = sequence_logprobs(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
            out.extend(
                v if _scored(y) else math.nan for v, (_, y) in zip(logp.tolist(), seqs[i : i + batch_size], strict=True)
            )
    return [(out[2 * k], out[2 * k + 1]) for k in range(len(table))]


# ----------------------------------------------------------------------------------------------- driver side
def validate_preference_inputs(
    stage: str, cfg: RewardModelConfig | DPOConfig, data: ArtifactRef, models: dict[str, ArtifactRef], store
) -> dict[str, dict]:
    """Fail before any Ray work: wrong dataset kind, a model path that is not a model (or has no chat template),
    max_seq_len beyond a model's context, too many held-out pairs, label smoothing without cDPO."""
    from posttrain_core.models.loading import check_model_path, load_tokenizer

    if data.kind != "dataset" or data.schema_kind != "preferences":
        raise ValueError(f"{stage}: input data must be a 'preferences' dataset, got {data.kind}/{data.schema_kind}")
    infos = {}
    for name, ref in models.items():
        if ref.kind != "model":
            raise ValueError(f"{stage}: input '{name}' must be a model artifact, got a {ref.kind} ({ref.uri})")
        info = infos[name] = check_model_path(ref.uri)
        ctx = info.get("max_position_embeddings")
        if ctx and cfg.max_seq_len > ctx:
            raise ValueError(
                f"{stage}: max_seq_len={cfg.max_seq_len} exceeds the context ({ctx}) of '{name}' at {ref.uri}"
            )
        load_tokenizer(ref.uri, require_chat_template=True)
    sizes = {name: info.get("vocab_size") for name, info in infos.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{stage}: the models' vocabularies differ ({sizes}): the reference must share the tokenizer")
    n_rows = store.manifest(data).get("num_rows") if not data.external else None
    if n_rows is not None and cfg.eval_pairs >= n_rows:
        raise ValueError(
            f"{stage}: eval_pairs={cfg.eval_pairs} leaves no training pair out of {n_rows} rows ({data.uri})"
        )
    if isinstance(cfg, DPOConfig) and cfg.label_smoothing > 0 and cfg.loss_type != "cdpo":
        raise ValueError(
            f"{stage}: label_smoothing={cfg.label_smoothing} only applies to loss_type='cdpo' (got '{cfg.loss_type}')"
        )
    return infos


def _launch(job: PreferenceJob, relay: MetricsRelay) -> dict:
    from posttrain_core.cluster import WorkerGroup

    cfg = job.cfg
    log.info(
        "%s: %d workers, %d steps, global batch %d pairs (micro %d x accum %d)",
        job.stage,
        cfg.num_workers,
        cfg.max_steps,
        cfg.global_batch_size,
        cfg.micro_batch_size,
        cfg.grad_accum_steps,
    )
    group = WorkerGroup.start(PreferenceTrainer, cfg.num_workers)
    try:
        return group.run("train", job, poll=relay.pump)[0]
    finally:
        group.shutdown()


def _job(
    objective: Literal["rm", "dpo"], cfg, data_path: str, model_path: str, ctx: StageContext
) -> tuple[PreferenceJob, MetricsRelay]:
    relay = MetricsRelay.in_folder(ctx.workdir, ctx.tracker)
    fail = os.environ.get(FAULT_ENV)
    injected = (ctx.workdir / "fault-injected").exists()
    return PreferenceJob(
        objective=objective,
        cfg=cfg,
        data_path=data_path,
        model_path=model_path,
        workdir=str(ctx.workdir),
        outdir=str(ctx.outdir),
        tracker=relay.sink,
        fail_after_step=int(fail) if fail and not injected else None,
        stage=objective,
    ), relay


def _output(result: dict, extra: dict) -> StageOutput:
    info, history, probes = result.pop("model_info"), result.pop("history"), result.pop("probes")
    return StageOutput(
        manifest={
            **extra,
            "architecture": info.get("architecture"),
            "dtype": info.get("dtype"),
            "adapter": info.get("adapter", False),
            "resumed_from_step": result["resumed_from_step"],
            "loss_history": [round(x, 6) for x in history["loss"]],
            "accuracy_history": [round(x, 6) for x in history["accuracy"]],
            "margin_history": [round(x, 6) for x in history["margin"]],
            **({"probe_scores": probes} if probes else {}),
        },
        metrics={k: float(v) for k, v in result.items() if isinstance(v, int | float) and k != "rank"},
    )


def run_reward_model(cfg: RewardModelConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """Train a Bradley-Terry reward model on a `preferences` dataset, initialised from the causal LM `base`.

    Returns:
        A model artifact: a `*ForSequenceClassification` folder (num_labels=1, full weights even with LoRA) that
        `models.reward.load_reward_model` opens; its manifest holds the held-out pairwise accuracy.
    """
    infos = validate_preference_inputs("reward_model", cfg, data, {"base": base}, store)

    def build(ctx: StageContext) -> StageOutput:
        job, relay = _job("rm", cfg, str(store.local_path(data)), str(store.local_path(base)), ctx)
        extra = {"objective": "reward_model", "base_model": base.uri, "model_type": infos["base"].get("model_type")}
        return _output(_launch(job, relay), extra)

    return run_stage("reward_model", cfg, {"data": data, "base": base}, store, "model", build)


def run_reference_logprobs(
    data: ArtifactRef, reference_model: ArtifactRef, store: ArtifactStore, cfg: DPOConfig
) -> ArtifactRef:
    """The reference model's summed response log-probs of every preference row, as their own cached artifact.

    The key holds only the data, the model and `max_seq_len` (`ReferenceLogprobsConfig`), so DPO runs that differ in
    beta, loss type, steps or worker count share it. Computed on `cfg.num_workers` Ray tasks.

    Returns:
        A `preferences` dataset: the input rows (same order) plus float64 columns `ref_chosen_logp`,
        `ref_rejected_logp` (NaN where the response lies beyond max_seq_len).
    """
    validate_preference_inputs("reference_logprobs", cfg, data, {"reference": reference_model}, store)
    key_cfg = ReferenceLogprobsConfig(max_seq_len=cfg.max_seq_len)

    def build(ctx: StageContext) -> StageOutput:
        import pyarrow as pa
        import ray

        from posttrain_core.cluster import connect, split
        from posttrain_core.data.io import read_dataset, write_dataset

        data_path, model_path = str(store.local_path(data)), str(store.local_path(reference_model))
        table = read_dataset(data_path, "preferences")
        table = table.drop_columns([c for c in REF_COLUMNS if c in table.column_names])
        shards = split(list(range(table.num_rows)), cfg.num_workers)
        connect()
        threads = max(1, (os.cpu_count() or 1) // len(shards))
        task = ray.remote(num_cpus=1)(_reference_shard)
        refs = [
            task.remote(model_path, data_path, s, cfg.max_seq_len, 2 * cfg.micro_batch_size, threads) for s in shards
        ]
        values = [v for part in ray.get(refs) for v in part]
        for name, col in zip(REF_COLUMNS, zip(*values, strict=True), strict=True):
            table = table.append_column(name, pa.array(col, pa.float64()))
        info = write_dataset(table, "preferences", ctx.outdir)
        finite = [(c, r) for c, r in values if not (math.isnan(c) or math.isnan(r))]
        metrics = {
            "num_rows": float(table.num_rows),
            "truncated_rows": float(table.num_rows - len(finite)),
            "mean_ref_chosen_logp": sum(c for c, _ in finite) / max(1, len(finite)),
            "mean_ref_rejected_logp": sum(r for _, r in finite) / max(1, len(finite)),
        }
        manifest = {
            "num_rows": info["num_rows"],
            "arrow_schema": info["schema"],
            "reference_model": reference_model.uri,
        }
        return StageOutput(manifest=manifest, metrics=metrics)

    inputs = {"data": data, "reference": reference_model}
    return run_stage("reference_logprobs", key_cfg, inputs, store, "dataset", build, schema_kind="preferences")


def run_dpo(
    cfg: DPOConfig,
    data: ArtifactRef,
    policy: ArtifactRef,
    store: ArtifactStore,
    reference: ArtifactRef | None = None,
) -> ArtifactRef:
    """DPO (or IPO / cDPO) of `policy` on a `preferences` dataset against `reference` (default: the policy itself).

    The reference log-probs come from `run_reference_logprobs` (built once, then a cache hit). The stage key is
    (cfg, data, policy, reference): the log-probs are a function of those, so they are recorded in the manifest
    (`reference_logprobs`) and logged as an MLflow input but are not a key input.

    Returns:
        A model artifact: the full policy, or a LoRA adapter folder with `cfg.lora` (merged with `cfg.merge_lora`).
    """
    reference = reference or policy
    infos = validate_preference_inputs("dpo", cfg, data, {"policy": policy, "reference": reference}, store)
    inputs = {"data": data, "policy": policy, "reference": reference}
    # On a cache hit of the DPO stage itself, the reference log-probs are not even looked up.
    ref_lp = (
        run_reference_logprobs(data, reference, store, cfg) if store.get(key_for("dpo", cfg, inputs)) is None else None
    )

    def build(ctx: StageContext) -> StageOutput:
        from posttrain_core import tracking

        assert ref_lp is not None
        tracking.log_inputs(ctx.tracker, {"reference_logprobs": ref_lp})
        job, relay = _job("dpo", cfg, str(store.local_path(ref_lp)), str(store.local_path(policy)), ctx)
        extra = {
            "objective": "dpo",
            "base_model": policy.uri,
            "reference_model": reference.uri,
            "reference_logprobs": ref_lp.model_dump(),
            "model_type": infos["policy"].get("model_type"),
        }
        return _output(_launch(job, relay), extra)

    return run_stage("dpo", cfg, inputs, store, "model", build)

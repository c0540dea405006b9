"""What runs in the ranks of reward-model and DPO training: pair encoding, the per-row module, `preference_loop`,
the `PreferenceTrainer` role and the reference log-prob shard task (their stages are in preference_stage.py)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from posttrain_core.artifacts.node import NodePath, Outbox, at, on_node
from posttrain_core.config import DPOConfig, RewardModelConfig
from posttrain_core.tracking import MetricsMailbox
from posttrain_core.train.loop import IGNORE, build_optimizer, collate, data_parallel, global_batch, optimizer_step
from posttrain_core.train.steps import Progress, periodic_checkpoint, resume_from_checkpoint, ship

REF_COLUMNS = ("ref_chosen_logp", "ref_rejected_logp")
N_PROBES = 8  # held-out pairs whose RM scores are stored in the manifest (to check a reloaded checkpoint)

# (chosen_ids, chosen_labels, rejected_ids, rejected_labels, ref_chosen_logp, ref_rejected_logp)
Pair = tuple[list[int], list[int], list[int], list[int], float, float]


@dataclass(frozen=True)
class PreferenceJob:
    """Everything a worker needs; plain and picklable (it crosses the Ray boundary)."""

    objective: Literal["rm", "dpo"]
    cfg: RewardModelConfig | DPOConfig
    data_path: str | NodePath  # preferences; for DPO with the REF_COLUMNS
    model_path: str | NodePath  # RM: the causal-LM backbone; DPO: the policy
    workdir: str
    outdir: str
    outbox: Outbox | None = None  # a remote store: where the ranks' output and checkpoints go (`artifacts.node`)
    tracker: MetricsMailbox | None = None  # rank 0 posts step metrics; the driver relays them to MLflow
    fail_after_step: int | None = None  # test hook, None in production: see steps.inject_fault
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

    from posttrain_core.models.heads import TokenLogprobs, sequence_logprobs
    from posttrain_core.models.reward import last_token_scores

    class PerRow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model if objective == "rm" else TokenLogprobs(model)

        def forward(self, input_ids, attention_mask, labels):
            if objective == "rm":
                return last_token_scores(self.model, input_ids, attention_mask)
            return sequence_logprobs(self.model, input_ids, attention_mask, labels)

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
    from posttrain_core.models.lora import apply_lora
    from posttrain_core.models.reward import build_reward_model

    cfg = job.cfg
    tokenizer = load_tokenizer(job.model_path, require_chat_template=True)
    is_adapter = check_model_path(job.model_path)["is_adapter"]
    if job.objective == "rm":
        model, is_adapter = build_reward_model(job.model_path), False  # an adapter base is merged first
    else:
        model = load_causal_lm(job.model_path, dtype="float32", trainable_adapter=is_adapter)
    if cfg.lora is not None and not is_adapter:
        model = _lora_reward_model(model, cfg.lora) if job.objective == "rm" else apply_lora(model, cfg.lora)
    return model, tokenizer


def _lora_reward_model(model: Any, lora: Any) -> Any:
    """LoRA on a reward model's backbone with its fresh `score` head fully trained.

    `models.lora.apply_lora` builds a CAUSAL_LM peft model, which needs generation methods a ForSequenceClassification
    lacks; SEQ_CLS makes peft keep a trainable copy of the `score` head (merged back by `merge_and_unload`).
    """
    from peft import get_peft_model

    from posttrain_core.models.lora import peft_config

    return get_peft_model(model, peft_config(lora, task_type="SEQ_CLS", modules_to_save=["score"]))


def preference_loop(job: PreferenceJob, rank: int, world: int) -> dict:
    """Run RM or DPO training on this rank; rank 0 saves the final model into job.outdir and returns the metrics.

    Each row is (prompt, chosen, rejected). The reward model scores prompt + response with a scalar head at the last
    token and minimises -log sigmoid(r_c - r_r - margin). DPO minimises -log sigmoid(beta * Delta) with
    Delta = (logp_c - ref_c) - (logp_r - ref_r), logp summed over the response tokens; the reference log-probs are
    columns of the data (computed once by their own stage, `run_reference_logprobs`). As in `train_loop`, a step's
    loss is the sum over the pairs of the *global* batch divided by its size (independent of the worker count and of
    gradient accumulation), the batch of step s is `global_batch(s, ...)` (resume replays it), and `eval_pairs` rows,
    split off by a seeded permutation, are scored at the end (RM: pairwise accuracy; DPO: reward accuracy and mean
    margin).
    """
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
    progress = Progress(job, start_step, rank)
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
        step_s = time.time() - t0
        loss, acc, margin = (float(stats[k]) / cfg.global_batch_size for k in range(3))
        for name, value in zip(history, (loss, acc, margin), strict=True):
            history[name].append(value)
        progress.count(step_s, int(stats[3]))
        done = step + 1
        metrics = {"loss": loss, "accuracy": acc, "margin": margin, "lr": lr, "grad_norm": grad_norm}
        progress.report(done, step_s, metrics, hide=("margin",) if job.objective == "rm" else ())
        periodic_checkpoint(job, done, model, opt, sched, rank, world)

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
            tokens_per_s=progress.tokens_per_s,
            train_time_s=time.time() - progress.t_start,
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
        job = on_node(job)
        return ship(job, preference_loop(job, self.rank, self.world))


def reference_shard(
    model_path: str | NodePath, data_path: str | NodePath, rows: list[int], max_seq_len: int, batch_size: int,
    threads: int,
) -> list[tuple[float, float]]:
    """Ray task: reference (chosen, rejected) summed response log-probs of `rows`; NaN where a response is cut off."""
    import torch

    model_path, data_path = at(model_path), at(data_path)

    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.heads import TokenLogprobs, sequence_logprobs
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_path, require_chat_template=True)
    model = TokenLogprobs(load_causal_lm(model_path, dtype="float32").eval())
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
            logp = sequence_logprobs(model, ids, mask, labels)
            out.extend(
                v if _scored(y) else math.nan for v, (_, y) in zip(logp.tolist(), seqs[i : i + batch_size], strict=True)
            )
    return [(out[2 * k], out[2 * k + 1]) for k in range(len(table))]

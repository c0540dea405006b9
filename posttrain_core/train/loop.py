"""The data-parallel training loop for SFT and continued pretraining, run by each Ray worker.

What it really is: AdamW on token cross-entropy, where the loss of a step is the sum over every trained token of the
*global* batch divided by the global trained-token count, so the update does not depend on how the batch is split
over workers or micro-batches. Sequences of the global batch for step s are a deterministic function of (seed, s):
that is the whole data position, so resuming from a checkpoint at step s replays exactly the same batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Literal

from posttrain_core.artifacts.node import NodePath, Outbox, on_node
from posttrain_core.config import TrainConfig
from posttrain_core.tracking import MetricsMailbox
from posttrain_core.train.steps import Progress, periodic_checkpoint, resume_from_checkpoint, ship

IGNORE = -100


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; plain and picklable (it crosses the Ray boundary)."""

    objective: Literal["sft", "pretrain"]
    cfg: TrainConfig
    data_path: str | NodePath
    base_path: str | NodePath
    workdir: str
    outdir: str
    outbox: Outbox | None = None  # a remote store: where the ranks' output and checkpoints go (`artifacts.node`)
    tracker: MetricsMailbox | None = None  # rank 0 posts step metrics; the driver relays them to MLflow
    fail_after_step: int | None = None  # test hook, None in production: see steps.inject_fault
    stage: str = "train"


def lr_lambda(cfg: TrainConfig):
    """Multiplier of cfg.lr at a step: linear warm-up, then cosine/linear decay to min_lr_ratio, or constant."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f


def global_batch(step: int, n_examples: int, batch_size: int, seed: int) -> list[int]:
    """Example indices of the global batch of `step`: consecutive slices of per-epoch permutations."""
    import torch

    out, pos = [], step * batch_size
    perms: dict[int, list[int]] = {}
    for p in range(pos, pos + batch_size):
        epoch = p // n_examples
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 100_003 + epoch)
            perms[epoch] = torch.randperm(n_examples, generator=g).tolist()
        out.append(perms[epoch][p % n_examples])
    return out


def build_examples(job: TrainJob, tokenizer, vision=None) -> tuple[list[tuple[list[int], list[int]]], int, list]:
    """Tokenized (input_ids, labels) pairs, the number of rows dropped (nothing left to train on), and each pair's
    images as (pixel_values, grid_thw) or None (`vision`: the model's `VisionSpec`, None for a text model)."""
    from posttrain_core.data.chat import pack_texts, tokenize_chat
    from posttrain_core.data.io import read_dataset

    seq_len = job.cfg.max_seq_len
    if job.objective == "pretrain":
        texts = read_dataset(job.data_path, "text").column("text").to_pylist()
        return [(b, list(b)) for b in pack_texts(tokenizer, texts, seq_len)], 0, []
    table = read_dataset(job.data_path, "sft")
    rows = table.column("messages").to_pylist()
    images = table.column("images").to_pylist() if "images" in table.column_names else [None] * len(rows)
    examples, pixels, dropped = [], [], 0
    for i, (messages, row_images) in enumerate(zip(rows, images, strict=True)):
        where = f"{job.data_path} row {i}"
        if vision is not None:
            ids, labels, px = vision.chat(tokenizer, messages, row_images, seq_len, where)
        elif row_images:
            raise ValueError(f"{where} has images, but the model is text-only: use a vision-language model")
        else:
            (ids, labels), px = tokenize_chat(tokenizer, messages, max_length=seq_len), None
        if sum(1 for x in labels[1:] if x != IGNORE) == 0:
            dropped += 1
            continue
        examples.append((ids, labels))
        pixels.append(px)
    if not examples:
        raise ValueError(f"{job.data_path}: no row has assistant tokens within max_seq_len={seq_len}")
    return examples, dropped, pixels


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad to the longest sequence: input_ids_B_T, labels_B_T (IGNORE on padding), attention_mask_B_T."""
    import torch

    T = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, labels, mask


# What one extra forward/backward pass costs, in padded tokens of work. It keeps `micro_batches` from cutting a step
# into many small passes to save a few padding tokens. On 2 CPU cores a pass costs ~10 ms (~10 tokens) with a core
# to each thread, but far more when other jobs share the cores (every op then waits for its second OpenMP thread);
# 128 keeps ~2/3 of the padding saving with ~2 passes per step of the benchmark's data.
MICRO_BATCH_OVERHEAD_TOKENS = 128


def micro_batches(rows: list[int], lengths: list[int], max_rows: int) -> list[list[int]]:
    """Cut one rank's rows of a step into micro-batches of at most `max_rows` rows that waste the least padding.

    The rows are sorted by length and cut into contiguous groups, each padded to its own longest row; the cut points
    minimise (padded tokens + MICRO_BATCH_OVERHEAD_TOKENS per pass), by dynamic programming over the sorted rows.
    The step's loss is a sum over its tokens divided by the global token count, so how the rows are grouped changes
    only float rounding, never the update; no pass is larger than a plain cut into `max_rows` rows (same memory).

    Args:
        rows: example indices of this rank's share of the step.
        lengths: their sequence lengths (same order).
        max_rows: the micro-batch size.
    """
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_rows), j):  # group = sorted rows i..j-1, padded to row j-1's length
            cost = best[i] + (j - i) * lengths[order[j - 1]] + MICRO_BATCH_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append([rows[k] for k in order[cut[j] : j]])
        j = cut[j]
    return groups[::-1]


def data_parallel(module, world: int):
    """`module` wrapped in DistributedDataParallel when world > 1 (else itself).

    Gradients are views into DDP's all-reduce buckets (`gradient_as_bucket_view`): one copy of them instead of two,
    and no copy between gradients and buckets each step; the same values bit for bit.
    """
    import torch

    if world <= 1:
        return module
    return torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)


def adamw(params: list, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8):
    """The AdamW every posttrain trainer steps (the pipeline's loops and each `posttrain serve` adapter)."""
    import torch

    # The fused kernel (one pass over each tensor) instead of the default multi-tensor one: on CPU the optimizer step
    # of a 10M-parameter model takes 0.5-0.7 s with foreach and 0.03-0.15 s fused; same maths.
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


def build_optimizer(model, cfg: TrainConfig):
    """(trainable params, AdamW, warm-up/decay LambdaLR): the optimizer every posttrain training loop uses."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg.lr, cfg.weight_decay)
    return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))


def optimizer_step(params, opt, sched, max_grad_norm: float) -> tuple[float, float]:
    """Clip (if max_grad_norm > 0), step the optimizer and the scheduler (if any), zero the gradients; return (the
    gradient norm before clipping, the lr used). Parameters without a gradient are left as they are."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    if max_grad_norm > 0 and grads:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        grad_norm = float(torch.norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
    lr = opt.param_groups[0]["lr"]
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm, lr


def train_loop(job: TrainJob, rank: int, world: int) -> dict:
    """Run the loop on this rank; rank 0 saves the final checkpoint into job.outdir and returns the metrics."""
    import torch
    import torch.distributed as dist

    from posttrain_core.models.heads import TokenLogprobs
    from posttrain_core.models.loading import (
        check_model_path,
        enable_gradient_checkpointing,
        load_causal_lm,
        load_tokenizer,
        save_checkpoint,
    )
    from posttrain_core.models.lora import apply_lora
    from posttrain_core.vision.inputs import VisionSpec, batch_inputs, freeze_tower

    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(job.base_path)
    is_adapter = check_model_path(job.base_path)["is_adapter"]
    model = load_causal_lm(job.base_path, dtype="float32", trainable_adapter=is_adapter)
    if cfg.lora is not None and not is_adapter:
        model = apply_lora(model, cfg.lora)
    vision = VisionSpec.of(job.base_path)
    if vision is not None and not cfg.train_vision:
        freeze_tower(model)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    examples, dropped, pixels = build_examples(job, tokenizer, vision)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    net = TokenLogprobs(model)  # the LM head runs on the trained positions only, a chunk at a time
    ddp = data_parallel(net, world)
    params, opt, sched = build_optimizer(model, cfg)
    start_step = resume_from_checkpoint(job, model, opt, sched, rank)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else contextlib.nullcontext()
    history: list[float] = []
    step_seconds: list[float] = []  # compute time of every step run here (the benchmarks read it)
    progress = Progress(job, start_step, rank)
    for step in range(start_step, cfg.max_steps):
        t0 = time.time()
        mine = global_batch(step, len(examples), cfg.global_batch_size, cfg.seed)[rank::world]
        micro = micro_batches(mine, [len(examples[i][0]) for i in mine], cfg.micro_batch_size)
        local = torch.tensor(
            [float(sum(1 for y in examples[i][1][1:] if y != IGNORE)) for i in mine], dtype=torch.float64
        ).sum()
        n_tok = local.clone()
        if world > 1:
            dist.all_reduce(n_tok)
        stats = torch.zeros(2, dtype=torch.float64)  # [loss sum, input tokens]
        for j, mb in enumerate(micro):
            sync = world == 1 or j == len(micro) - 1
            ids, labels, mask = collate([examples[i] for i in mb], pad_id)
            keep = torch.zeros_like(labels, dtype=torch.bool)  # position t predicts token t + 1
            keep[:, :-1] = labels[:, 1:] != IGNORE
            images = None
            if vision is not None:
                images = batch_inputs(model, vision, ids, mask, [pixels[i] for i in mb], f"{job.stage} step {step}")
            with contextlib.nullcontext() if sync else ddp.no_sync(), autocast:
                logp = ddp(ids, mask, keep, labels[:, 1:][keep[:, :-1]], vision=images).logp
                ce = -logp.sum()
                # DDP averages gradients over ranks, so scale by world to get sum / global token count.
                (ce * world / n_tok.item()).backward()
            stats += torch.tensor([ce.item(), float(mask.sum())], dtype=torch.float64)
        grad_norm, lr = optimizer_step(params, opt, sched, cfg.max_grad_norm)
        if world > 1:
            dist.all_reduce(stats)
        step_seconds.append(time.time() - t0)
        loss = float(stats[0] / n_tok)
        history.append(loss)
        progress.count(step_seconds[-1], int(stats[1]))
        done = step + 1
        progress.report(done, step_seconds[-1], {"loss": loss, "lr": lr, "grad_norm": grad_norm})
        periodic_checkpoint(job, done, model, opt, sched, rank, world)

    result = {"rank": rank}
    if rank == 0:
        info = save_checkpoint(model, tokenizer, job.outdir, merge_lora=cfg.merge_lora)
        k = max(1, min(cfg.log_every, len(history) // 2 or 1))
        result.update(
            model_info=info,
            loss_history=history,
            resumed_from_step=start_step,
            steps_run=cfg.max_steps - start_step,
            train_examples=len(examples),
            dropped_examples=dropped,
            first_loss=sum(history[:k]) / k if history else float("nan"),
            final_loss=sum(history[-k:]) / k if history else float("nan"),
            tokens_per_s=progress.tokens_per_s,
            train_time_s=time.time() - progress.t_start,
            step_seconds=step_seconds,
            peak_rss_mb=peak_rss_mb(),
        )
    if world > 1:
        dist.barrier()
    return result


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trainer:
    """The role of one data-parallel rank (`cluster.RankActor`) in SFT and continued pretraining."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, world_size

    def train(self, job: TrainJob) -> dict:
        job = on_node(job)
        return ship(job, train_loop(job, self.rank, self.world))

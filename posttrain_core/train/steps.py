"""The bookkeeping the SFT/pretraining and preference loops share: progress line, step metrics, in-stage checkpoints,
the fault-injection hook on the ranks, and `launch`, which runs a loop's job on a Ray worker group from a stage."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain_core.stage import StageContext

log = logging.getLogger(__name__)

# A job (`TrainJob`, `PreferenceJob`) is a frozen dataclass with at least: cfg (a TrainConfig-like config), workdir,
# outdir, outbox (`artifacts.node.Outbox` for a remote store, else None), tracker (a MetricsMailbox or None),
# fail_after_step (None outside tests) and stage (the progress lines' prefix). Its input paths may be `NodePath`s:
# a rank calls `artifacts.node.on_node(job)` first, and `ship(job, result)` last.

# How a metric shows in the progress line, in the order the loop passes them; one not listed is logged, not shown.
_SHOWN = {
    "loss": "loss {:.4f}",
    "accuracy": "acc {:.3f}",
    "margin": "margin {:.4f}",
    "lr": "lr {:.2e}",
    "grad_norm": "grad_norm {:.3f}",
}


def fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


class Progress:
    """A rank's throughput counters and, on rank 0, the progress line and MLflow step metrics of its loop.

    A line is printed (and the metrics appended to `job.tracker`) after the first step run here, every
    `cfg.log_every` steps and after the last one. Throughput counts compute time only, not logging or checkpoint I/O.
    """

    def __init__(self, job: Any, start_step: int, rank: int):
        self.job, self.start_step, self.rank = job, start_step, rank
        self.tokens, self.compute_s, self.t_start = 0, 0.0, time.time()

    def count(self, seconds: float, tokens: int) -> None:
        """Add one step's compute time and tokens."""
        self.compute_s += seconds
        self.tokens += tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.compute_s, 1e-9)

    def report(self, done: int, step_s: float, metrics: dict[str, float], hide: tuple[str, ...] = ()) -> None:
        """The progress line and step metrics after step `done` (a no-op unless due on rank 0).

        Args:
            done: steps completed.
            step_s: compute time of that step.
            metrics: logged as `train/<name>` (plus `train/tokens_per_s`); those in `_SHOWN` and not in `hide`
                are printed too, in this order.
        """
        cfg = self.job.cfg
        if self.rank != 0 or not (done % cfg.log_every == 0 or done == cfg.max_steps or done == self.start_step + 1):
            return
        tps = self.tokens_per_s
        eta = (time.time() - self.t_start) / (done - self.start_step) * (cfg.max_steps - done)
        shown = " ".join(_SHOWN[k].format(v) for k, v in metrics.items() if k in _SHOWN and k not in hide)
        print(
            f"[{self.job.stage}] step {done}/{cfg.max_steps} {shown} tok/s {tps:,.0f} step_s {step_s:.3f} "
            f"eta {fmt_eta(eta)}",
            flush=True,
        )
        if self.job.tracker is not None:
            self.job.tracker.log_metrics(
                {**{f"train/{k}": v for k, v in metrics.items()}, "train/tokens_per_s": tps}, step=done
            )


# ------------------------------------------------------------------------------------------ in-stage checkpoints
def checkpoints(workdir: str | os.PathLike) -> list[Path]:
    """The in-stage checkpoints of a stage's working folder, oldest first."""
    return sorted((Path(workdir) / "checkpoints").glob("step_*.pt"))


def save_train_state(job: Any, model, opt, sched, step: int) -> None:
    """Trainable weights + optimizer + scheduler + RNG + step, written atomically (tmp file, then rename); only the
    newest `cfg.keep_checkpoints` are kept."""
    import torch

    folder = Path(job.workdir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "model": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }
    tmp = folder / f".step_{step:07d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"step_{step:07d}.pt")
    for old in checkpoints(job.workdir)[: -job.cfg.keep_checkpoints]:
        old.unlink(missing_ok=True)
    if job.outbox is not None:  # a remote store: the checkpoint must outlive this node
        job.outbox.keep(folder / f"step_{step:07d}.pt", job.cfg.keep_checkpoints)


def ship(job: Any, result: dict) -> dict:
    """Rank 0's result, with the output folder uploaded to the store when the job has an outbox (`uploaded`: what
    the stage publishes instead of its local output folder)."""
    if job.outbox is not None and "model_info" in result:
        result["uploaded"] = job.outbox.ship(job.outdir)
    return result


def resume_from_checkpoint(job: Any, model, opt, sched, rank: int) -> int:
    """Load the newest in-stage checkpoint of `job.workdir` (weights, optimizer, scheduler, RNG); return its step."""
    import torch

    ckpts = checkpoints(job.workdir)
    if not ckpts:
        return 0
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"], strict=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if rank == 0:
        print(f"[{job.stage}] resuming from in-stage checkpoint {ckpts[-1].name} (step {state['step']})", flush=True)
    return state["step"]


def periodic_checkpoint(job: Any, done: int, model, opt, sched, rank: int, world: int) -> None:
    """After step `done`, every `cfg.checkpoint_every` steps but the last: rank 0 saves the training state, all ranks
    meet at a barrier (none runs ahead of a checkpoint it could not resume from), then the fault hook runs."""
    cfg = job.cfg
    if not (cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps):
        return
    if rank == 0:
        save_train_state(job, model, opt, sched, done)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    if rank == 0:
        inject_fault(job, done)


def inject_fault(job: Any, done: int) -> None:
    """Test hook: with `job.fail_after_step` set, rank 0's process exits (a lost worker) after the first checkpoint at
    or past that step, once per working folder: the `fault-injected` marker lets the retried attempt run through."""
    if job.fail_after_step is None or done < job.fail_after_step:
        return
    marker = Path(job.workdir) / "fault-injected"
    if marker.exists():
        return
    marker.write_text(str(done))
    print(f"[{job.stage}] fault injection: worker exits after step {done}", flush=True)
    os._exit(1)


# ---------------------------------------------------------------------------------------------------- driver side
def launch(role: type, job_type: type, ctx: StageContext, batch_unit: str = "sequences", **fields: Any) -> dict:
    """Run a training loop from a stage: build its job, start `cfg.num_workers` ranks hosting `role`, call
    `role.train(job)` on each while relaying rank 0's step metrics to the stage's MLflow run; return rank 0's result.

    Args:
        role: the rank's role class (`Trainer`, `PreferenceTrainer`).
        job_type: its job dataclass; `fields` are its fields but workdir, outdir, outbox and tracker, which come
            from `ctx`.
        batch_unit: what a global batch counts, for the log line.
    """
    from posttrain_core.artifacts.node import outbox_of
    from posttrain_core.tracking import MetricsRelay
    from posttrain_core.warm import WarmGroup

    relay = MetricsRelay(ctx.tracker)
    job = job_type(
        **fields, workdir=str(ctx.workdir), outdir=str(ctx.outdir), outbox=outbox_of(ctx.store, ctx.key),
        tracker=relay.sink,
    )  # fmt: skip
    cfg = job.cfg
    log.info(
        "%s: %d workers, %d steps, global batch %d %s (micro %d x accum %d)",
        job.stage,
        cfg.num_workers,
        cfg.max_steps,
        cfg.global_batch_size,
        batch_unit,
        cfg.micro_batch_size,
        cfg.grad_accum_steps,
    )
    with WarmGroup.process().ranks(role, cfg.num_workers) as group:
        relay.source = group.metrics_source()
        result = group.run("train", job, poll=relay.pump)[0]
        group.drop()  # the ranks stay warm for the next stage, without this one's model and optimizer
    return result

"""Run reports: the RL reward/accuracy curve as a PNG and a markdown table, written next to the artifacts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

CURVE_COLUMNS = ("iteration", "reward_mean", "accuracy", "kl_k1", "entropy", "clip_frac", "logp_mismatch_mean")


# multi-turn rollouts: the rollout stage's tool metrics, next to the update's
TOOL_COLUMNS = ("turns_mean", "tool_calls_per_sample", "tool_error_rate", "tool_latency_p50_ms", "tool_latency_p95_ms",
                "tool_precision", "tool_recall")  # fmt: skip


# learning from a teacher (rl.distill): the update's distillation metrics
DISTILL_COLUMNS = ("teacher_kl", "distill_loss", "teacher_mass", "student_mass", "topk_overlap")


# PRIME: the implicit PRM's ranking accuracy before and after its update, its loss, and the batch the band kept
PRIME_COLUMNS = ("prm_acc_before", "prm_acc_after", "prm_ce_loss", "process_reward_abs_mean", "band_kept",
                 "band_passing")  # fmt: skip


# an off-policy lag: the rows' staleness and importance weights, and who waited for whom
LAG_COLUMNS = ("staleness_max", "is_weight_mean", "is_ess", "is_clip_frac", "update_wait_s", "rollout_wait_s")


def curve_row(iteration: int, metrics: dict[str, float], rollout: dict[str, float] | None = None) -> dict[str, Any]:
    """One iteration's row of the curve table (missing metrics are None); with a multi-turn rollout's metrics, its
    tool columns and tool-call rate per family too; with a teacher, the distillation columns; with PRIME, the
    PRM's; with an off-policy lag, its own."""
    row = {"iteration": iteration, **{k: metrics.get(k) for k in CURVE_COLUMNS[1:]}}
    if "teacher_kl" in metrics:
        row |= {k: metrics.get(k) for k in DISTILL_COLUMNS}
    if "process_reward_mean" in metrics:
        row |= {k: metrics.get(k) for k in PRIME_COLUMNS}
    if "staleness_max" in metrics:
        row |= {k: metrics.get(k) for k in LAG_COLUMNS}
    if rollout is not None:
        row |= {k: rollout.get(k) for k in TOOL_COLUMNS}
        row |= {k: v for k, v in sorted(rollout.items()) if k.startswith("tool_call_rate/")}
    return row


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = CURVE_COLUMNS) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_curve(rows: list[dict[str, Any]], evals: dict[int, float], path: str | Path, title: str) -> Path:
    """Sample reward and accuracy per iteration, and held-out accuracy where it was evaluated, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe inside Prefect worker processes
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    xs = [r["iteration"] for r in rows]
    ax.plot(xs, [r["reward_mean"] for r in rows], marker="o", label="sample reward (mean)")
    if all(r.get("accuracy") is not None for r in rows):
        ax.plot(xs, [r["accuracy"] for r in rows], marker=".", label="sample accuracy")
    if evals:
        ax.plot(list(evals), list(evals.values()), marker="s", linestyle="--", label="held-out accuracy (greedy)")
    ax.set_xlabel("iteration")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def iteration_timing(store, iteration: int, started: float, rollouts: list, scored: list, update) -> dict[str, float]:
    """Where one RL iteration's wall time (from `started`, a time.time()) went, from its stages' manifests.

    generate / score / train are the work (engine generation on the critical path, scoring, old-log-prob pass +
    advantages + optimizer steps); startup is stage-internal start-up (engine actors, worker process group, model loading); orchestration
    is the rest: Prefect task runs, cache lookups, artifact writing and reading. A stage that was a cache hit (built
    before `started`: a resumed run, or another run's identical stage) counts as orchestration.
    """
    from datetime import datetime

    def fresh(ref) -> dict | None:
        m = store.manifest(ref)
        return m if datetime.fromisoformat(m["created"]).timestamp() >= started else None

    wall = time.time() - started
    roll = [m for m in map(fresh, rollouts) if m]
    sco = [m for m in map(fresh, scored) if m]
    upd = fresh(update)
    # engine time, less what a prefetched rollout generated before its stage started (overlapping the previous
    # update's publish; `rollout.stage.prefetch_rollout`)
    generate = sum(
        r["metrics"]["tokens"] / max(r["metrics"]["tokens_per_s"], 1e-9) - r["metrics"].get("generate_overlap_s", 0.0)
        for r in roll
    )
    train = (upd["metrics"].get("prepare_s", 0.0) + upd["metrics"].get("train_s", 0.0)) if upd else 0.0
    startup = sum(r["duration_s"] for r in roll) - generate + ((upd["duration_s"] - train) if upd else 0.0)
    row = {
        "iteration": iteration,
        "wall_s": wall,
        "generate_s": generate,
        "score_s": sum(m["duration_s"] for m in sco),
        "train_s": train,
        "startup_s": max(startup, 0.0),
    }
    row["orchestration_s"] = max(wall - sum(row[k] for k in ("generate_s", "score_s", "train_s", "startup_s")), 0.0)
    return row

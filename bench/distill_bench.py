"""On-policy distillation against GRPO on the real model (docs/distillation.md, "Measured").

The teacher is `make demo-real`'s policy (trained first if the store has none). From the same student start (base
SmolLM2-135M-Instruct, fresh LoRA adapter), on the same prompts and sampling budget, opd and grpo each run
`--iterations` iterations for every seed; every iteration's policy is then evaluated on the held-out prompts sampled
as the flow's final evaluation is (pass@1 at the rollout temperature), so the curves are per iteration.
    python -m bench.distill_bench --seeds 0 1 --iterations 6 --json bench/results/distill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from prefect import flow


@flow(name="distill-bench-eval")
def sampled_curve(config, policies) -> list[float]:
    """Held-out sampled pass@1 of each policy (cached evaluate stages: the flow's own final one is reused)."""
    from flows.rlhf import sampled_eval_config
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.warm import WarmGroup
    from tasks.data import prepare_data
    from tasks.evaluate import evaluate

    store = ArtifactStore(config.store)
    root = str(store.root)
    data = prepare_data(config.data, root, None)  # a cache hit: the run's own data
    out = []
    with WarmGroup.owned("distill-bench") as warm:
        for k, policy in enumerate(policies):
            ref = evaluate(sampled_eval_config(config), data.eval, policy, f"iter={k}, sampled", root, None, warm)
            out.append(store.manifest(ref)["metrics"]["pass@1"])
    return out


def main() -> None:
    from flows.distill import distill_config, teacher_policy
    from flows.rlhf import rlhf_flow

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--algorithms", nargs="+", default=["opd", "grpo"])
    p.add_argument("--json", default=None)
    args = p.parse_args()

    started = time.time()
    teacher = teacher_policy()
    teacher_s = time.time() - started
    runs = []
    for seed in args.seeds:
        for algorithm in args.algorithms:
            cfg = distill_config(teacher.key, algorithm, seed, args.iterations)
            t0 = time.time()
            result = rlhf_flow(cfg)
            wall = time.time() - t0
            curve = sampled_curve(cfg, result["policies"])
            runs.append(dict(algorithm=algorithm, seed=seed, sampled=curve, wall_s=wall,
                             iteration_s=[t["wall_s"] for t in result["timings"]] if result["timings"] else [],
                             train_accuracy=[r["accuracy"] for r in result["curve"]],
                             teacher_kl=[r.get("teacher_kl") for r in result["curve"]]))  # fmt: skip
            print(json.dumps(runs[-1]), flush=True)
    teacher_curve = sampled_curve(distill_config(teacher.key), [teacher])[0]
    summary = dict(teacher=teacher.uri, teacher_sampled=teacher_curve, teacher_s=teacher_s, runs=runs)
    print(report(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))


def report(summary: dict) -> str:
    """Per algorithm: held-out sampled accuracy per iteration (min-max over seeds), and the first iteration that
    reached 90% of the teacher's."""
    goal = 0.9 * summary["teacher_sampled"]
    lines = [f"teacher held-out sampled accuracy {summary['teacher_sampled']:.3f}; 90% of it: {goal:.3f}", ""]
    by: dict[str, list[dict]] = {}
    for r in summary["runs"]:
        by.setdefault(r["algorithm"], []).append(r)
    n = max(len(r["sampled"]) for r in summary["runs"])
    lines.append("| algorithm | " + " | ".join(f"iter {k}" for k in range(n)) + " | first iter >= 90% | s/iter |")
    lines.append("|---|" + "---|" * (n + 2))
    for algorithm, rs in by.items():
        cells = []
        for k in range(n):
            xs = [r["sampled"][k] for r in rs if k < len(r["sampled"])]
            cells.append(f"{min(xs):.3f}-{max(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}")
        first = [next((k for k, x in enumerate(r["sampled"]) if x >= goal), None) for r in rs]
        per_iter = [statistics.median(r["iteration_s"]) for r in rs if r["iteration_s"]]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + f" | {first} | "
                     + (f"{min(per_iter):.0f}-{max(per_iter):.0f}" if per_iter else "") + " |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()

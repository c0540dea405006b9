"""The RLHF pipeline: data -> base -> (pretraining) -> SFT -> (reward model) -> N x [rollout -> score -> update] -> eval.

Every iteration's rollout, score and update is its own cached stage, so a run killed at iteration k resumes at k.
Run it with embedded defaults (GRPO on the synthetic arithmetic prompts, tiny model, ephemeral Prefect, local Ray):
    python -m flows.rlhf
or from Python, e.g. PPO from an existing checkpoint:
    from flows.rlhf import rlhf_flow
    rlhf_flow(RLHFFlowConfig(model={"path": "/models/sft"}, pretrain=None, sft=None, rl={"algorithm": "ppo"}))
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import tracked
from posttrain_core import reports, tracking
from posttrain_core.artifacts import ArtifactStore
from posttrain_core.config import RLHFFlowConfig
from posttrain_core.rollout.warm import new_pool_name, release_pool
from posttrain_core.train.rl_stage import (
    NextRollout,
    check_dynamic_sampling,
    informative_groups,
    iteration_rollout,
    score_config_for,
)
from tasks.data import prepare_data
from tasks.evaluate import evaluate
from tasks.models import build_model
from tasks.preference import reward_model
from tasks.rl import rl_update, value_pretrain
from tasks.rollout import rollout, score
from tasks.train import pretrain, sft


@flow(name="rlhf", log_prints=True)
def rlhf_flow(config: RLHFFlowConfig = RLHFFlowConfig()) -> dict[str, Any]:  # noqa: B008 (pydantic default = UI form)
    engines = new_pool_name("rlhf") if config.warm_engines else None
    try:
        return _rlhf(config, engines)
    finally:
        if engines:
            release_pool(engines)


def _rlhf(config: RLHFFlowConfig, engines: str | None) -> dict[str, Any]:
    store = ArtifactStore(config.store)
    store.check_writable()  # a store that cannot take artifacts fails here, before any work
    root = str(store.root)
    rl = config.rl.resolved()
    score_cfg = score_config_for(rl, config.score, config.rollout)
    gen_batches = rl.max_gen_batches if rl.dynamic_sampling else 1
    with tracked("rlhf", config, root, {"posttrain.algorithm": rl.algorithm}) as run:
        pid = run.run_id

        data = prepare_data(config.data, root, pid)
        start = build_model(config.model, data.text, root, pid)
        if config.pretrain:
            start = pretrain(config.pretrain, data.text, start, root, pid)
        if config.sft:
            start = sft(config.sft, data.sft, start, root, pid)
        rm = reward_model(config.reward_model, data.preferences, start, root, pid) if config.reward_model else None
        evals = {0: evaluate(config.eval, data.eval, start, "iter0", root, pid)}
        sampled = (
            {0: _sampled_accuracy(config, store, data.eval, start, 0, pid, engines)} if config.eval_samples else {}
        )

        policy, critic = start, None
        if rl.uses_critic and rl.value_pretrain_steps:
            samples = rollout(iteration_rollout(config.rollout, 0), data.prompts, start, 0, root, pid, engines)
            critic = value_pretrain(config.rl, score(score_cfg, samples, rm, 0, root, pid), start, root, pid)
        curve, timings = [], []
        for k in range(1, config.iterations + 1):
            started = time.time()
            samples, scored, counts = [], [], []
            for j in range(gen_batches):
                cfg_kj = iteration_rollout(config.rollout, k, j, gen_batches)
                samples.append(rollout(cfg_kj, data.prompts, policy, k, root, pid, engines))
                scored.append(score(score_cfg, samples[-1], rm, k, root, pid))
                if rl.dynamic_sampling:
                    counts.append(informative_groups(store, scored[-1]))
                    if check_dynamic_sampling(counts, config.rollout.max_prompts, rl.max_gen_batches):
                        break
            nxt = None
            if engines and config.overlap_rollout and k < config.iterations:
                nxt = NextRollout(
                    engines=engines,
                    rollout=iteration_rollout(config.rollout, k + 1, 0, gen_batches),
                    prompts=data.prompts,
                )
            policy = rl_update(config.rl, scored, policy, start, critic, k, root, pid, next_rollout=nxt)
            critic = policy if rl.uses_critic else None
            metrics = store.manifest(policy)["metrics"]
            run.log_metrics({f"rl/{name}": value for name, value in metrics.items()}, step=k)
            curve.append(reports.curve_row(k, metrics))
            timings.append(reports.iteration_timing(store, k, started, samples, scored, policy))
            if config.eval_every and k % config.eval_every == 0 and k < config.iterations:
                evals[k] = evaluate(config.eval, data.eval, policy, f"iter{k}", root, pid)
        evals[config.iterations] = evaluate(config.eval, data.eval, policy, f"iter{config.iterations}", root, pid)
        if config.eval_samples:
            sampled[config.iterations] = _sampled_accuracy(
                config, store, data.eval, policy, config.iterations, pid, engines
            )

        accuracy = {k: store.manifest(ref)["metrics"]["accuracy"] for k, ref in evals.items()}
        family = {k: store.manifest(ref)["metrics"] for k, ref in evals.items()}
        run.log_metrics({"eval/accuracy_before": accuracy[0], "eval/accuracy_after": accuracy[config.iterations]})
        if sampled:
            run.log_metrics(
                {
                    f"eval/sampled_{k.replace('@', '_at_').replace('/', '_')}_{when}": sampled[i][k]
                    for i, when in ((0, "before"), (config.iterations, "after"))
                    for k in sampled[i]
                    if k.startswith("pass@")
                }
            )
        png = reports.plot_curve(
            curve, accuracy, Path(root) / "reports" / f"rlhf-{pid}.png", f"{rl.algorithm}: reward per iteration"
        )
        run.log_artifact(png)

    summary = _summary(rl.algorithm, store, policy, curve, accuracy, family, sampled, png, pid)
    create_table_artifact(curve, key="rlhf-curve", description="RL reward/accuracy per iteration")
    create_markdown_artifact(summary, key="rlhf-summary", description="RLHF pipeline result")
    get_run_logger().info("\n%s", summary)
    return {
        "policy": policy,
        "start": start,
        "curve": curve,
        "timings": timings,
        "accuracy": accuracy,
        "sampled_accuracy": sampled,
        "eval": evals,
        "curve_png": str(png),
        "mlflow_run_id": pid,
        "store": root,
    }


def _sampled_accuracy(config: RLHFFlowConfig, store, prompts, policy, iteration: int, pid: str, engines) -> dict:
    """pass@1 and pass@n of `policy` on the held-out prompts, sampled like the rollouts (the quantity RL raises)."""
    from posttrain_core.config import ScoreConfig
    from posttrain_core.data.io import read_dataset
    from posttrain_core.rewards.passk import pass_at_k_by_family

    n = config.eval_samples
    cfg = config.rollout.model_copy(
        update={"n": n, "max_prompts": config.eval.max_prompts, "prompt_start": 0, "families": [], "seed": 7_777}
    )
    root = str(store.root)
    samples = rollout(cfg, prompts, policy, f"eval{iteration}", root, pid, engines)
    scored = score(ScoreConfig(verifiers={config.eval.verifier: 1.0}), samples, None, f"eval{iteration}", root, pid)
    return pass_at_k_by_family(
        read_dataset(store.local_path(scored), "scored_rollouts"),
        read_dataset(store.local_path(prompts), "prompts"),
        dict.fromkeys((1, n)),
    )


def _summary(algorithm, store, policy, curve, accuracy, family, sampled, png, run_id) -> str:
    last = max(accuracy)
    fams = sorted(k for k in family[0] if k.startswith("accuracy/"))
    by_family = ", ".join(
        f"{k.split('/')[1]} {family[0][k]:.3f} -> {family[last].get(k, float('nan')):.3f}" for k in fams
    )
    lines = []
    if sampled:
        per_family = ", ".join(
            f"{k.split('/')[1]} {sampled[0][k]:.3f} -> {sampled[last].get(k, float('nan')):.3f}"
            for k in sorted(sampled[0])
            if k.startswith("pass@1/")
        )
        lines = [
            f"- held-out sampled accuracy (pass@1, samples at the rollout temperature): start "
            f"**{sampled[0]['pass@1']:.3f}** -> after RL **{sampled[last]['pass@1']:.3f}**"
            + (f" ({per_family})" if per_family else "")
        ]
    return "\n".join(
        [
            f"## posttrain RLHF result ({algorithm}, {len(curve)} iterations)",
            f"- held-out greedy accuracy: start **{accuracy[0]:.3f}** -> after RL **{accuracy[last]:.3f}** ({by_family})",
            *lines,
            f"- final policy: `{policy.uri}`",
            f"- reward curve: `{png}`",
            "",
            reports.markdown_table(curve),
            "",
            f"- MLflow run: `{run_id}` (browse: `mlflow ui --backend-store-uri {tracking.tracking_uri(store.root)}`)",
        ]
    )


if __name__ == "__main__":
    result = rlhf_flow()
    acc, sampled = result["accuracy"], result["sampled_accuracy"]
    if sampled:
        print(f"\nheld-out sampled accuracy (pass@1): start {sampled[0]['pass@1']:.3f} -> after RL "
              f"{sampled[max(sampled)]['pass@1']:.3f}")  # fmt: skip
    print(
        f"held-out greedy accuracy: start {acc[0]:.3f} -> after RL {acc[max(acc)]:.3f}\nfinal policy: {result['policy'].uri}"
        f"\nreward curve: {result['curve_png']}\nMLflow parent run: {result['mlflow_run_id']} "
        f"({tracking.tracking_uri(result['store'])})"
    )

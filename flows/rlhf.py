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
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import tracked
from posttrain_core import reports, tracking
from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import EvalConfig, ModelConfig, RLHFFlowConfig
from posttrain_core.train.rl_plan import check_dynamic_sampling, informative_groups, iteration_rollout, score_config_for
from posttrain_core.train.rl_stage import NextRollout
from posttrain_core.warm import WarmGroup
from tasks.data import prepare_data
from tasks.evaluate import evaluate
from tasks.models import build_model
from tasks.preference import reward_model
from tasks.rl import prm_update, process_rewards, rl_update, value_pretrain
from tasks.rollout import rollout, score, teacher_logprobs
from tasks.train import pretrain, sft

SAMPLED_EVAL_SEED = 7_777  # the held-out samples' own seed: the same prompts and streams before and after RL
TOOL_USE = ("tool_precision", "tool_recall", "tool_call_rate")  # held-out metrics of evaluations with tools


@flow(name="rlhf", log_prints=True)
def rlhf_flow(config: RLHFFlowConfig = RLHFFlowConfig()) -> dict[str, Any]:  # noqa: B008 (pydantic default = UI form)
    store = ArtifactStore(config.store)
    store.check_writable()  # a store that cannot take artifacts fails here, before any work
    root = str(store.root)
    rl = config.rl.resolved()
    score_cfg = score_config_for(rl, config.score, config.rollout)
    # Engines and training ranks stay warm from one stage (and flow run) of this process to the next (`warm`).
    with tracked("rlhf", config, root, {"posttrain.algorithm": rl.algorithm}) as run:
        pid, w = run.run_id, WarmGroup.process()

        data = prepare_data(config.data, root, pid)
        start = build_model(config.model, data.text, root, pid)
        teacher = _teacher(config, store, start, data.text, pid) if rl.distill is not None else None
        if config.pretrain:
            start = pretrain(config.pretrain, data.text, start, root, pid)
        if config.sft:
            start = sft(config.sft, data.sft, start, root, pid)
        rm = reward_model(config.reward_model, data.preferences, start, root, pid) if config.reward_model else None
        evals = {0: _evaluate(config, data.eval, start, 0, root, pid, w)}

        policy, critic, policies, prm = start, None, [start], start  # PRIME's PRM starts as the start policy
        if rl.uses_critic and rl.value_pretrain_steps:
            samples = rollout(iteration_rollout(config.rollout, 0), data.prompts, start, 0, root, pid, w)
            critic = value_pretrain(config.rl, score(score_cfg, samples, rm, 0, root, pid), start, root, pid, w)
        curve, timings, lag, ahead, rows_ready = [], [], rl.rollout_lag, {}, time.time()
        if lag and rl.off_policy == "none":
            get_run_logger().warning(
                "rl.rollout_lag=%d with rl.off_policy='none': rows sampled by a policy %d update(s) old are trained "
                "on as if the current one had sampled them; tis or decoupled corrects for it (docs/algorithms.md)",
                lag, lag,
            )  # fmt: skip
        for k in range(1, config.iterations + 1):
            started = time.time()
            if k in ahead:  # submitted during iteration k - 1, while its update ran
                sampler, (r, s) = ahead.pop(k)
                samples, scored, rollout_wait = [r.result()], [s.result()], 0.0
            else:
                rollout_wait = started - rows_ready
                sampler = policies[max(k - 1 - lag, 0)]
                if rl.distill is not None and not rl.distill.student_samples(k, rl.seed):
                    sampler = teacher
                samples, scored = _sample_and_score(config, store, data.prompts, sampler, rm, k, pid, w)
            rows_ready = time.time()
            if lag and k < config.iterations:  # rollout k + 1 samples with policy k - lag, beside update k
                behind = policies[max(k - lag, 0)]
                ahead[k + 1] = (behind, _submit_next(config, store, data.prompts, behind, rm, k + 1, pid, w))
            scores = [teacher_logprobs(rl.distill, s, teacher, k, root, pid, w) for s in samples] if teacher else None
            nxt = None
            if k < config.iterations and not lag and (rl.distill is None or rl.distill.student_samples(k + 1, rl.seed)):
                nxt = NextRollout(rollout=_next_window(config, k), prompts=data.prompts)
            by = sampler if sampler is not policy else None
            process, prm_metrics = None, {}
            if rl.prime is not None:
                prm, process, prm_metrics = _prime(config, store, scored, policy, prm, start, k, pid, w)
            policy = rl_update(config.rl, scored, policy, start, critic, k, root, pid, w, nxt, scores, by, process)
            critic = policy if rl.uses_critic else None
            policies.append(policy)
            metrics = store.manifest(policy)["metrics"] | prm_metrics
            run.log_metrics({f"rl/{name}": value for name, value in metrics.items()}, step=k)
            sampled_metrics = store.manifest(samples[-1])["metrics"] if config.rollout.tools else None
            if sampled_metrics:
                run.log_metrics({f"rollout/{n}": v for n, v in sampled_metrics.items()}, step=k)
            waits = {"update_wait_s": rows_ready - started, "rollout_wait_s": rollout_wait}
            run.log_metrics({f"rl/{name}": value for name, value in waits.items()}, step=k)
            curve.append(reports.curve_row(k, metrics | waits, sampled_metrics))
            timings.append(reports.iteration_timing(store, k, started, samples, scored, policy) | waits)
            if config.eval_every and k % config.eval_every == 0 and k < config.iterations:
                evals[k] = _evaluate(config, data.eval, policy, k, root, pid, w)
        evals[config.iterations] = _evaluate(config, data.eval, policy, config.iterations, root, pid, w)

        last = config.iterations
        for when, i in (("before", 0), ("after", last)):
            run.log_metrics({f"eval/{name}_{when}": v for name, v in evals[i].items()})
        accuracy = {k: e["accuracy"] for k, e in evals.items()}
        png = reports.plot_curve(
            curve, accuracy, store.reports_root / f"rlhf-{pid}.png", f"{rl.algorithm}: reward per iteration"
        )
        run.log_artifact(png)

    summary = _summary(rl.algorithm, policy, curve, evals, png, pid, root)
    create_table_artifact(curve, key="rlhf-curve", description="RL reward/accuracy per iteration")
    create_markdown_artifact(summary, key="rlhf-summary", description="RLHF pipeline result")
    get_run_logger().info("\n%s", summary)
    return {
        "policy": policy,
        "start": start,
        "policies": policies,  # the start, then each iteration's
        "prm": prm if rl.prime is not None else None,  # PRIME's implicit PRM after the last iteration
        "curve": curve,
        "timings": timings,
        "accuracy": accuracy,
        "eval": evals,
        "curve_png": str(png),
        "mlflow_run_id": pid,
        "store": root,
    }


def _sample_and_score(config: RLHFFlowConfig, store, prompts, policy, rm, k: int, pid: str, warm: WarmGroup):
    """Iteration k's rollouts and their scores: one generation batch, or with DAPO's dynamic sampling as many as it
    takes to find `rollout.max_prompts` prompts whose rewards differ (at most `rl.max_gen_batches`)."""
    rl = config.rl.resolved()
    score_cfg, root = score_config_for(rl, config.score, config.rollout), str(store.root)
    gen_batches = rl.max_gen_batches if rl.dynamic_sampling else 1
    samples, scored, counts = [], [], []
    for j in range(gen_batches):
        window = iteration_rollout(config.rollout, k, j, gen_batches, rl.oversample_factor)
        samples.append(rollout(window, prompts, policy, k, root, pid, warm))
        scored.append(score(score_cfg, samples[-1], rm, k, root, pid))
        if rl.dynamic_sampling:
            counts.append(informative_groups(store, scored[-1]))
            if check_dynamic_sampling(counts, config.rollout.max_prompts, rl.max_gen_batches):
                break
    return samples, scored


def _submit_next(config: RLHFFlowConfig, store, prompts, policy, rm, k: int, pid: str, warm: WarmGroup):
    """Iteration k's rollout and score as Prefect futures (the task runner's threads), sampled with `policy`: an
    off-policy lag's rollout, generated while the update before it trains."""
    rl = config.rl.resolved()
    root = str(store.root)
    window = iteration_rollout(config.rollout, k, 0, 1, rl.oversample_factor)
    sampled = rollout.submit(window, prompts, policy, k, root, pid, warm)
    return sampled, score.submit(score_config_for(rl, config.score, config.rollout), sampled, rm, k, root, pid)


def _prime(config: RLHFFlowConfig, store, scored, policy, prm, start, k: int, pid: str, warm: WarmGroup):
    """PRIME's iteration k: the PRM update (before or after it scores the batch, or none) and the process rewards.
    Returns (the PRM now, the process rewards, the PRM's metrics for the iteration's row and MLflow)."""
    root, mode = str(store.root), config.rl.resolved().prime.update
    before = prm
    if mode == "before":
        prm = prm_update(config.rl, scored, policy, prm, start, k, root, pid, warm)
    process = process_rewards(config.rl, scored, policy, prm, start, k, root, pid, warm)
    if mode == "after":
        prm = prm_update(config.rl, scored, policy, before, start, k, root, pid, warm)
    metrics = store.manifest(prm)["metrics"] if prm is not before else {}
    return prm, process, {k_: v for k_, v in metrics.items() if k_.startswith("prm_")}


def _teacher(config: RLHFFlowConfig, store: ArtifactStore, student: ArtifactRef, corpus, pid: str) -> ArtifactRef:
    """The teacher of rl.distill as a model artifact (any path `model.path` takes), refused before any Ray work if
    it does not share the student's tokenizer."""
    from posttrain_core.rollout.teacher import check_teacher

    teacher = build_model(ModelConfig(path=config.rl.distill.teacher), corpus, str(store.root), pid)
    check_teacher(str(store.local_path(student)), str(store.local_path(teacher)))
    return teacher


def _next_window(config: RLHFFlowConfig, k: int):
    rl = config.rl.resolved()
    gen_batches = rl.max_gen_batches if rl.dynamic_sampling else 1
    return iteration_rollout(config.rollout, k + 1, 0, gen_batches, rl.oversample_factor)


def greedy_eval_config(config: RLHFFlowConfig) -> EvalConfig:
    """The held-out evaluation as configured, with the rollout's tools when it names none (a policy trained to call
    tools is evaluated with them)."""
    if config.eval.tools is None and config.rollout.tools is not None:
        return config.eval.model_copy(update={"tools": config.rollout.tools})
    return config.eval


def sampled_eval_config(config: RLHFFlowConfig) -> EvalConfig:
    """The held-out evaluation sampled like the rollouts (`eval_samples` per prompt at the rollout temperature):
    pass@1 and pass@n, the quantity RL raises."""
    r = config.rollout
    return greedy_eval_config(config).model_copy(
        update=dict(
            samples=config.eval_samples, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_tokens,
            seed=SAMPLED_EVAL_SEED, engine=r.engine, num_engines=r.num_engines, batch_size=r.batch_size,
        )
    )  # fmt: skip


def _evaluate(
    config: RLHFFlowConfig, prompts: ArtifactRef, policy: ArtifactRef, k: int, root: str, pid: str, warm: WarmGroup,
    sampled: bool = True,
) -> dict[str, float]:  # fmt: skip
    """Held-out metrics of `policy` at iteration k: greedy accuracy (per family), and sampled pass@k."""
    greedy = evaluate(greedy_eval_config(config), prompts, policy, f"iter={k}", root, pid, warm)
    metrics = {
        k_: v
        for k_, v in ArtifactStore(root).manifest(greedy)["metrics"].items()
        if k_.startswith(("accuracy", *TOOL_USE))
    }
    if sampled and config.eval_samples:
        ref = evaluate(sampled_eval_config(config), prompts, policy, f"iter={k}, sampled", root, pid, warm)
        metrics |= {
            f"sampled_{n}": v
            for n, v in ArtifactStore(root).manifest(ref)["metrics"].items()
            if "pass@" in n or n.startswith(TOOL_USE)
        }
    return metrics


def _summary(algorithm: str, policy, curve, evals: dict[int, dict], png, run_id: str, root: str) -> str:
    first, last = evals[0], evals[max(evals)]

    def change(name: str) -> str:
        return f"**{first.get(name, float('nan')):.3f}** -> **{last.get(name, float('nan')):.3f}**"

    families = ", ".join(f"{k.split('/')[1]} {change(k)}" for k in sorted(first) if k.startswith("accuracy/"))
    lines = [
        f"- held-out greedy accuracy: start -> after RL {change('accuracy')}" + (f" ({families})" if families else "")
    ]
    if "sampled_pass@1" in first:
        per_family = ", ".join(
            f"{k.split('/')[1]} {change(k)}" for k in sorted(first) if k.startswith("sampled_pass@1/")
        )
        lines.append(
            "- held-out sampled accuracy (pass@1 at the rollout temperature): start -> after RL "
            f"{change('sampled_pass@1')}" + (f" ({per_family})" if per_family else "")
        )
    for prefix, how in (("", "greedy"), ("sampled_", "sampled")):
        if f"{prefix}tool_precision" in first:
            lines.append(
                f"- held-out tool use ({how}): precision {change(f'{prefix}tool_precision')}, recall "
                f"{change(f'{prefix}tool_recall')}, calls per family "
                + ", ".join(f"{k.split('/')[1]} {change(k)}" for k in sorted(first)
                            if k.startswith(f"{prefix}tool_call_rate/"))
            )  # fmt: skip
    return "\n".join(
        [
            f"## posttrain RLHF result ({algorithm}, {len(curve)} iterations)",
            *lines,
            f"- final policy: `{policy.uri}`",
            f"- reward curve: `{png}`",
            "",
            reports.markdown_table(curve, tuple(curve[0]) if curve else reports.CURVE_COLUMNS),
            "",
            f"- MLflow run: `{run_id}` (browse: `mlflow ui --backend-store-uri {tracking.tracking_uri(root)}`)",
        ]
    )


def main(config: RLHFFlowConfig = RLHFFlowConfig()) -> dict[str, Any]:  # noqa: B008
    """Run the flow and print the before/after held-out accuracy (the demos' entry point)."""
    started = time.time()
    result = rlhf_flow(config)
    before, after = result["eval"][0], result["eval"][max(result["eval"])]
    if "sampled_pass@1" in before:
        print(f"\nheld-out sampled accuracy (pass@1): start {before['sampled_pass@1']:.3f} -> after RL "
              f"{after['sampled_pass@1']:.3f}")  # fmt: skip
    print(
        f"held-out greedy accuracy: start {before['accuracy']:.3f} -> after RL {after['accuracy']:.3f}\n"
        f"final policy: {result['policy'].uri}\nreward curve: {result['curve_png']}\nMLflow parent run: "
        f"{result['mlflow_run_id']} ({tracking.tracking_uri(result['store'])})\n"
        f"wall time: {time.time() - started:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()

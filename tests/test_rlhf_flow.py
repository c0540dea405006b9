"""End-to-end: the rlhf flow on the real Prefect API, Ray (2 workers) and MLflow, on tiny models.

A run killed (SIGKILL of the whole process) during iteration 2 and started again reuses every stage published before
the kill and ends with the same final policy, bit for bit, as an uninterrupted run with the same seeds; a rerun of a
finished run builds nothing. The run is the VLM demo's, shrunk (a tiny Qwen2-VL: pictures in the data, SFT), with
PRIME, the algorithm with the most stages per iteration (rollout -> score -> prm_update -> process_rewards ->
rl_update), killed while its PRM updates: resuming is the same for text and GRPO, and images are where it could
break (a digest that depends on how a picture was read, pixels the trainer or the PRM sees differently from the
engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_helpers import kill_in_iteration_2, stage_count, task_states

pytestmark = pytest.mark.slow


def _config(store: Path, **overrides):
    from posttrain_core.config import (
        DataConfig,
        EvalConfig,
        ModelConfig,
        RLConfig,
        RLHFFlowConfig,
        RolloutConfig,
        ScoreConfig,
    )

    # The untrained tiny model rarely writes a digit: "contains a digit" is a reward with variance within groups.
    fields = dict(
        store=str(store),
        data=DataConfig(n_train=200, n_eval=16),
        model=ModelConfig(size="tiny"),
        pretrain=None,
        sft=None,
        iterations=2,
        rollout=RolloutConfig(n=4, max_prompts=8, max_tokens=8, num_engines=1, batch_size=8),
        score=ScoreConfig(verifiers={"regex": 1.0, "exact_match": 0.0}, regex="[0-9]"),  # exact_match: `correct` only
        rl=RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8, mini_batches=2),
        eval=EvalConfig(max_new_tokens=4, num_engines=1),
        eval_samples=2,
    )
    return RLHFFlowConfig(**{**fields, **overrides})


def _vlm_config(store: Path):
    """`make demo-vlm`'s run, shrunk: 20 SFT steps, then 2 PRIME iterations of 8 prompts x 4 samples, of which the
    accuracy band keeps 4 prompts (oversample_factor 2)."""
    from flows.vlm import vlm_config
    from posttrain_core.config import EvalConfig, PrimeConfig, ScoreConfig

    base = vlm_config()
    prime = dict(algorithm="prime", prime=PrimeConfig(lr=1e-3), oversample_factor=2, micro_batch_size=8)
    return base.model_copy(
        update=dict(
            store=str(store),
            data=base.data.model_copy(update=dict(n_train=200, n_eval=16, n_rl_prompts=32)),
            sft=base.sft.model_copy(update=dict(max_steps=20, global_batch_size=16, micro_batch_size=8)),
            iterations=2,
            rollout=base.rollout.model_copy(update=dict(n=4, max_prompts=4, max_tokens=6, num_engines=1)),
            rl=base.rl.model_copy(update=prime),
            # 20 SFT steps answer no question right yet: "says 'e'" is a reward with variance within groups.
            score=ScoreConfig(verifiers={"regex": 1.0, "exact_match": 0.0}, regex="e"),
            eval=EvalConfig(max_new_tokens=6, num_engines=1),
            eval_samples=0,  # sampled evaluation: test_rollout's
        )
    )


def test_rlhf_flow_killed_in_iteration_2_resumes_there(prefect_api, ray_session, tmp_path, monkeypatch):
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_causal_lm

    # The killed run's process hashes posttrain_core into every stage key when it starts, this one did at its first
    # key: an edit to the code in between (during a long session) would make every stage of the rerun new.
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-rlhf-kill")
    cfg = _vlm_config(tmp_path / "store")
    store = ArtifactStore(cfg.store)

    # 1. Run in its own process; SIGKILL the process group once iteration 2's PRM update has started building.
    pid = kill_in_iteration_2(cfg, tmp_path / "killed.log", stage="prm_update")
    assert stage_count(store, "prm_update") == 1, "the kill came too late: iteration 2's PRM update finished"
    published = {ref.key for ref in store.list()}

    # 2. Start it again: everything published before the kill is a cache hit; iteration 2's PRM update runs.
    state = rlhf_flow(cfg, return_state=True)
    result = state.result()
    states = task_states(state.state_details.flow_run_id)
    for name in ("sft", "rollout[iter=1]", "score[iter=1]", "prm_update[iter=1]", "process_rewards[iter=1]",
                 "rl_update[iter=1]", "rollout[iter=2]", "score[iter=2]"):  # fmt: skip
        assert states[name] == ["Cached"], (name, states)
    for name in ("prm_update[iter=2]", "process_rewards[iter=2]", "rl_update[iter=2]"):
        assert states[name] == ["Completed"], (name, states)
    assert published <= {ref.key for ref in store.list()}
    # The killed process could not end the runs it had open: the flow's, and those of iteration 2's stages whose
    # records its background writer had not written yet (the PRM update's, and the score's closing record if it was
    # still queued). The rerun marked them KILLED; nothing is left RUNNING. The rerun's own run: FINISHED.
    from posttrain_core import tracking

    c = tracking.client(cfg.store)
    exps = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(exps, filter_string=f"tags.`posttrain.pid` = '{pid}'")
    ended = sorted((r.info.run_name.split("/")[0], r.info.status) for r in runs if r.info.status != "FINISHED")
    assert ("rlhf", "KILLED") in ended and {status for _, status in ended} == {"KILLED"}, ended
    assert {name for name, _ in ended} <= {"rlhf", "score", "prm_update"}, ended
    assert c.get_run(result["mlflow_run_id"]).info.status == "FINISHED"
    assert stage_count(store, "rl_update") == 2 and stage_count(store, "rollout") == 2
    assert stage_count(store, "evaluate") == 2 and "accuracy" in result["eval"][0]  # before and after

    # 3. The same final policy and PRM as an uninterrupted run with the same seeds, in a fresh store. In both,
    # iteration 2's rollout was generated with update 1's weights in memory before they were published.
    fresh = rlhf_flow(_vlm_config(tmp_path / "fresh"))
    assert (fresh["policy"].digest, fresh["prm"].digest) == (result["policy"].digest, result["prm"].digest)
    assert fresh["curve"] == result["curve"]
    fresh_store = ArtifactStore(tmp_path / "fresh")
    loads = {
        name: {m.get("engine_load") for m in map(s.manifest, s.list()) if m.get("stage") == "rollout"}
        for name, s in (("resumed", store), ("fresh", fresh_store))
    }
    assert "prefetched" in loads["resumed"] and "prefetched" in loads["fresh"], loads
    built = {ref.key for ref in fresh_store.list()}
    assert rlhf_flow(_vlm_config(tmp_path / "fresh"))["policy"] == fresh["policy"]  # 4. a rerun: all cache hits
    assert {ref.key for ref in fresh_store.list()} == built

    # PRIME: the band kept 4 of the 8 prompts sampled, and the update took the process rewards of those rows.
    policy = store.manifest(result["policy"])
    assert policy["metrics"]["band_prompts"] == 8 and policy["metrics"]["band_kept"] == 4
    assert policy["metrics"]["samples"] == 16 and "process_reward_abs_mean" in policy["metrics"]
    process = store.get(next(i["key"] for i in policy["inputs"] if i["name"] == "process"))
    rows = read_dataset(store.local_path(process), "process_rewards").to_pylist()
    assert len(rows) == 16 and all(len(r["process_rewards"]) == len(r["response_ids"]) for r in rows)
    assert any(x != 0.0 for r in rows for x in r["process_rewards"])  # PRM(2) is no longer the reference
    # The PRM: a model artifact with its lineage (both iterations' scores), loadable as any model.
    prm = store.manifest(result["prm"])
    assert prm["stage"] == "prm_update" and prm["objective"] == "implicit_prm" and "prm_ce_loss" in prm["metrics"]
    assert [m.get("stage") for m in store.lineage(result["prm"])].count("prm_update") == 2
    load_causal_lm(store.local_path(result["prm"]))
    assert {"prm_ce_loss", "process_reward_abs_mean", "band_kept"} <= set(result["curve"][0])

    # The rollouts carry their prompts' pictures, which the trainer, fed the same pixels, scores as the engine did.
    scored = [store.get(i["key"]) for i in store.manifest(result["policy"])["inputs"] if i["name"].startswith("scored")]
    images = read_dataset(store.local_path(scored[0]), "scored_rollouts").column("images").to_pylist()
    assert all(im and im[0].startswith(b"\x89PNG") for im in images)
    sft = store.manifest(result["start"])
    assert sft["stage"] == "sft" and sft["loss_history"][-1] < sft["loss_history"][0]

    # What an iteration records: every metric docs/algorithms.md lists, the lineage, the curve picture.
    metrics = store.manifest(result["policy"])["metrics"]
    for name in (
        "reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_max", "kl_k1", "kl_k3",
        "entropy", "clip_frac", "approx_kl", "grad_norm", "logp_mismatch_mean",
    ):  # fmt: skip
        assert name in metrics, (name, sorted(metrics))
    assert metrics["logp_mismatch_mean"] < 1e-3, metrics  # hf engine log-probs = the trainer's
    assert metrics["reward_std"] > 0
    lineage = [m.get("stage") for m in store.lineage(result["policy"])]
    assert lineage.count("rl_update") == 2 and "rollout" in lineage and "score" in lineage
    assert Path(result["curve_png"]).read_bytes()[:4] == b"\x89PNG"
    assert [r["iteration"] for r in result["curve"]] == [1, 2]


def test_dynamic_sampling_gives_up_when_every_group_is_uniform(prefect_api, ray_session, tmp_path):
    from flows.rlhf import rlhf_flow
    from posttrain_core.config import RLConfig, ScoreConfig
    from posttrain_core.train.rl_plan import DynamicSamplingError

    # An untrained model never answers arithmetic right: every group is all-wrong (reward 0 everywhere).
    cfg = _config(
        tmp_path / "store",
        iterations=1,
        score=ScoreConfig(verifiers={"exact_match": 1.0}),
        rl=RLConfig(algorithm="grpo", dynamic_sampling=True, max_gen_batches=2, micro_batch_size=8),
    )
    with pytest.raises(DynamicSamplingError, match=r"only 0 of the 8 wanted prompts.*max_gen_batches=2"):
        rlhf_flow(cfg)
    from posttrain_core.artifacts import ArtifactStore

    store = ArtifactStore(cfg.store)
    assert stage_count(store, "rollout") == 2 and stage_count(store, "rl_update") == 0  # 2 generation batches

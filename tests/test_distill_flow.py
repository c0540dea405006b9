"""Distillation end to end: the rlhf flow with a teacher on the real Prefect API, Ray and MLflow, on tiny models.

On-policy distillation (opd) then GKD (gkd) from the same teacher: a teacher_logprobs stage scores every iteration's
rollouts, the update learns from its columns, and a rerun is all cache hits. A teacher with another vocabulary is
refused before any engine or training work.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _config(store, teacher: str, **rl):
    from posttrain_core.config import (
        DataConfig,
        DistillConfig,
        EvalConfig,
        ModelConfig,
        RLConfig,
        RLHFFlowConfig,
        RolloutConfig,
    )

    distill = DistillConfig(teacher=teacher, topk=8, num_engines=1, **rl.pop("distill", {}))
    return RLHFFlowConfig(
        store=str(store),
        data=DataConfig(n_train=200, n_eval=16),
        model=ModelConfig(size="tiny"),
        pretrain=None,
        sft=None,
        iterations=2,
        rollout=RolloutConfig(n=2, max_prompts=8, max_tokens=8, num_engines=1, batch_size=8),
        rl=RLConfig(lr=1e-3, micro_batch_size=8, mini_batches=2, distill=distill, **rl),
        eval=EvalConfig(max_new_tokens=4, num_engines=1),
        eval_samples=0,
    )


@pytest.fixture(scope="module")
def teacher_store(tmp_path_factory):
    """A store holding the flow's data and a teacher: the tiny model of another seed, on the same tokenizer (the
    flow's data makes the same corpus and so the same tokenizer), and one whose tokenizer learned another corpus."""
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, ModelConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model

    store = ArtifactStore(tmp_path_factory.mktemp("distill") / "store")
    data = run_prepare_data(DataConfig(n_train=200, n_eval=16), store)
    teacher = run_build_model(ModelConfig(size="tiny", seed=1), data.text, store)
    digits = run_prepare_data(DataConfig(n_train=200, n_eval=16, families=["arithmetic"]), store)
    other = run_build_model(ModelConfig(size="tiny"), digits.text, store)
    return store, teacher, other


def _stages(store, stage: str) -> list:
    return [ref for ref in store.list() if store.manifest(ref).get("stage") == stage]


def test_opd_then_gkd_learn_from_a_teacher_and_rerun_from_cache(prefect_api, ray_session, teacher_store):
    import mlflow

    from flows.rlhf import rlhf_flow
    from posttrain_core import tracking

    store, teacher, _ = teacher_store
    opd = rlhf_flow(_config(store.root, teacher.key, algorithm="opd"))

    scored = _stages(store, "teacher_logprobs")
    assert len(scored) == 2  # one per iteration
    manifest = store.manifest(scored[0])
    assert manifest["topk"] == 8 and manifest["teacher"] == teacher.uri
    for row in opd["curve"]:
        assert row["teacher_kl"] is not None and row["teacher_mass"] is not None
        assert 0.0 < row["student_mass"] <= 1.0 + 1e-5 and 0.0 <= row["topk_overlap"] <= 1.0
        assert row["distill_loss"] == 0.0  # opd: the teacher is in the advantage, not in a supervised term
    metrics = store.manifest(opd["policy"])["metrics"]
    assert metrics["advantage_abs_mean"] > 0  # -(log pi - log pi_teacher) of two different models
    client = mlflow.tracking.MlflowClient(tracking.tracking_uri(str(store.root)))
    logged = client.get_run(opd["mlflow_run_id"]).data.metrics
    assert {"rl/teacher_kl", "rl/teacher_mass", "rl/student_mass", "rl/topk_overlap"} <= set(logged)

    again = rlhf_flow(_config(store.root, teacher.key, algorithm="opd"))
    assert again["policy"].digest == opd["policy"].digest
    assert len(_stages(store, "teacher_logprobs")) == 2  # the rerun scored nothing anew

    # GKD on the teacher's own samples (seq_kd): the update takes rows the teacher sampled, and learns from the
    # supervised JSD alone
    gkd_cfg = _config(store.root, teacher.key, algorithm="gkd", distill={"seq_kd": True})
    gkd = rlhf_flow(gkd_cfg.model_copy(update={"iterations": 1}))
    rollouts = [r for r in _stages(store, "rollout") if store.manifest(r)["policy"] == teacher.uri]
    assert len(rollouts) == 1 and len(_stages(store, "teacher_logprobs")) == 3
    assert gkd["curve"][0]["distill_loss"] > 0.0  # the JSD of two different models
    update = store.manifest(gkd["policy"])
    assert update["metrics"]["advantage_abs_mean"] == 0.0  # no policy-gradient term
    assert update["metrics"]["logp_mismatch_mean"] > 1e-3  # old log-probs are the student's, the samples the teacher's


def test_a_teacher_with_another_vocabulary_is_refused_before_any_work(prefect_api, teacher_store):
    from flows.rlhf import rlhf_flow

    store, _, other = teacher_store
    before = {"evaluate": len(_stages(store, "evaluate")), "rollout": len(_stages(store, "rollout"))}
    with pytest.raises(ValueError, match=r"rl.distill.teacher: the teacher .* vocabulary of \d+ tokens, the student"):
        rlhf_flow(_config(store.root, other.key, algorithm="opd"))
    assert before == {"evaluate": len(_stages(store, "evaluate")), "rollout": len(_stages(store, "rollout"))}


def test_a_teacher_with_the_same_vocabulary_size_but_another_tokenizer_is_refused(teacher_store, tmp_path):
    import json
    import shutil

    from posttrain_core.rollout.teacher import check_teacher

    store, teacher, _ = teacher_store
    src = store.local_path(teacher)
    swapped = tmp_path / "swapped"
    shutil.copytree(src, swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]  # two ordinary tokens trade ids: same size, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    check_teacher(str(src), str(src))  # the same folder passes
    with pytest.raises(ValueError, match=r"tokenize differently"):
        check_teacher(str(src), str(swapped))

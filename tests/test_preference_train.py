"""Preference stages on a tiny model: the reward model and DPO train, checkpoints reload and resume, reference
log-probs are computed once, bad inputs fail before Ray work, and the Prefect flow runs end to end."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from posttrain_core import tracking
from posttrain_core.config import DPOConfig, RewardModelConfig

TINY = dict(global_batch_size=16, micro_batch_size=8, max_seq_len=64, checkpoint_every=0, log_every=10)


def _runs(stage: str, key: str | None = None):
    from mlflow.tracking import MlflowClient

    tracking.flush()  # stage records are written by a background thread; read them after it is done
    client = MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`posttrain.stage` = '{stage}'" + (f" and tags.`posttrain.key` = '{key}'" if key else "")
    return client.search_runs(experiments, filter_string=query)


# ------------------------------------------------------------------------------------------ fast: no Ray work
def test_encode_response_scores_only_the_response():
    from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems
    from posttrain_core.models.tokenizer import train_tokenizer
    from posttrain_core.train.loop import IGNORE
    from posttrain_core.train.preference_loop import encode_response, split_pairs

    tok = train_tokenizer(corpus_for_tokenizer(make_problems(n=50)), vocab_size=300)
    prompt = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},  # history: not scored
        {"role": "user", "content": "And 3 + 3?"},
    ]
    ids, labels = encode_response(tok, prompt, [{"role": "assistant", "content": "6"}], max_length=256)
    scored = tok.decode([t for t, y in zip(ids, labels, strict=True) if y != IGNORE])
    assert scored == "6<|im_end|>\n"
    assert encode_response(tok, prompt, [{"role": "assistant", "content": "6"}], max_length=5)[1] == [IGNORE] * 5

    train, held_out = split_pairs(10, 3, seed=0)
    assert len(held_out) == 3 and sorted(train + held_out) == list(range(10))
    assert split_pairs(10, 3, seed=0) == (train, held_out)
    with pytest.raises(ValueError, match="leaves no training pair"):
        split_pairs(3, 3, seed=0)


def test_bad_inputs_fail_before_any_ray_work(tiny_inputs):
    from posttrain_core.artifacts import ArtifactRef
    from posttrain_core.train.preference_stage import run_dpo, run_reward_model

    store, data, base = tiny_inputs
    cfg = RewardModelConfig(**TINY, max_steps=1)
    with pytest.raises(ValueError, match="'preferences' dataset, got dataset/sft"):
        run_reward_model(cfg, data.sft, base, store)
    missing = ArtifactRef(kind="model", key="0" * 64, uri="/nonexistent/model", digest="0" * 64)
    with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
        run_reward_model(cfg, data.preferences, missing, store)
    with pytest.raises(ValueError, match="exceeds the context"):
        run_dpo(DPOConfig(**{**TINY, "max_seq_len": 4096}), data.preferences, base, store)
    with pytest.raises(ValueError, match="label_smoothing=0.1 only applies to loss_type='cdpo'"):
        run_dpo(DPOConfig(**TINY, label_smoothing=0.1), data.preferences, base, store)
    with pytest.raises(ValueError, match="eval_pairs=400 leaves no training pair"):
        run_reward_model(RewardModelConfig(**TINY, eval_pairs=400), data.preferences, base, store)
    with pytest.raises(ValueError, match="must be a model artifact"):
        run_dpo(DPOConfig(**TINY), data.preferences, base, store, reference=data.sft)


def test_in_stage_checkpoint_resume_replays_the_same_steps(tiny_inputs, tmp_path):
    """Run 10 steps (checkpoint at 5); a second run in the same workdir resumes at 5 and reproduces steps 6-10."""
    from posttrain_core.train.preference_loop import PreferenceJob, preference_loop

    store, data, base = tiny_inputs
    cfg = RewardModelConfig(
        **{**TINY, "checkpoint_every": 5, "micro_batch_size": 16}, num_workers=1, max_steps=10, eval_pairs=8
    )
    job = PreferenceJob(
        "rm", cfg, str(data.preferences.path), str(base.path), str(tmp_path / "w"), str(tmp_path / "o1")
    )
    first = preference_loop(job, 0, 1)
    again = preference_loop(
        PreferenceJob("rm", cfg, job.data_path, job.model_path, job.workdir, str(tmp_path / "o2")), 0, 1
    )
    assert first["resumed_from_step"] == 0 and again["resumed_from_step"] == 5
    assert again["history"]["loss"] == pytest.approx(first["history"]["loss"][5:], rel=1e-5, abs=1e-6)
    assert again["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-5)


def test_loss_is_normalised_over_the_global_batch(tiny_inputs, tmp_path):
    """Global batch 8 as 1 micro-batch of 8 or 2 accumulated micro-batches of 4: the same DPO steps. (Across ranks the
    same sum / global size is kept by scaling with the world size, as in train/loop.py; the 2-worker runs below use it.)"""
    from posttrain_core.data.io import read_dataset, write_dataset
    from posttrain_core.train.preference_loop import PreferenceJob, preference_loop

    store, data, base = tiny_inputs
    table = read_dataset(data.preferences.path, "preferences").slice(0, 64)
    # Made-up reference log-probs: the normalisation does not care where they come from.
    table = table.append_column("ref_chosen_logp", pa.array([-20.0] * 64))
    table = table.append_column("ref_rejected_logp", pa.array([-21.0] * 64))
    write_dataset(table, "preferences", tmp_path / "prefs")
    histories = []
    for micro in (8, 4):
        cfg = DPOConfig(
            **{**TINY, "global_batch_size": 8, "micro_batch_size": micro}, num_workers=1, max_steps=3, eval_pairs=8
        )
        job = PreferenceJob(
            "dpo",
            cfg,
            str(tmp_path / "prefs"),
            str(base.path),
            str(tmp_path / f"w{micro}"),
            str(tmp_path / f"o{micro}"),
            stage="dpo",
        )
        histories.append(preference_loop(job, 0, 1)["history"])
    assert histories[0]["loss"] == pytest.approx(histories[1]["loss"], rel=1e-5, abs=1e-6)
    assert histories[0]["margin"] == pytest.approx(histories[1]["margin"], rel=1e-4, abs=1e-6)


def test_lora_reward_model_is_saved_merged_and_lora_dpo_as_an_adapter(tiny_inputs, tmp_path):
    from posttrain_core.config import LoraConfig
    from posttrain_core.models.loading import check_model_path
    from posttrain_core.models.reward import load_reward_model, reward_scores
    from posttrain_core.train.preference_loop import PreferenceJob, preference_loop

    store, data, base = tiny_inputs
    common = dict(**{**TINY, "micro_batch_size": 16}, num_workers=1, max_steps=2, eval_pairs=8, lora=LoraConfig(r=4))
    rm = preference_loop(
        PreferenceJob(
            "rm",
            RewardModelConfig(**common),
            str(data.preferences.path),
            str(base.path),
            str(tmp_path / "w1"),
            str(tmp_path / "rm"),
        ),
        0,
        1,
    )
    assert rm["model_info"]["adapter"] is False  # the scalar head lives outside the adapter: saved merged
    model, tokenizer = load_reward_model(tmp_path / "rm")
    probes = rm["probes"]
    scores = reward_scores(
        model, tokenizer, [p["prompt"] for p in probes], [p["response"] for p in probes], max_length=64
    )
    assert scores == pytest.approx([p["score"] for p in probes], abs=1e-5)

    # DPO data needs the reference columns; zeros are enough to check the adapter is what gets saved.
    from posttrain_core.data.io import read_dataset, write_dataset

    table = read_dataset(data.preferences.path, "preferences").slice(0, 40)
    for name in ("ref_chosen_logp", "ref_rejected_logp"):
        table = table.append_column(name, pa.array([0.0] * 40))
    write_dataset(table, "preferences", tmp_path / "prefs")
    dpo = preference_loop(
        PreferenceJob(
            "dpo",
            DPOConfig(**common),
            str(tmp_path / "prefs"),
            str(base.path),
            str(tmp_path / "w2"),
            str(tmp_path / "dpo"),
            stage="dpo",
        ),
        0,
        1,
    )
    assert dpo["model_info"]["adapter"] is True
    assert check_model_path(tmp_path / "dpo")["base_model"] == str(base.path)


# ------------------------------------------------------------------------------------------ slow: Ray workers
@pytest.mark.slow
def test_reward_model_learns_and_its_checkpoint_scores_the_same(ray_session, tiny_inputs, capfd):
    """80 steps on the synthetic right-vs-wrong pairs; the saved folder reloads and scores exactly as in training."""
    from mlflow.tracking import MlflowClient

    from posttrain_core.models.reward import load_reward_model, reward_scores
    from posttrain_core.train.preference_stage import run_reward_model

    store, data, base = tiny_inputs
    cfg = RewardModelConfig(**TINY, max_steps=80, warmup_steps=5, eval_pairs=64)
    ref = run_reward_model(cfg, data.preferences, base, store)
    manifest = store.manifest(ref)
    m = manifest["metrics"]
    assert manifest["architecture"] == "LlamaForSequenceClassification"
    assert m["train_pairs"] == 336 and m["eval_pairs"] == 64
    assert m["final_loss"] < m["first_loss"], m  # it fits the training pairs ...
    assert sum(manifest["accuracy_history"][-20:]) / 20 > 0.55, manifest["accuracy_history"]
    # ... but held-out right-vs-wrong arithmetic needs a model that can do the task: a random-init tiny backbone
    # stays near chance here (see the next test for held-out generalisation of a learnable preference).
    assert 0.0 <= m["eval_accuracy"] <= 1.0 and "eval_accuracy_init" in m
    # The worker's progress lines reach this process through Ray's log forwarding, which may trail the stage's end.
    out, deadline = capfd.readouterr().out, time.time() + 30
    while "[rm] step 80/80 loss" not in out and time.time() < deadline:
        time.sleep(0.2)
        out += capfd.readouterr().out
    assert "[rm] step 80/80 loss" in out, out[-2000:]
    with capfd.disabled():
        print(f"RM metrics: {m}")

    model, tokenizer = load_reward_model(ref.uri)
    probes = manifest["probe_scores"]
    assert len(probes) == 8
    scores = reward_scores(
        model,
        tokenizer,
        [p["prompt"] for p in probes],
        [p["response"] for p in probes],
        batch_size=3,
        max_length=probes[0]["max_length"],
    )
    assert scores == pytest.approx([p["score"] for p in probes], abs=1e-5)

    tracking.flush()  # the stage's last records (eval metrics, manifest) may still be queued on the tracking writer
    history = MlflowClient().get_metric_history(manifest["mlflow_run_id"], "train/accuracy")
    assert [h.step for h in history] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    assert MlflowClient().get_run(manifest["mlflow_run_id"]).data.metrics["eval/accuracy"] == m["eval_accuracy"]


@pytest.mark.slow
def test_reward_model_generalises_a_learnable_preference(ray_session, tiny_inputs, tmp_path):
    """Held-out accuracy beats chance when the preference is learnable by a tiny model: the rejected answers of the
    synthetic pairs carry a hedge ("..., I think"). One worker, 20 steps."""
    from posttrain_core.data.io import read_dataset
    from posttrain_core.train.preference_stage import run_reward_model

    store, data, base = tiny_inputs
    rows = read_dataset(data.preferences.path, "preferences").to_pylist()
    for row in rows:
        row["rejected"][0]["content"] += ", I think"
    folder = tmp_path / "hedged"
    from posttrain_core.data.io import write_dataset

    write_dataset(pa.Table.from_pylist(rows), "preferences", folder)
    hedged = store.register_external(str(folder), kind="dataset", schema_kind="preferences")
    cfg = RewardModelConfig(**TINY, num_workers=1, max_steps=20, warmup_steps=5, eval_pairs=64)
    m = store.manifest(run_reward_model(cfg, hedged, base, store))["metrics"]
    print(f"RM (learnable preference) metrics: {m}")
    # The random head may already rank such a systematic difference either way; the loss says it was learned.
    assert m["eval_loss"] < 0.5 * m["eval_loss_init"], m
    assert m["eval_accuracy"] > 0.9, m


@pytest.mark.slow
def test_dpo_increases_the_margin_and_reuses_the_reference_logprobs(ray_session, tiny_inputs, monkeypatch):
    """64 training pairs (the other 336 held out), 30 steps: the loss falls from log 2 and the implicit reward margin
    grows; then another beta / loss type reuses the reference log-probs stage (a cache hit)."""
    from posttrain_core.train.preference_stage import run_dpo

    # Other edits to posttrain_core between the two runs would change every key: pin the code version.
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-preference-dpo")
    store, data, base = tiny_inputs
    cfg = DPOConfig(**TINY, max_steps=30, lr=3e-3, warmup_steps=2, beta=0.1, eval_pairs=336)
    first = store.manifest(run_dpo(cfg, data.preferences, base, store))
    m = first["metrics"]
    print(f"DPO metrics: {m}")
    assert first["loss_history"][0] == pytest.approx(0.693147, abs=1e-4)  # the policy starts as the reference
    assert first["margin_history"][0] == pytest.approx(0.0, abs=1e-4)
    assert m["final_loss"] < m["first_loss"] - 0.1, m
    assert m["final_margin"] > m["first_margin"] + 0.2, m
    assert m["eval_pairs"] == 336 and {"eval_margin", "eval_accuracy"} <= set(m)

    ref_lp = first["reference_logprobs"]
    lp = store.manifest(ref_lp["key"])
    assert lp["stage"] == "reference_logprobs" and lp["schema_kind"] == "preferences" and lp["num_rows"] == 400
    assert len(_runs("reference_logprobs", ref_lp["key"])) == 1

    # Another beta and loss type: a new DPO run, the same reference log-probs (a cache hit: no new MLflow run).
    second = store.manifest(
        run_dpo(
            DPOConfig(**TINY, num_workers=1, max_steps=2, beta=0.5, loss_type="ipo", eval_pairs=8),
            data.preferences,
            base,
            store,
        )
    )
    assert second["key"] != first["key"]
    assert second["reference_logprobs"] == ref_lp
    assert len(_runs("reference_logprobs", ref_lp["key"])) == 1


@pytest.mark.slow
def test_preference_flow_on_the_prefect_api(prefect_api, ray_session, tiny_inputs):
    """data -> base -> RM and DPO (SFT skipped to stay small), on the ephemeral Prefect API, reusing the session store."""
    from mlflow.tracking import MlflowClient

    from flows.preference import PreferenceFlowConfig, preference_flow
    from posttrain_core.config import DataConfig, ModelConfig

    store, _, base = tiny_inputs
    small = dict(**TINY, num_workers=1, max_steps=5, eval_pairs=16)
    config = PreferenceFlowConfig(
        store=str(store.root),
        data=DataConfig(n_train=400, n_eval=32),
        model=ModelConfig(size="tiny"),
        sft=None,
        reward_model=RewardModelConfig(**small),
        dpo=DPOConfig(**small, loss_type="cdpo", label_smoothing=0.1),
    )
    result = preference_flow(config)
    assert result["start"] == base
    assert store.manifest(result["reward_model"])["stage"] == "reward_model"
    dpo_manifest = store.manifest(result["dpo"])
    assert dpo_manifest["stage"] == "dpo" and dpo_manifest["config"]["loss_type"] == "cdpo"
    parent = MlflowClient().get_run(result["mlflow_run_id"])
    assert {"rm/eval_accuracy", "dpo/eval_accuracy", "dpo/eval_margin"} <= set(parent.data.metrics)
    children = MlflowClient().search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result['mlflow_run_id']}'"
    )
    assert {"reward_model", "dpo"} <= {r.data.tags["posttrain.stage"] for r in children}

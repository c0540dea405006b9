"""End-to-end: the sft flow on the real Prefect API, Ray (2 workers) and an MLflow store, on a tiny model."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow


def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _stage_runs(parent_run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    return client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


def test_sft_flow_run_from_the_cli_trains_tracks_and_caches(
    prefect_api, prefect_logging, ray_session, tiny_config, tmp_path, capsys
):
    """`posttrain run FILE.yaml --set ...` runs the flow and prints its MLflow run and main artifact; the same config
    from Python (`sft_flow`) is then all cache hits."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from flows.cli import main as posttrain
    from flows.sft import sft_flow
    from posttrain_core import tracking
    from posttrain_core.artifacts import ArtifactStore

    # The file says 1 SFT step; `--set` makes it the session's tiny config (40), which the Python run below reuses.
    config = tiny_config.model_copy(update={"sft": tiny_config.sft.model_copy(update={"max_steps": 1})})
    path = tmp_path / "run.yaml"
    path.write_text(f"flow: sft\nconfig: {config.model_dump_json()}\n")  # YAML reads JSON
    assert posttrain(["run", str(path), "--set", "sft.max_steps=40"]) == 0
    out = capsys.readouterr().out
    assert "flow sft finished" in out, out
    key = next(line for line in out.splitlines() if line.startswith("main artifact (model): ")).split()[3]
    run_id = next(line.split()[-1] for line in out.splitlines() if line.startswith("MLflow run: "))
    store = ArtifactStore(tiny_config.store)
    (model_ref,) = [r for r in store.list("model") if r.key.startswith(key) and store.manifest(r)["stage"] == "sft"]
    result = {"model": model_ref, "mlflow_run_id": run_id}

    # Trained: the loss drops by a clear margin; the checkpoint is a plain HF folder.
    manifest = store.manifest(result["model"])
    assert manifest["config"]["max_steps"] == 40  # the command line's value over the file's
    assert manifest["stage"] == "sft" and manifest["kind"] == "model"
    assert manifest["metrics"]["final_loss"] < 0.7 * manifest["metrics"]["first_loss"], manifest["metrics"]
    model = AutoModelForCausalLM.from_pretrained(result["model"].uri)
    assert model.config.model_type == "llama"

    # Lineage: sft <- pretrain <- build_model <- prepare_data.text
    stages = [m.get("stage") for m in store.lineage(result["model"])]
    assert stages[0] == "sft"
    assert {"sft", "pretrain", "build_model", "prepare_data.text", "prepare_data.sft"} <= set(stages)

    # MLflow: one nested run per stage under the flow's parent run, with step metrics read back.
    runs = {r.data.tags["posttrain.stage"]: r for r in _stage_runs(result["mlflow_run_id"])}
    assert {"prepare_data", "build_model", "pretrain", "sft", "evaluate"} <= set(runs)
    history = MlflowClient().get_metric_history(runs["sft"].info.run_id, "train/loss")
    assert len(history) >= 4
    assert history[-1].value < history[0].value
    assert runs["sft"].data.params["config.max_steps"] == "40"
    assert runs["sft"].info.run_id == manifest["mlflow_run_id"] != run_id  # nested in the flow's parent run

    # Second run: every cached stage is a Prefect cache hit, nothing is retrained or re-logged.
    started = time.time()
    state = sft_flow(tiny_config, return_state=True)
    elapsed = time.time() - started
    again = state.result()
    assert again["model"] == result["model"]
    tracking.flush()  # the flow run's last records may still be queued on the tracking writer
    assert again["accuracy_after"] == MlflowClient().get_run(run_id).data.metrics["eval/accuracy_after"]
    states = {tr.name: tr.state.name for tr in _task_runs(state.state_details.flow_run_id)}
    assert states.pop("build_model") == "Completed"  # a store lookup, deliberately not Prefect-cached
    assert set(states.values()) == {"Cached"}, states
    assert _stage_runs(again["mlflow_run_id"]) == []
    assert elapsed < 30, elapsed


def test_eval_flow_reports_the_latest_models_reusing_their_evaluations(prefect_api, ray_session, tiny_config):
    """After the sft flow: the eval flow finds its models by stage; the same model, prompts and settings are the same
    evaluate stage, so nothing is recomputed. A missing `latest:` is skipped, an unknown name fails naming the field."""
    from flows.eval import EvalFlowConfig, eval_flow
    from posttrain_core.artifacts import ArtifactStore

    store = ArtifactStore(tiny_config.store)
    evaluations = {r.key for r in store.list() if store.manifest(r)["stage"] == "evaluate"}
    assert evaluations, "runs after test_sft_flow_run_from_the_cli_trains_tracks_and_caches (same session store)"
    config = EvalFlowConfig(
        store=tiny_config.store,
        data=tiny_config.data,
        eval=tiny_config.eval,
        models=["latest:sft", "latest:build_model", "latest:rl_update"],
    )
    result = eval_flow(config)
    rows = {row["model"]: row for row in result["rows"]}
    assert set(rows) == {"latest:sft", "latest:build_model"}  # no RL model in this store: skipped
    assert rows["latest:sft"]["stage"] == "sft" and rows["latest:build_model"]["stage"] == "build_model"
    assert {r.key for r in store.list() if store.manifest(r)["stage"] == "evaluate"} == evaluations
    sft_eval = next(r for r in store.list() if r.key.startswith(rows["latest:sft"]["eval_key"]))
    assert rows["latest:sft"]["accuracy"] == round(store.manifest(sft_eval)["metrics"]["accuracy"], 4)

    with pytest.raises(ValueError, match=r"models\[1\]: 'no-such-model'"):
        eval_flow(config.model_copy(update={"models": ["latest:sft", "no-such-model"]}))


def test_sft_flow_on_user_model_folder_and_jsonl_with_lora(prefect_api, ray_session, tmp_path, tiny_inputs):
    """The Python entry point with an arbitrary HF model folder and a JSONL file of chats (LoRA, no pretraining)."""
    import json

    from flows.sft import sft_flow
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, EvalConfig, LoraConfig, ModelConfig, SFTConfig, SFTFlowConfig
    from posttrain_core.models.loading import check_model_path

    core_store, data, base = tiny_inputs
    chats = tmp_path / "chats.jsonl"
    rows = core_store.local_path(data.sft)
    from posttrain_core.data.io import read_dataset

    table = read_dataset(rows, "sft").slice(0, 120)
    with chats.open("w") as f:
        for msgs in table.column("messages").to_pylist():
            f.write(json.dumps({"prompt": msgs[0]["content"], "completion": msgs[-1]["content"]}) + "\n")

    cfg = SFTFlowConfig(
        store=str(tmp_path / "store"),
        model=ModelConfig(path=str(core_store.local_path(base))),
        data=DataConfig(train_path=str(chats), n_eval=16),
        pretrain=None,
        sft=SFTConfig(
            max_steps=6,
            global_batch_size=8,
            micro_batch_size=4,
            max_seq_len=64,
            lr=1e-2,
            warmup_steps=0,
            lora=LoraConfig(r=4, alpha=8),
            checkpoint_every=0,
        ),
        eval=EvalConfig(max_new_tokens=4),
    )
    result = sft_flow(cfg)
    store = ArtifactStore(cfg.store)
    manifest = store.manifest(result["model"])
    assert manifest["adapter"] is True
    info = check_model_path(result["model"].uri)
    assert info["is_adapter"]
    # The user's data and model folder are inputs in the lineage, fingerprinted in place.
    lineage = store.lineage(result["model"])
    externals = {m["uri"] for m in lineage if m.get("external")}
    assert str(chats) in externals and str(core_store.local_path(base)) in externals
    assert store.manifest(result["eval_after"])["num_prompts"] == 16

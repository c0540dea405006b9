"""The evaluation pipeline: held-out verifier accuracy of one or more models already in the store (or on disk).

A model is named by a reference string:
    latest:STAGE    the newest model artifact the stage STAGE published (`latest:sft`, `latest:rl_update`, ...)
    KEY             an artifact key, or a unique prefix of one (`posttrain artifacts ls` lists them)
    /path/to/model  a local Hugging Face model folder
    tinker://...    an adapter a tenant of `posttrain serve` saved (save_state, save_weights_for_sampler)

Run it on the newest SFT model of the default store (after `python -m flows.sft`):
    python -m flows.eval
or from Python:
    from flows.eval import EvalFlowConfig, eval_flow
    eval_flow(EvalFlowConfig(models=["latest:sft", "latest:rl_update"]))
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from flows import tracked
from posttrain_core import reports, tracking
from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import DataConfig, EvalConfig
from posttrain_core.models.build import LATEST, stored_model
from posttrain_core.serve.checkpoints import PREFIX as TINKER
from posttrain_core.warm import WarmGroup
from tasks.data import prepare_data
from tasks.evaluate import evaluate


class EvalFlowConfig(BaseModel):
    """Evaluate models on the held-out prompts of a data config (the same prompts the training flows evaluate on)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str | None = Field(
        None, description="artifact store root (local folder or fsspec URI). Empty: $POSTTRAIN_STORE or ./.posttrain"
    )
    experiment: str = Field("posttrain", description="MLflow experiment name")
    models: list[str] = Field(
        default_factory=lambda: ["latest:sft"],
        min_length=1,
        description="models to evaluate: 'latest:STAGE' (newest model of a stage), an artifact key or unique "
        "prefix, a local Hugging Face model folder, or a tinker:// checkpoint of `posttrain serve`",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="data whose held-out split is evaluated (cached: shared with training)"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="generation and verifier settings")


def resolve_model(store: ArtifactStore, spec: str, field: str = "models") -> ArtifactRef:
    """The model artifact a reference string names (see the module docstring).

    Raises:
        LookupError: `latest:STAGE` and that stage published no model yet (names `field` and the stages that did).
        ValueError: no artifact or folder, or more than one artifact, matches; or the match is not a model.
    """
    if spec.startswith((LATEST, TINKER)):
        try:
            return stored_model(spec, store, field)
        except FileNotFoundError as e:
            raise ValueError(f"{field}: {e}") from None
    matches = [r for r in store.list() if r.key.startswith(spec)] if len(spec) >= 6 else []
    if len(matches) == 1:
        if matches[0].kind != "model":
            raise ValueError(f"{field}: {spec!r} is a {matches[0].schema_kind} dataset, not a model")
        return matches[0]
    if len(matches) > 1:
        raise ValueError(f"{field}: key prefix {spec!r} matches {len(matches)} artifacts; give more characters")
    try:
        return store.register_external(spec, "model")
    except FileNotFoundError:
        raise ValueError(
            f"{field}: {spec!r} is neither 'latest:STAGE', an artifact key in {store.root}, nor a model folder"
        ) from None


@flow(name="eval", log_prints=True)
def eval_flow(config: EvalFlowConfig = EvalFlowConfig()) -> dict[str, Any]:  # noqa: B008 (pydantic default = UI form)
    store = ArtifactStore(config.store)
    store.check_writable()
    # Resolve every name before any work, so a typo fails in seconds with the field named. A `latest:STAGE` that
    # matches nothing is skipped (a scheduled eval of SFT and RL models on a store with only SFT runs still reports).
    specs, models = [], []
    for i, spec in enumerate(config.models):
        try:
            models.append(resolve_model(store, spec, f"models[{i}]"))
            specs.append(spec)
        except LookupError as err:
            get_run_logger().warning("skipping %s", err)
    if not models:
        raise ValueError(f"models: none of {config.models} names a model in {store.root}")
    root = str(store.root)
    with tracked("eval", config, root) as run:
        pid, warm = run.run_id, WarmGroup.process()
        data = prepare_data(config.data, root, pid)
        rows = []
        for i, (spec, model) in enumerate(zip(specs, models, strict=True)):
            ref = evaluate(config.eval, data.eval, model, f"m{i}", root, pid, warm)
            metrics = store.manifest(ref)["metrics"]
            run.log_metrics({f"eval/m{i}_accuracy": metrics["accuracy"]})
            rows.append(
                {
                    "model": spec,
                    "key": model.key[:12],
                    "stage": store.manifest(model).get("stage", "external"),
                    **{k: round(v, 4) for k, v in metrics.items() if k.startswith("accuracy")},
                    "eval_key": ref.key[:12],
                }
            )

    create_table_artifact(rows, key="eval-result", description="held-out accuracy per model")
    summary = "\n".join(
        [
            f"## posttrain eval ({config.eval.verifier}, {config.data.n_eval} held-out prompts)",
            "",
            reports.markdown_table(rows, tuple(dict.fromkeys(k for row in rows for k in row))),
            "",
            f"- MLflow run: `{pid}` (browse: `mlflow ui --backend-store-uri {tracking.tracking_uri(store.root)}`)",
        ]
    )
    create_markdown_artifact(summary, key="eval-summary", description="evaluation result")
    get_run_logger().info("\n%s", summary)
    return {"rows": rows, "mlflow_run_id": pid, "store": root}


if __name__ == "__main__":
    result = eval_flow()
    for row in result["rows"]:
        print(f"{row['model']:24s} {row['key']}  accuracy {row['accuracy']:.3f}")
    print(f"MLflow parent run: {result['mlflow_run_id']} ({tracking.tracking_uri(result['store'])})")

"""The preference pipeline: data -> base model -> (SFT) -> Bradley-Terry reward model and DPO, both from the same start.

Run it with embedded defaults (tiny model, synthetic right-vs-wrong pairs, ephemeral Prefect, local Ray and MLflow):
    python -m flows.preference
or from Python:
    from flows.preference import PreferenceFlowConfig, preference_flow
    preference_flow(PreferenceFlowConfig(sft=None, dpo={"beta": 0.2, "loss_type": "ipo"}))
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict, Field

from flows import tracked
from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactStore
from posttrain_core.config import DataConfig, DPOConfig, ModelConfig, RewardModelConfig, SFTConfig
from tasks.data import prepare_data
from tasks.models import build_model
from tasks.preference import dpo, reward_model
from tasks.train import sft


class PreferenceFlowConfig(BaseModel):
    """The preference pipeline: data -> base model -> (SFT) -> reward model and/or DPO."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str | None = Field(
        None, description="artifact store root (local folder or fsspec URI). Empty: $POSTTRAIN_STORE or ./.posttrain"
    )
    experiment: str = Field("posttrain", description="MLflow experiment name")
    data: DataConfig = Field(
        default_factory=DataConfig, description="data; the synthetic task provides the preference pairs"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="base model")
    sft: SFTConfig | None = Field(
        default_factory=SFTConfig, description="SFT before the preference stages (empty: start from the base)"
    )
    reward_model: RewardModelConfig | None = Field(
        default_factory=RewardModelConfig, description="Bradley-Terry reward model (empty: skip)"
    )
    dpo: DPOConfig | None = Field(
        default_factory=DPOConfig, description="DPO from the start model, which is also the reference (empty: skip)"
    )


@flow(name="preference", log_prints=True)
def preference_flow(config: PreferenceFlowConfig = PreferenceFlowConfig()) -> dict[str, Any]:  # noqa: B008 (UI form)
    store = ArtifactStore(config.store)
    store.check_writable()  # a store that cannot take artifacts fails here, before any work
    root = str(store.root)
    with tracked("preference", config, root) as run:
        pid = run.run_id

        data = prepare_data(config.data, root, pid)
        if data.preferences is None:
            raise ValueError("preference flow: the data has no preference pairs (only the synthetic task makes them)")
        base = build_model(config.model, data.text, root, pid)
        start = sft(config.sft, data.sft, base, root, pid) if config.sft else base
        rm = reward_model(config.reward_model, data.preferences, start, root, pid) if config.reward_model else None
        policy = dpo(config.dpo, data.preferences, start, None, root, pid) if config.dpo else None

        metrics = {}
        if rm is not None:
            metrics["rm/eval_accuracy"] = store.manifest(rm)["metrics"].get("eval_accuracy", float("nan"))
        if policy is not None:
            m = store.manifest(policy)["metrics"]
            metrics["dpo/eval_accuracy"] = m.get("eval_accuracy", float("nan"))
            metrics["dpo/eval_margin"] = m.get("eval_margin", float("nan"))
        run.log_metrics(metrics)

    summary = _summary(store, start, rm, policy, metrics, pid)
    create_markdown_artifact(summary, key="preference-summary", description="preference pipeline result")
    get_run_logger().info("\n%s", summary)
    return {"start": start, "reward_model": rm, "dpo": policy, "metrics": metrics, "mlflow_run_id": pid, "store": root}


def _summary(store: ArtifactStore, start, rm, policy, metrics: dict[str, float], run_id: str) -> str:
    lines = ["## posttrain preference result", f"- start model (RM backbone, DPO policy and reference): `{start.uri}`"]
    if rm is not None:
        lines.append(f"- reward model: held-out pairwise accuracy **{metrics['rm/eval_accuracy']:.3f}** (`{rm.uri}`)")
    if policy is not None:
        lines.append(
            f"- DPO policy: held-out reward accuracy **{metrics['dpo/eval_accuracy']:.3f}**, "
            f"mean margin **{metrics['dpo/eval_margin']:.4f}** (`{policy.uri}`)"
        )
    lines += [
        f"- artifact store: `{store.root}`",
        f"- MLflow run: `{run_id}` (browse: `mlflow ui --backend-store-uri {tracking.tracking_uri(store.root)}`)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    result = preference_flow()
    print(
        f"\n{result['metrics']}\nMLflow parent run: {result['mlflow_run_id']} ({tracking.tracking_uri(result['store'])})"
    )

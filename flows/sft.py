"""The SFT pipeline: data -> base model -> continued pretraining -> SFT -> held-out evaluation (before and after).

Run it with embedded defaults (tiny model, synthetic task, ephemeral Prefect, local Ray and MLflow):
    python -m flows.sft
or from Python with any local HF model folder and chat file:
    from flows.sft import sft_flow
    sft_flow(SFTFlowConfig(model={"path": "/models/my-llm"}, data={"train_path": "chats.jsonl"}))
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows import tracked
from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactStore
from posttrain_core.config import SFTFlowConfig
from posttrain_core.warm import WarmGroup
from tasks.data import prepare_data
from tasks.evaluate import evaluate
from tasks.models import build_model
from tasks.train import pretrain, sft


@flow(name="sft", log_prints=True)
def sft_flow(config: SFTFlowConfig = SFTFlowConfig()) -> dict[str, Any]:  # noqa: B008 (pydantic default = UI form)
    store = ArtifactStore(config.store)
    store.check_writable()  # a store that cannot take artifacts fails here, before any work
    root = str(store.root)
    with tracked("sft", config, root) as run:
        pid, warm = run.run_id, WarmGroup.process()

        data = prepare_data(config.data, root, pid)
        base = build_model(config.model, data.text, root, pid)
        start = pretrain(config.pretrain, data.text, base, root, pid) if config.pretrain else base
        model = sft(config.sft, data.sft, start, root, pid)
        before = evaluate(config.eval, data.eval, base, "base", root, pid, warm)
        after = evaluate(config.eval, data.eval, model, "sft", root, pid, warm)

        acc_before = store.manifest(before)["metrics"]["accuracy"]
        acc_after = store.manifest(after)["metrics"]["accuracy"]
        run.log_metrics({"eval/accuracy_before": acc_before, "eval/accuracy_after": acc_after})

    summary = _summary(config, store, model, acc_before, acc_after, pid)
    create_markdown_artifact(summary, key="sft-summary", description="SFT pipeline result")
    get_run_logger().info("\n%s", summary)
    return {
        "model": model,
        "eval_before": before,
        "eval_after": after,
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "mlflow_run_id": pid,
        "store": root,
    }


def _summary(config: SFTFlowConfig, store: ArtifactStore, model, before: float, after: float, run_id: str) -> str:
    uri = tracking.tracking_uri(store.root)
    return "\n".join(
        [
            "## posttrain SFT result",
            f"- held-out {config.eval.verifier}: base model **{before:.3f}** -> SFT model **{after:.3f}**",
            f"- SFT checkpoint: `{model.uri}`",
            f"- artifact store: `{store.root}`",
            f"- MLflow run: `{run_id}` (browse: `mlflow ui --backend-store-uri {uri}`)",
        ]
    )


if __name__ == "__main__":
    result = sft_flow()
    print(
        f"\nheld-out accuracy: base {result['accuracy_before']:.3f} -> SFT {result['accuracy_after']:.3f}\n"
        f"SFT model: {result['model'].uri}\nMLflow parent run: {result['mlflow_run_id']} "
        f"({tracking.tracking_uri(result['store'])})"
    )

"""The `posttrain` console script: `posttrain run CONFIG.yaml` runs a flow from a YAML config; every other
subcommand (`posttrain artifacts ...`) goes to `posttrain_core.cli`, which knows nothing of the flows.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from posttrain_core import cli as core_cli
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.env import use_results_path

# flow name -> (flow function, its pydantic config class); imported only when chosen, so a flow module that is
# missing or broken fails only that choice.
FLOWS: dict[str, tuple[str, str]] = {
    "sft": ("flows.sft:sft_flow", "posttrain_core.config:SFTFlowConfig"),
    "rlhf": ("flows.rlhf:rlhf_flow", "posttrain_core.config:RLHFFlowConfig"),
    "preference": ("flows.preference:preference_flow", "flows.preference:PreferenceFlowConfig"),
    "eval": ("flows.eval:eval_flow", "flows.eval:EvalFlowConfig"),
}
# Result fields shown first, as the run's main artifact, in this order.
MAIN_ARTIFACT = ("model", "policy", "dpo", "reward_model", "start")

DESCRIPTION = (
    "`posttrain` command: what the Prefect CLI does not do (inspect and prune the artifact store, run a flow from "
    "YAML)."
)
USAGE = (
    "    posttrain run CONFIG.yaml [--set dotted.key=value]...  validate a flow config, then run the flow\n"
    "    posttrain serve --base-model NAME=PATH [--port 8000]    tinker-compatible LoRA training service\n"
)

RUN_EPILOG = """\
The YAML file names the flow and holds its config (the same fields as the flow's Prefect UI form); fields left out
keep their defaults. Example, a tiny SFT run of about a minute on a CPU (sft-tiny.yaml):

  flow: sft                    # sft | rlhf | preference | eval
  config:
    store: ./.posttrain
    data: {n_train: 200, n_eval: 16}
    model: {size: tiny}
    pretrain: null             # skip continued pretraining
    sft: {max_steps: 10, global_batch_size: 16, micro_batch_size: 8, max_seq_len: 64}
    eval: {max_new_tokens: 4, max_prompts: 16}

  posttrain run sft-tiny.yaml --set sft.max_steps=20 --set sft.lr=1e-3

--set values are parsed as YAML (10 -> int, null -> None, [a, b] -> list); --store sets config.store. The config is
validated before anything starts (exit 2 on an invalid field, naming it); the flow then runs against $PREFECT_API_URL
if set, else an ephemeral Prefect API, and the command prints its MLflow run and artifacts.
"""


class _Fail(Exception):
    """A user error of `posttrain run` (bad file, flow or config): printed and exit status 2, nothing started."""


def _import(spec: str, flow: str) -> Any:
    module, name = spec.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise _Fail(f"flow {flow!r} is not available: cannot import {spec} ({e})") from None
    except AttributeError:
        raise _Fail(f"flow {flow!r} is not available: {module} has no {name}") from None


def _set(config: dict[str, Any], assignment: str) -> None:
    """Apply one `--set dotted.key=value` to the raw config dict (value parsed as YAML)."""
    import yaml

    path, eq, text = assignment.partition("=")
    parts = path.strip().split(".")
    if not eq or not all(parts):
        raise _Fail(f"--set {assignment!r}: expected dotted.key=value, e.g. --set sft.max_steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise _Fail(f"--set {path}: value {text!r} is not valid YAML ({e})") from None
    node = config
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise _Fail(f"--set {path}: {where} is {child!r}, not a section with fields")
        node = child
    node[parts[-1]] = value


def load_run_config(path: str, sets: list[str], store: str | None = None) -> tuple[str, Any]:
    """(flow name, validated config object) of a run file with `--set` overrides; raises `_Fail` naming the problem."""
    import yaml
    from pydantic import ValidationError

    file = Path(path)
    try:
        raw = yaml.safe_load(file.read_text())
    except OSError as e:
        raise _Fail(f"cannot read {file}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise _Fail(f"{file} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise _Fail(f"{file}: expected a mapping with `flow:` and `config:`, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"flow", "config"})
    if unknown:
        raise _Fail(f"{file}: unknown top-level field(s) {', '.join(map(repr, unknown))} (expected flow, config)")
    flow = raw.get("flow")
    if flow not in FLOWS:
        raise _Fail(f"{file}: flow: {flow!r} is not a flow; choose one of {', '.join(FLOWS)}")
    config = raw.get("config") or {}
    if not isinstance(config, dict):
        raise _Fail(f"{file}: config: expected a mapping of fields, got {config!r}")
    if store is not None:
        config["store"] = store
    for assignment in sets:
        _set(config, assignment)
    if isinstance(config.get("store"), str) and config["store"]:
        use_results_path(config["store"])  # the run's Prefect cache records go inside its store
    model = _import(FLOWS[flow][1], flow)
    try:
        return flow, model.model_validate(config)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            got = err.get("input")
            shown = f" (got {got!r})" if not isinstance(got, dict | list) and err["type"] != "missing" else ""
            lines.append(f"  {loc}: {err['msg']}{shown}")
        raise _Fail(f"{file}: invalid {flow} config ({len(lines)} error(s)):\n" + "\n".join(lines)) from None


def _run(args: argparse.Namespace) -> None:
    try:
        flow, config = load_run_config(args.config, args.set or [], args.store)
        fn = _import(FLOWS[flow][0], flow)
    except _Fail as e:
        print(f"posttrain run: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    state = fn(config, return_state=True)
    run_id = getattr(state.state_details, "flow_run_id", None)
    try:
        result = state.result()
    except Exception as e:  # the flow failed: Prefect has logged the traceback
        raise SystemExit(f"posttrain run: flow {flow} failed (flow run {run_id}): {type(e).__name__}: {e}") from None
    print(_summary(flow, run_id, result))


def _summary(flow: str, run_id: Any, result: Any) -> str:
    lines = [f"flow {flow} finished (Prefect flow run {run_id})"]
    if not isinstance(result, dict):
        return "\n".join([*lines, f"result: {result!r}"])
    if result.get("mlflow_run_id"):
        lines.append(f"MLflow run: {result['mlflow_run_id']}")
    refs = {k: v for k, v in result.items() if isinstance(v, ArtifactRef)}
    main = next((k for k in MAIN_ARTIFACT if k in refs), next(iter(refs), None))
    if main is not None:
        lines.append(f"main artifact ({main}): {refs[main].key[:12]}  {refs[main].uri}")
    for name, ref in refs.items():
        if name != main:
            lines.append(f"{name}: {ref.key[:12]}  {ref.uri}")
    for name, value in result.items():
        if isinstance(value, bool | int | float | str) and name != "mlflow_run_id":
            lines.append(f"{name}: {round(value, 4) if isinstance(value, float) else value}")
        elif isinstance(value, dict) and value and all(isinstance(v, int | float) for v in value.values()):
            lines.append(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in value.items()))
    return "\n".join(lines)


def _add_run(subparsers: Any) -> None:
    run = core_cli.add_subcommand(
        subparsers,
        "run",
        help="validate a flow config (YAML) and run the flow",
        description="Run a flow (sft, rlhf, preference, eval) with a config read from a YAML file.",
        epilog=RUN_EPILOG,
    )
    run.add_argument("config", metavar="CONFIG.yaml", help="YAML file: `flow: NAME` and `config: {...}`")
    run.add_argument(
        "--set", action="append", metavar="dotted.key=value", help="override one config field (repeatable)"
    )


def _add_more(subparsers: Any) -> None:
    from posttrain_core.serve.app import add_parser

    _add_run(subparsers)
    add_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    args = core_cli.build_parser(DESCRIPTION, core_cli.USAGE + USAGE, _add_more).parse_args(argv)
    if args.command == "serve":
        from posttrain_core.serve.app import main as serve_main

        serve_main(args)
        return 0
    if args.command != "run":
        return core_cli.main(argv)
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

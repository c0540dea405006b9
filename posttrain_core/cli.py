"""`posttrain` command: what the Prefect CLI does not do (inspect and prune the artifact store, run a flow from YAML).

    posttrain artifacts ls [--kind K] [--stage S]          complete artifacts, oldest first
    posttrain artifacts show KEY                           an artifact's manifest (KEY: a key or a unique prefix)
    posttrain artifacts lineage KEY                        the chain of stages that produced an artifact
    posttrain artifacts sweep [--max-age-s S]              remove leftovers of crashed publishes and deletes
    posttrain artifacts gc --keep-last N [--stage S] [--dry-run]
                                                           delete all but the N newest artifacts of each stage
                                                           (and their lineage)
    posttrain run CONFIG.yaml [--set dotted.key=value]...  validate a flow config, then run the flow

`--store` (before or after the subcommand) names the store; default $POSTTRAIN_STORE, else ./.posttrain.
Deployments, schedules and flow-run history stay with Prefect (`prefect deployment run ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain_core.artifacts import KINDS, ArtifactRef, ArtifactStore

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

GC_EPILOG = """\
Artifacts are grouped by their manifest's `stage`; in each group (or only in --stage S) the N newest by `created`
are kept, and so is every artifact in the lineage of a kept one (never the data or base model of a kept model).
The outputs of one prepare_data run (prepare_data.sft, .eval, .text, ...) are kept or deleted together. A key whose
build lock is held (a build running on this machine) is skipped, with its lineage. A later run of a flow that needs
a deleted artifact rebuilds it (its Prefect cache record is not reused).
"""


class _Fail(Exception):
    """A user error of `posttrain run` (bad file, flow or config): printed and exit status 2, nothing started."""


# ------------------------------------------------------------------------------------------------ artifacts
def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _size(manifest: Mapping[str, Any]) -> int:
    return sum(int(f.get("size", 0)) for f in manifest.get("files") or [])


def _created(manifest: Mapping[str, Any]) -> str:
    return str(manifest.get("created") or "")


def _find(store: ArtifactStore, prefix: str) -> ArtifactRef:
    matches = [r for r in store.list() if r.key.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        deleted = ""
        with contextlib.suppress(ValueError):
            if store.generation(prefix):
                deleted = " (it was deleted, e.g. by `posttrain artifacts gc`)"
        raise SystemExit(f"posttrain: no artifact matches key {prefix!r} in {store.root}{deleted}")
    shown = ", ".join(r.key[:16] for r in matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise SystemExit(f"posttrain: {len(matches)} artifacts match key prefix {prefix!r} in {store.root}: {shown}")


def _entries(store: ArtifactStore) -> dict[str, dict[str, Any]]:
    """key -> manifest of every complete artifact."""
    return {ref.key: store.manifest(ref) for ref in store.list()}


def cmd_ls(store: ArtifactStore, kind: str | None, stage: str | None) -> None:
    rows = []
    for ref in store.list(kind):  # type: ignore[arg-type]
        m = store.manifest(ref)
        if stage is None or m.get("stage") == stage:
            rows.append((_created(m), ref, m))
    rows.sort(key=lambda row: (row[0], row[1].key))
    width = max([len("STAGE"), *(len(str(m.get("stage", "-"))) for _, _, m in rows)])
    print(f"{'KEY':12s}  {'KIND':7s}  {'SCHEMA':15s}  {'STAGE':{width}s}  {'SIZE':>10s}  {'CREATED (UTC)':19s}  URI")
    for created, ref, m in rows:
        print(
            f"{ref.key[:12]:12s}  {ref.kind:7s}  {(ref.schema_kind or '-'):15s}  {str(m.get('stage', '-')):{width}s}  "
            f"{_human(_size(m)):>10s}  {created[:19].replace('T', ' '):19s}  {ref.uri}"
        )
    total = sum(_size(m) for _, _, m in rows)
    print(f"{len(rows)} artifacts, {_human(total)}", file=sys.stderr)


@dataclass
class GcPlan:
    """What `gc` keeps and deletes; `kept` maps each kept key to why."""

    entries: dict[str, dict[str, Any]]
    kept: dict[str, str]
    delete: list[str]  # in deletion order: children before their inputs, outputs of one run together


def plan_gc(entries: dict[str, dict[str, Any]], keep_last: int, stage: str | None = None) -> GcPlan:
    """Keep the `keep_last` newest artifacts (by manifest `created`) of each stage, or only of `stage` (the others
    are all kept), plus the lineage of every kept artifact; delete the rest."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key, m in entries.items():
        groups[str(m.get("stage") or "-")].append(key)
    if stage is not None and stage not in groups:
        known = ", ".join(sorted(groups)) or "none"
        raise SystemExit(f"posttrain: no artifact of stage {stage!r} in the store (stages: {known})")
    kept: dict[str, str] = {}
    for name, keys in groups.items():
        keys.sort(key=lambda k: (_created(entries[k]), k), reverse=True)
        if stage is not None and name != stage:
            kept.update((k, "other stage") for k in keys)
        else:
            kept.update((k, f"{i + 1}. newest of {name}") for i, k in enumerate(keys[:keep_last]))
    graph = _Graph(entries)
    for key in list(kept):
        for dep, why in graph.closure(key):
            kept.setdefault(dep, why)
    doomed = [k for k in entries if k not in kept]
    return GcPlan(entries, kept, graph.deletion_order(doomed))


class _Graph:
    """The lineage links between the complete artifacts of a store: inputs, and the sibling outputs of one
    multi-output stage run (`prepare_data.sft`, `.eval`, ... share stage prefix, config and inputs)."""

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        self.entries = entries
        self.inputs: dict[str, list[str]] = {}
        families: dict[str, list[str]] = defaultdict(list)
        self.family: dict[str, str] = {}
        for key, m in entries.items():
            self.inputs[key] = [
                item["key"] for item in m.get("inputs") or [] if isinstance(item, dict) and item.get("key") in entries
            ]
            name = str(m.get("stage") or "")
            if "." in name:
                fid = json.dumps([name.split(".")[0], m.get("config"), m.get("inputs")], sort_keys=True, default=str)
                families[fid].append(key)
                self.family[key] = fid
        self.siblings = {key: families[fid] for key, fid in self.family.items()}

    def _label(self, key: str) -> str:
        return f"{key[:12]} ({self.entries[key].get('stage', '-')})"

    def closure(self, key: str) -> Iterable[tuple[str, str]]:
        """(artifact, why) for every artifact `key` needs: its inputs, recursively, and siblings of each."""
        seen = {key}
        stack = [key]
        while stack:
            current = stack.pop()
            links = [(k, f"same run as {self._label(current)}") for k in self.siblings.get(current, [])]
            links += [(k, f"input of {self._label(current)}") for k in self.inputs[current]]
            for dep, why in links:
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
                    yield dep, why

    def units(self, keys: Iterable[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            out[self.family.get(key, key)].append(key)
        return out

    def deletion_order(self, keys: list[str]) -> list[str]:
        """`keys` with every artifact before its inputs and siblings adjacent (newest first among the free ones), so
        that an interrupted gc never leaves an artifact without its lineage."""
        units = self.units(keys)
        unit_of = {k: u for u, members in units.items() for k in members}
        parents = {u: {unit_of[p] for k in ms for p in self.inputs[k] if p in unit_of} - {u} for u, ms in units.items()}
        children = Counter(p for ps in parents.values() for p in ps)
        newest = {u: max((_created(self.entries[k]), k) for k in ms) for u, ms in units.items()}
        order: list[str] = []
        ready = [u for u in units if children[u] == 0]
        while ready:
            ready.sort(key=lambda u: newest[u])
            unit = ready.pop()  # the newest
            order.append(unit)
            for p in parents[unit]:
                children[p] -= 1
                if children[p] == 0:
                    ready.append(p)
        order += [u for u in units if u not in order]  # a cycle cannot happen (keys digest inputs); be total anyway
        return [k for u in order for k in sorted(units[u])]


def cmd_gc(store: ArtifactStore, keep_last: int, stage: str | None, dry_run: bool) -> None:
    from posttrain_core.stage import try_build_lock

    plan = plan_gc(_entries(store), keep_last, stage)
    entries, graph = plan.entries, _Graph(plan.entries)
    scope = f"stage {stage}" if stage else "each stage"
    print(f"{store.root}: keeping the {keep_last} newest of {scope} and their lineage{' (dry run)' if dry_run else ''}")
    for key, why in sorted(plan.kept.items(), key=lambda kv: (str(entries[kv[0]].get("stage")), kv[0])):
        if why.startswith(("input of", "same run as")):
            print(f"keep    {key[:12]}  {entries[key].get('stage', '-')}: {why}")
    protected: dict[str, str] = {}
    deleted, freed, skipped = [], 0, []
    for members in graph.units(plan.delete).values():
        with contextlib.ExitStack() as locks:
            if not any(k in protected for k in members):
                for key in members:
                    if not locks.enter_context(try_build_lock(store, key)):
                        protected[key] = "locked by a running build"
                        for dep, why in graph.closure(key):
                            protected.setdefault(dep, f"{why}, which is locked")
                        break
            if any(k in protected for k in members):
                skipped += members
                for key in members:
                    print(f"skip    {key[:12]}  {entries[key].get('stage', '-')}: {protected[key]}")
                continue
            for key in members:
                m = entries[key]
                line = f"{key[:12]}  {m.get('stage', '-')}  {_created(m)[:19].replace('T', ' ')}  {_human(_size(m))}"
                if dry_run:
                    print(f"would delete  {line}")
                elif store.delete(key):
                    print(f"deleted {line}")
                else:
                    continue
                deleted.append(key)
                freed += _size(m)
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {len(deleted)} artifacts ({_human(freed)}); kept {len(plan.kept)}"
        + (f"; skipped {len(skipped)} (locked by a running build, or its lineage)" if skipped else "")
        + ("; nothing was deleted (dry run)" if dry_run else "")
    )


def _artifacts(args: argparse.Namespace) -> None:
    store = ArtifactStore(args.store)
    try:
        if args.action == "ls":
            cmd_ls(store, args.kind, args.stage)
        elif args.action == "show":
            print(json.dumps(store.manifest(_find(store, args.key)), indent=2))
        elif args.action == "lineage":
            for m in store.lineage(_find(store, args.key)):
                label = "external " + m["uri"] if m.get("external") else f"{m.get('stage')}  {m['key'][:12]}"
                print(label)
        elif args.action == "sweep":
            print(f"removed {store.sweep(args.max_age_s)} temporary folders")
        elif args.action == "gc":
            cmd_gc(store, args.keep_last, args.stage, args.dry_run)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        raise SystemExit(f"posttrain artifacts {args.action}: {e}") from None


# ------------------------------------------------------------------------------------------------------ run
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
    _results_in_store(config.get("store"))
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


def _results_in_store(store: Any) -> None:
    """Prefect's task-result records (the stage cache) go inside the run's store, as for the default store
    (`env.apply_defaults`), unless set already; must run before Prefect is imported to take effect."""
    if isinstance(store, str) and store and ("://" not in store or store.startswith("file://")):
        root = store.removeprefix("file://")
        os.environ.setdefault(
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(os.path.abspath(root), "prefect-results")
        )


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


# ----------------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    store_help = "store root: local folder or fsspec URI (default: $POSTTRAIN_STORE, else ./.posttrain)"
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="posttrain", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=fmt
    )
    parser.add_argument("--store", default=None, help=store_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{artifacts,run}")

    art = sub.add_parser("artifacts", help="inspect and prune the artifact store", parents=[common])
    acts = art.add_subparsers(dest="action", required=True)
    ls = acts.add_parser("ls", help="list complete artifacts, oldest first", parents=[common])
    ls.add_argument("--kind", choices=KINDS)
    ls.add_argument("--stage", help="only artifacts of this stage (manifest `stage`, e.g. sft, prepare_data.eval)")
    show = acts.add_parser("show", help="print an artifact's manifest", parents=[common])
    show.add_argument("key", help="artifact key or a unique prefix")
    lineage = acts.add_parser("lineage", help="print the chain of stages that produced an artifact", parents=[common])
    lineage.add_argument("key", help="artifact key or a unique prefix")
    sweep = acts.add_parser(
        "sweep", help="remove temporary folders left by crashed publishes (and crashed deletes)", parents=[common]
    )
    sweep.add_argument("--max-age-s", type=float, default=3600, help="only publish leftovers this old (default 3600)")
    gc = acts.add_parser(
        "gc",
        help="delete all but the N newest artifacts of each stage, keeping their lineage",
        description="Delete old artifacts.",
        epilog=GC_EPILOG,
        formatter_class=fmt,
        parents=[common],
    )
    gc.add_argument("--keep-last", type=_count, required=True, metavar="N", help="artifacts to keep per stage")
    gc.add_argument("--stage", help="prune only this stage (others are kept whole)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")

    run = sub.add_parser(
        "run",
        help="validate a flow config (YAML) and run the flow",
        description="Run a flow (sft, rlhf, preference, eval) with a config read from a YAML file.",
        epilog=RUN_EPILOG,
        formatter_class=fmt,
        parents=[common],
    )
    run.add_argument("config", metavar="CONFIG.yaml", help="YAML file: `flow: NAME` and `config: {...}`")
    run.add_argument(
        "--set", action="append", metavar="dotted.key=value", help="override one config field (repeatable)"
    )
    return parser


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "artifacts":
        _artifacts(args)
    else:
        _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`posttrain artifacts ...` and `posttrain models import`: the artifact store (what the Prefect CLI does not do).

The `posttrain` console script is `flows.cli:main`, which adds `posttrain run` and hands the rest to `main` here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

from posttrain_core.artifacts import KINDS, ArtifactRef, ArtifactStore
from posttrain_core.artifacts.gc import created, plan_gc, run_gc
from posttrain_core.artifacts.manifest import content_bytes

DESCRIPTION = "`posttrain` command: what the Prefect CLI does not do (inspect and prune the artifact store)."
USAGE = """\
    posttrain artifacts ls [--kind K] [--stage S]          complete artifacts, oldest first
    posttrain artifacts show KEY                           an artifact's manifest (KEY: a key or a unique prefix)
    posttrain artifacts lineage KEY                        the chain of stages that produced an artifact
    posttrain artifacts sweep [--max-age-s S]              remove leftovers of crashed publishes and deletes
    posttrain models import FILE.gguf                      publish a GGUF model as a model artifact (once per file)
    posttrain artifacts gc --keep-last N [--stage S] [--dry-run]
                                                           delete all but the N newest artifacts of each stage
                                                           (and their lineage)
"""
NOTES = """\
`--store` (before or after the subcommand) names the store; default $POSTTRAIN_STORE, else ./.posttrain.
Deployments, schedules and flow-run history stay with Prefect (`prefect deployment run ...`).
"""
STORE_HELP = "store root: local folder or fsspec URI (default: $POSTTRAIN_STORE, else ./.posttrain)"

GC_EPILOG = """\
Artifacts are grouped by their manifest's `stage`; in each group (or only in --stage S) the N newest by `created`
are kept, and so is every artifact in the lineage of a kept one (never the data or base model of a kept model).
The outputs of one prepare_data run (prepare_data.sft, .eval, .text, ...) are kept or deleted together. A key whose
build lock is held (a build running on this machine) is skipped, with its lineage. A later run of a flow that needs
a deleted artifact rebuilds it (its Prefect cache record is not reused).
"""


# ------------------------------------------------------------------------------------------------ artifacts
def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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


def cmd_ls(store: ArtifactStore, kind: str | None, stage: str | None) -> None:
    rows = []
    for ref in store.list(kind):  # type: ignore[arg-type]
        m = store.manifest(ref)
        if stage is None or m.get("stage") == stage:
            rows.append((created(m), ref, m))
    rows.sort(key=lambda row: (row[0], row[1].key))
    width = max([len("STAGE"), *(len(str(m.get("stage", "-"))) for _, _, m in rows)])
    print(f"{'KEY':12s}  {'KIND':7s}  {'SCHEMA':15s}  {'STAGE':{width}s}  {'SIZE':>10s}  {'CREATED (UTC)':19s}  URI")
    for when, ref, m in rows:
        print(
            f"{ref.key[:12]:12s}  {ref.kind:7s}  {(ref.schema_kind or '-'):15s}  {str(m.get('stage', '-')):{width}s}  "
            f"{_human(content_bytes(m)):>10s}  {when[:19].replace('T', ' '):19s}  {ref.uri}"
        )
    total = sum(content_bytes(m) for _, _, m in rows)
    print(f"{len(rows)} artifacts, {_human(total)}", file=sys.stderr)


def cmd_gc(store: ArtifactStore, keep_last: int, stage: str | None, dry_run: bool) -> None:
    try:
        plan = plan_gc({ref.key: store.manifest(ref) for ref in store.list()}, keep_last, stage)
    except ValueError as e:
        raise SystemExit(f"posttrain: {e}") from None
    entries = plan.entries
    scope = f"stage {stage}" if stage else "each stage"
    print(f"{store.root}: keeping the {keep_last} newest of {scope} and their lineage{' (dry run)' if dry_run else ''}")
    for key, why in sorted(plan.kept.items(), key=lambda kv: (str(entries[kv[0]].get("stage")), kv[0])):
        if why.startswith(("input of", "same run as")):
            print(f"keep    {key[:12]}  {entries[key].get('stage', '-')}: {why}")
    deleted, freed, skipped = 0, 0, 0
    for step in run_gc(store, plan, dry_run):
        m = entries[step.key]
        if step.skipped is not None:
            skipped += 1
            print(f"skip    {step.key[:12]}  {m.get('stage', '-')}: {step.skipped}")
            continue
        line = f"{step.key[:12]}  {m.get('stage', '-')}  {created(m)[:19].replace('T', ' ')}  {_human(content_bytes(m))}"
        print(f"would delete  {line}" if dry_run else f"deleted {line}")
        deleted += 1
        freed += content_bytes(m)
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {deleted} artifacts ({_human(freed)}); kept {len(plan.kept)}"
        + (f"; skipped {skipped} (locked by a running build, or its lineage)" if skipped else "")
        + ("; nothing was deleted (dry run)" if dry_run else "")
    )
    if not store.is_local and not dry_run:  # this machine's copies (each node trims its own as it downloads)
        from posttrain_core.artifacts.cache import trim

        report = trim(store)
        print(
            f"local cache {store.cache_root}: removed {len(report.deleted_in_store)} copies of deleted artifacts, "
            f"{len(report.interrupted)} interrupted downloads, evicted {len(report.evicted)}; {_human(report.kept_bytes)} kept"
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


# ----------------------------------------------------------------------------------------------------- main
def add_subcommand(subparsers: Any, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand (or an `artifacts` action) that also takes `--store` after its name; its description and epilog
    are printed as written."""
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--store", default=argparse.SUPPRESS, help=STORE_HELP)
    fmt = argparse.RawDescriptionHelpFormatter
    return subparsers.add_parser(name, help=help, parents=[store], formatter_class=fmt, **kwargs)


def build_parser(
    description: str = DESCRIPTION, usage: str = USAGE, more: Callable[[Any], None] | None = None
) -> argparse.ArgumentParser:
    """The `posttrain` parser with the `artifacts` subcommands; `more(subparsers)` adds others (`flows.cli`: run)."""
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description=description,
        epilog=f"{usage}\n{NOTES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", default=None, help=STORE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    art = add_subcommand(sub, "artifacts", help="inspect and prune the artifact store")
    acts = art.add_subparsers(dest="action", required=True)
    ls = add_subcommand(acts, "ls", help="list complete artifacts, oldest first")
    ls.add_argument("--kind", choices=KINDS)
    ls.add_argument("--stage", help="only artifacts of this stage (manifest `stage`, e.g. sft, prepare_data.eval)")
    show = add_subcommand(acts, "show", help="print an artifact's manifest")
    show.add_argument("key", help="artifact key or a unique prefix")
    lineage = add_subcommand(acts, "lineage", help="print the chain of stages that produced an artifact")
    lineage.add_argument("key", help="artifact key or a unique prefix")
    sweep = add_subcommand(
        acts, "sweep", help="remove temporary folders left by crashed publishes (and crashed deletes)"
    )
    sweep.add_argument("--max-age-s", type=float, default=3600, help="only publish leftovers this old (default 3600)")
    gc = add_subcommand(
        acts,
        "gc",
        help="delete all but the N newest artifacts of each stage, keeping their lineage",
        description="Delete old artifacts.",
        epilog=GC_EPILOG,
    )
    gc.add_argument("--keep-last", type=_count, required=True, metavar="N", help="artifacts to keep per stage")
    gc.add_argument("--stage", help="prune only this stage (others are kept whole)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    models = add_subcommand(sub, "models", help="bring a model into the store")
    macts = models.add_subparsers(dest="action", required=True)
    imp = add_subcommand(
        macts, "import", help="dequantise a .gguf file into a model artifact (a cache hit for bytes seen before)"
    )
    imp.add_argument("file", metavar="FILE.gguf")
    if more is not None:
        more(sub)
    return parser


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return n


def _models(args: argparse.Namespace) -> None:
    from posttrain_core.models.gguf import import_gguf

    store = ArtifactStore(args.store)
    try:
        ref = import_gguf(args.file, store)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"posttrain models import: {e}") from None
    print(f"{ref.key}  {ref.uri}")
    print(f"use it as model.path: {ref.uri}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _models(args) if args.command == "models" else _artifacts(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

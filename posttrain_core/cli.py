"""`posttrain` command: inspect the artifact store (list, show a manifest, walk lineage, sweep temporary folders).

Pipelines run through Prefect (`python -m flows.sft`, `prefect deployment run ...`); this is for looking at results.
"""

from __future__ import annotations

import argparse
import json
import sys

from posttrain_core.artifacts import ArtifactStore


def _find(store: ArtifactStore, prefix: str):
    matches = [r for r in store.list() if r.key.startswith(prefix)]
    if len(matches) != 1:
        raise SystemExit(f"posttrain: {len(matches)} artifacts match key prefix {prefix!r} in {store.root}")
    return matches[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store root (default: $POSTTRAIN_STORE or ./.posttrain)")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list complete artifacts")
    ls.add_argument("--kind", choices=["dataset", "model"])
    show = sub.add_parser("show", help="print an artifact's manifest")
    show.add_argument("key", help="artifact key or a unique prefix")
    lineage = sub.add_parser("lineage", help="print the chain of stages that produced an artifact")
    lineage.add_argument("key")
    sweep = sub.add_parser("sweep", help="remove temporary folders left by crashed publishes")
    sweep.add_argument("--max-age-s", type=float, default=3600)
    args = parser.parse_args(argv)

    store = ArtifactStore(args.store)
    if args.command == "ls":
        for ref in sorted(store.list(args.kind), key=lambda r: store.manifest(r).get("created", "")):
            m = store.manifest(ref)
            print(
                f"{ref.key[:12]}  {ref.kind:7s}  {(ref.schema_kind or '-'):11s}  {m.get('stage', '-'):22s}  "
                f"{m.get('created', '')}  {ref.uri}"
            )
    elif args.command == "show":
        print(json.dumps(store.manifest(_find(store, args.key)), indent=2))
    elif args.command == "lineage":
        for m in store.lineage(_find(store, args.key)):
            label = "external " + m["uri"] if m.get("external") else f"{m.get('stage')}  {m['key'][:12]}"
            print(label)
    elif args.command == "sweep":
        print(f"removed {store.sweep(args.max_age_s)} temporary folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())

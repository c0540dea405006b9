"""Garbage collection of a store: which artifacts to keep (the newest per stage and their lineage), in which order
to delete the rest, and the deletion itself under the build locks. No printing: `posttrain artifacts gc` reports.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain_core.artifacts.store import ArtifactStore


def created(manifest: Mapping[str, Any]) -> str:
    """A manifest's creation time (ISO 8601, UTC), the order of "newest"; "" when absent."""
    return str(manifest.get("created") or "")


@dataclass
class GcPlan:
    """What `gc` keeps and deletes; `kept` maps each kept key to why."""

    entries: dict[str, dict[str, Any]]
    kept: dict[str, str]
    delete: list[str]  # in deletion order: children before their inputs, outputs of one run together


@dataclass(frozen=True)
class GcStep:
    """One artifact of a plan's `delete` list, handled: deleted (or would be, in a dry run), or skipped and why."""

    key: str
    skipped: str | None = None


def plan_gc(entries: dict[str, dict[str, Any]], keep_last: int, stage: str | None = None) -> GcPlan:
    """Keep the `keep_last` newest artifacts (by manifest `created`) of each stage, or only of `stage` (the others
    are all kept), plus the lineage of every kept artifact; delete the rest.

    Args:
        entries: key -> manifest of every complete artifact of the store.

    Raises:
        ValueError: no artifact of `stage` (names the stages there are).
    """
    groups: dict[str, list[str]] = defaultdict(list)
    for key, m in entries.items():
        groups[str(m.get("stage") or "-")].append(key)
    if stage is not None and stage not in groups:
        known = ", ".join(sorted(groups)) or "none"
        raise ValueError(f"no artifact of stage {stage!r} in the store (stages: {known})")
    kept: dict[str, str] = {}
    for name, keys in groups.items():
        keys.sort(key=lambda k: (created(entries[k]), k), reverse=True)
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


def run_gc(store: ArtifactStore, plan: GcPlan, dry_run: bool = False) -> Iterator[GcStep]:
    """Delete `plan.delete` one unit (the outputs of one run) at a time, holding the build locks of its keys.

    A unit with a key whose build lock is taken (a build running on this machine) is skipped, and so is the lineage
    of that key. Yields a step per artifact deleted (in a dry run: that would be) or skipped; an artifact that a
    concurrent delete removed first yields nothing.
    """
    from posttrain_core.stage import try_build_lock  # the stage module builds on this package

    graph = _Graph(plan.entries)
    protected: dict[str, str] = {}
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
                yield from (GcStep(key, protected[key]) for key in members)
                continue
            for key in members:
                if dry_run or store.delete(key):
                    yield GcStep(key)


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
        newest = {u: max((created(self.entries[k]), k) for k in ms) for u, ms in units.items()}
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

"""The flow's machine in the two-node tests: run the rlhf flow on the cluster in $RAY_ADDRESS, then ask the other node
what it can see. Usage: python cluster_driver.py CONFIG_JSON RESULT_JSON [PATH ...]; the PATHs are the flow machine's
folders (store staging, cache, session) that the other node must not be able to open."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def probe(paths: list[str]) -> dict:
    """On the node it runs on: which of `paths` exist there, and what its own cache of the store holds."""
    import ray

    from posttrain_core.env import setting

    cache = Path(setting("POSTTRAIN_CACHE_DIR") or "~/.cache/posttrain").expanduser() / "cache"
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "visible": {p: os.path.exists(p) for p in paths},
        "cache": str(cache),
        "cached": cached(cache),
    }


def cached(cache: Path) -> dict[str, int]:
    """key -> bytes of each artifact copy in a cache folder."""
    if not cache.is_dir():
        return {}
    return {
        copy.name: sum(f.stat().st_size for f in copy.rglob("*") if f.is_file())
        for copy in cache.iterdir()
        if not copy.name.startswith(".")
    }


def main() -> None:
    import ray

    from flows.rlhf import rlhf_flow
    from posttrain_core.cluster import connect
    from posttrain_core.config import RLHFFlowConfig

    cfg = RLHFFlowConfig.model_validate_json(sys.argv[1])
    connect()
    head = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    print(f"CLUSTER head {head} others {others}", flush=True)
    started = time.time()
    result = rlhf_flow(cfg)
    wall = time.time() - started
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from posttrain_core.artifacts import ArtifactStore

    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    task = ray.remote(num_cpus=0)(probe)
    probes = []
    for node in [*alive, head]:
        where = NodeAffinitySchedulingStrategy(node, soft=False)
        try:
            probes.append(ray.get(task.options(scheduling_strategy=where).remote(sys.argv[3:]), timeout=60))
        except Exception as err:  # a node lost during the run, not yet declared dead by Ray
            probes.append({"node": node, "error": f"{type(err).__name__}: {err}"[:300], "cache": "", "cached": {}})
    store = ArtifactStore(cfg.store)
    artifacts = {
        ref.key: {"stage": m.get("stage"), "bytes": sum(f["size"] for f in m.get("files", []))}
        for ref in store.list()
        for m in [store.manifest(ref)]
    }
    out = {
        "digest": result["policy"].digest,
        "policy": result["policy"].key,
        "wall_s": wall,
        "curve_png": result["curve_png"],
        "probes": probes[:-1],  # the other nodes
        "head": probes[-1],
        "driver_cache": str(store.cache_root),
        "driver_cached": cached(store.cache_root),
        "artifacts": artifacts,
    }
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()

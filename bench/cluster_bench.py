"""What a cluster without a shared folder costs: the rlhf flow (SFT, then GRPO with 2 update ranks, hf engine) on

- `1 node, local store`: one machine, the store a local folder (the default setup);
- `1 node, S3 store`: one machine, the store on an S3 API (`tests/s3_server.py`, 127.0.0.1);
- `2 nodes, S3 store`: a head and a worker node that share no folder (`tests/ray_nodes.py`: the worker node in a
  mount namespace of its own), the ranks dealt over both.

Same config and seeds in every setup, so the final policy digests must be equal (checked). Prints the flow's wall time
per setup and seed with its ratio to the one-node local run, and the bytes each RL iteration moved: uploaded to the
store (its rollouts, scores and update artifacts) and downloaded into the nodes' caches (the flow machine's and every
node's). Usage: python -m bench.cluster_bench [--seeds 0,1] [--iterations 3] [--engine hf|vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the harness the tests use: an S3 server, a two-node cluster

ITERATION_STAGES = ("rollout", "score", "rl_update")


def config(store: str, seed: int, iterations: int, engine: str = "hf"):
    from posttrain_core.config import (
        DataConfig,
        EvalConfig,
        ModelConfig,
        RLConfig,
        RLHFFlowConfig,
        RolloutConfig,
        ScoreConfig,
        SFTConfig,
    )

    return RLHFFlowConfig(
        store=store,
        data=DataConfig(n_train=200, n_eval=16, seed=seed),
        model=ModelConfig(size="tiny"),
        pretrain=None,
        sft=SFTConfig(
            max_steps=10,
            global_batch_size=16,
            micro_batch_size=8,
            max_seq_len=64,
            log_every=5,
            warmup_steps=2,
            seed=seed,
        ),
        iterations=iterations,
        rollout=RolloutConfig(n=4, max_prompts=16, max_tokens=8, num_engines=2, batch_size=8, seed=seed, engine=engine),
        score=ScoreConfig(verifiers={"regex": 1.0, "exact_match": 0.0}, regex="[0-9]"),
        rl=RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8, mini_batches=2, num_workers=2, seed=seed),
        eval=EvalConfig(max_new_tokens=4, num_engines=1, engine=engine),
        eval_samples=0,
    )


def drive(cfg, env: dict[str, str], work: Path, name: str) -> dict:
    result = work / f"{name}.json"
    cmd = [sys.executable, str(REPO / "tests" / "cluster_driver.py"), cfg.model_dump_json(), str(result)]
    with (work / f"{name}.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"{name} failed: see {work / name}.log")
    return json.loads(result.read_text())


def traffic(run: dict, iterations: int) -> tuple[float, float]:
    """(MB uploaded, MB downloaded) per RL iteration."""
    arts = run["artifacts"]
    up = sum(a["bytes"] for a in arts.values() if a["stage"] in ITERATION_STAGES)
    caches = {run["driver_cache"]: run["driver_cached"]}  # by folder: on one node the driver's is the workers'
    caches |= {p["cache"]: p["cached"] for p in [run["head"], *run["probes"]]}
    down = sum(b for c in caches.values() for k, b in c.items() if arts.get(k, {}).get("stage") in ITERATION_STAGES)
    return up / iterations / 1e6, down / iterations / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout and evaluation engine")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    from ray_nodes import two_nodes
    from s3_server import s3_server

    work = Path(tempfile.mkdtemp(prefix="ptcb-", dir="/tmp"))
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base.update(PYTHONPATH=str(REPO), POSTTRAIN_CODE_VERSION="cluster-bench")
    rows: dict[str, list[dict]] = {}
    with s3_server(work / "s3.log") as s3:
        env = base | {k: v for k, v in s3.items() if k != "bucket"}
        for seed in seeds:
            name = f"seed{seed}"
            own = {
                "MLFLOW_TRACKING_URI": f"sqlite:///{work}/{name}-mlflow.db",
                "PREFECT_HOME": str(work / f"{name}-pf"),
            }
            runs = {
                "1 node, local store": (
                    env | own | {"POSTTRAIN_CACHE_DIR": str(work / f"{name}-c1")},
                    str(work / f"{name}-store"),
                ),
                "1 node, S3 store": (
                    env | own | {"POSTTRAIN_CACHE_DIR": str(work / f"{name}-c2")},
                    f"s3://{s3['bucket']}/{uuid.uuid4().hex}",
                ),
            }
            for i, (setup, (run_env, store)) in enumerate(runs.items()):
                rows.setdefault(setup, []).append(
                    drive(config(store, seed, args.iterations, args.engine), run_env, work, f"{name}-{i}")
                )
                print(f"{setup} seed {seed}: {rows[setup][-1]['wall_s']:.1f} s", flush=True)
            setup = "2 nodes, S3 store"
            with two_nodes(work, env | own, work / f"{name}-head") as nodes:
                run_env = nodes.env | {"POSTTRAIN_CACHE_DIR": str(work / f"{name}-c3")}
                store = f"s3://{s3['bucket']}/{uuid.uuid4().hex}"
                cfg = config(store, seed, args.iterations, args.engine)
                rows.setdefault(setup, []).append(drive(cfg, run_env, work, name))
            print(f"{setup} seed {seed}: {rows[setup][-1]['wall_s']:.1f} s", flush=True)
    for i, seed in enumerate(seeds):
        digests = {setup: runs[i]["digest"] for setup, runs in rows.items()}
        assert len(set(digests.values())) == 1, (seed, digests)
    ref = rows["1 node, local store"]
    print(f"\nrlhf flow: SFT 10 steps, {args.iterations} GRPO iterations of 16 prompts x 4, 2 update ranks, 2 {args.engine} engines;"
          f" seeds {seeds}; same final digests in every setup")  # fmt: skip
    print(f"{'setup':<22} {'wall s (per seed)':<22} {'vs 1 node local':>16} {'MB up/iter':>11} {'MB down/iter':>13}")
    for setup, runs in rows.items():
        walls = [r["wall_s"] for r in runs]
        ratio = statistics.mean(r["wall_s"] / b["wall_s"] for r, b in zip(runs, ref, strict=True))
        up, down = (statistics.mean(x) for x in zip(*(traffic(r, args.iterations) for r in runs), strict=True))
        print(f"{setup:<22} {', '.join(f'{w:.1f}' for w in walls):<22} {ratio:>15.2f}x {up:>11.2f} {down:>13.2f}")


if __name__ == "__main__":
    main()

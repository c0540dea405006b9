"""Faults from outside, and a Ray cluster other than the local one.

- A Ray training worker process SIGKILLed by the test mid-training: the stage's Prefect task retries, the retry
  resumes from the last in-stage checkpoint and ends exactly where an uninterrupted run ends, nothing already
  published is rebuilt, and the MLflow stage runs end FAILED (the killed attempt) and FINISHED (the retry).
- `RAY_ADDRESS`: a second Ray head started by the test with `ray start --head` on loopback ports runs a stage's
  workers; the manifest records the cluster.
(The whole-process kill is in test_rlhf_flow.py; the CLI cancel in test_deployment.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from posttrain_core.config import SFTConfig

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _train_workers() -> list[psutil.Process]:
    """Ray training-worker processes of this session's Ray (children of this process's raylet, by process title)."""
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.name().startswith("ray::RankActor") or " ".join(p.cmdline()).startswith("ray::RankActor"):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_a_lost_worker_is_the_error_raised_even_when_a_peer_fails_first(ray_session):
    """Which error a group raises decides whether its stage is retried (lost workers are, other errors are not):
    the lost worker's, though its peer's collective error arrived first."""
    from ray.exceptions import RayActorError

    from posttrain_core.cluster import WorkerGroup
    from tasks.common import is_transient

    class Peer:  # defined here: Ray pickles it by value (the test module is not importable in its workers)
        """Rank 1 fails at once, the way a rank fails whose peer died in a collective; rank 0, the peer, dies a
        moment later."""

        def __init__(self, rank: int, world: int):
            self.rank = rank

        def step(self) -> None:
            if self.rank == 0:
                time.sleep(0.5)
                os._exit(1)
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Read error: Connection reset by peer")

    group = WorkerGroup.start(Peer, 2, num_cpus=0.5)
    with pytest.raises(RayActorError) as raised:
        group.run("step")
    assert "Connection reset by peer" in str(raised.value.__cause__)
    assert is_transient(None, None, type("State", (), {"data": raised.value})())


def test_ray_worker_killed_mid_training_resumes_from_checkpoint(prefect_api, ray_session, tiny_inputs, tmp_path):
    from prefect import flow

    from posttrain_core import tracking
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.stage import key_for
    from posttrain_core.train.sft import checkpoint_steps, run_sft
    from tasks.train import sft

    core, data, base = tiny_inputs
    created = {ref.key: core.manifest(ref)["created"] for ref in (data.sft, base)}
    # A step takes ~0.03 s: the steps after the first checkpoint (step 10) give the poll below ~3 s to see it.
    cfg = SFTConfig(
        max_steps=120, global_batch_size=16, micro_batch_size=8, max_seq_len=64, checkpoint_every=10,
        warmup_steps=2, log_every=10, seed=11,
    )  # fmt: skip
    store = ArtifactStore(tmp_path / "store")
    key = key_for("sft", cfg, {"data": data.sft, "base": base})

    @flow
    def train_flow(root: str):
        return sft(cfg, data.sft, base, root, return_state=True)

    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(state=train_flow(str(store.root))))
    runner.start()
    deadline = time.time() + 600
    killed = None
    while killed is None:
        assert runner.is_alive() and time.time() < deadline, "training ended before a checkpoint was seen"
        steps = checkpoint_steps(store, key)
        workers = _train_workers() if steps else []
        if workers:
            killed, killed_at = workers[0], steps[-1]
            os.kill(killed.pid, signal.SIGKILL)
        time.sleep(0.1)
    runner.join(timeout=600)
    state = out["state"]
    assert state.is_completed(), state

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_task_run(state.state_details.task_run_id).run_count == 2  # killed attempt + retry
    ref = state.result()
    manifest = store.manifest(ref)
    resumed = manifest["resumed_from_step"]
    assert killed_at <= resumed < cfg.max_steps  # resumed, not restarted from step 0
    assert len(manifest["loss_history"]) == cfg.max_steps - resumed
    assert not (store.staging_dir(ref.key) / "checkpoints").exists()  # staging swept after publish
    # What was published before the fault (the inputs) is read, never rebuilt; nothing partial is published.
    assert {ref.key: core.manifest(ref)["created"] for ref in (data.sft, base)} == created
    assert [r.key for r in store.list()] == [ref.key]

    c = tracking.client(store.root)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], f"tags.`posttrain.key` = '{key}'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]

    # An uninterrupted run (other store, same key) reaches the same losses: data position, optimizer, scheduler
    # and RNG state were all restored.
    clean = ArtifactStore(tmp_path / "clean-store")
    clean_ref = run_sft(cfg, data.sft, base, clean)
    assert clean_ref.key == ref.key
    assert clean.manifest(clean_ref)["loss_history"][resumed:] == pytest.approx(
        manifest["loss_history"], rel=1e-4, abs=1e-5
    )


SFT_ON_CLUSTER = """
import json, sys
from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import SFTConfig
from posttrain_core.train.sft import run_sft
cfg, data, base, root = sys.argv[1:5]
ref = run_sft(SFTConfig.model_validate_json(cfg), ArtifactRef.model_validate_json(data),
              ArtifactRef.model_validate_json(base), ArtifactStore(root))
print("REF", ref.model_dump_json())
"""


def test_ray_address_runs_stages_on_that_cluster(tiny_inputs, tmp_path):
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.cluster import free_port

    _, data, base = tiny_inputs
    port = free_port()
    ports = [free_port() for _ in range(3)]
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    temp_dir = f"/tmp/pt-ray-{port}"
    head = subprocess.Popen(
        [
            bin_dir / "ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--num-cpus", "2", "--include-dashboard", "false", "--ray-client-server-port", str(ports[0]),
            "--node-manager-port", str(ports[1]), "--object-manager-port", str(ports[2]),
            "--temp-dir", temp_dir,  # short: Ray's socket paths must fit in 107 bytes
        ],
        env=env, stdout=(tmp_path / "head.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        cfg = SFTConfig(max_steps=4, global_batch_size=8, micro_batch_size=4, max_seq_len=64, warmup_steps=1,
                        checkpoint_every=0, log_every=2, seed=5)  # fmt: skip
        root = tmp_path / "store"
        deadline = time.time() + 120
        while True:  # the head is up once `ray status` can reach it
            ok = subprocess.run([bin_dir / "ray", "status", "--address", address], env=env, capture_output=True)
            if ok.returncode == 0:
                break
            assert head.poll() is None and time.time() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(1)
        assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
        run = subprocess.run(
            [sys.executable, "-c", SFT_ON_CLUSTER, cfg.model_dump_json(), data.sft.model_dump_json(),
             base.model_dump_json(), str(root)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**env, "RAY_ADDRESS": address, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        ref_line = next(line for line in run.stdout.splitlines() if line.startswith("REF "))
        from posttrain_core.artifacts import ArtifactRef

        ref = ArtifactRef.model_validate_json(ref_line[4:])
        manifest = ArtifactStore(root).manifest(ref)
        # The workers ran on the test's head (its GCS port; Ray reports the node's own IP), not on a new local Ray.
        assert manifest["ray_address"].rsplit(":", 1)[1] == str(port), manifest["ray_address"]
        assert len(manifest["loss_history"]) == 4
    finally:
        if head.poll() is None:
            # Killed outright: on SIGTERM `ray start --block` takes ~30 s to stop the head's processes, which all
            # share its process group (gcs_server, raylet, agents, workers); its temp dir goes below.
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)

"""Faults from outside.

- A Ray training worker process SIGKILLed by the test mid-training: the stage's Prefect task retries, the retry
  resumes from the last in-stage checkpoint and ends exactly where an uninterrupted run ends, nothing already
  published is rebuilt, and the MLflow stage runs end FAILED (the killed attempt) and FINISHED (the retry).
(The whole-process kill is in test_rlhf_flow.py; the CLI cancel in test_deployment.py, whose flow runs join the
session's Ray cluster through `RAY_ADDRESS`.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from posttrain_core.config import SFTConfig

pytestmark = pytest.mark.slow



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

"""The rlhf flow on a Ray cluster whose nodes share no folder (`ray_nodes`: a head, and a worker node in a mount
namespace of its own with a fresh tmpfs over /tmp), with the store on an S3 API (`s3_server`).

SFT, then 2 GRPO iterations on 2 training ranks placed on different nodes (the same warm ranks train SFT and the
updates), end on the same policy, bit for bit, as the same config on one machine with a local store. The worker
node's raylet is killed with SIGKILL during iteration 2's update: the failed attempt's error names the lost node, and
the retried update starts again from the store on the nodes that are left and ends on the same digest. A rerun after
the node is back rebuilds nothing. The worker node demonstrably could not open the flow machine's store staging, cache or session
folders: everything it read and wrote went through the store's S3 API or Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray_nodes import REPO, WORKER_CACHE, WORKER_IP, WORKER_RESOURCE, two_nodes

pytestmark = pytest.mark.slow


def _config(store: str):
    from test_rlhf_flow import _config as rlhf_config

    from posttrain_core.config import SFTConfig

    sft = SFTConfig(max_steps=6, checkpoint_every=3, global_batch_size=16, micro_batch_size=8, max_seq_len=64,
                    log_every=2, warmup_steps=2)  # fmt: skip
    cfg = rlhf_config(store, sft=sft, eval_samples=0)
    return cfg.model_copy(update=dict(rl=cfg.rl.model_copy(update=dict(num_workers=2))))


def _drive(nodes, cfg, work: Path, name: str, hidden: list[Path], kill_in_update: int | None = None) -> dict:
    """Run the flow from the head (`cluster_driver`); with `kill_in_update`, SIGKILL the worker node's raylet once
    that iteration's update has started. Returns the driver's result, with its log."""
    log, result = work / f"{name}.log", work / f"{name}.json"
    from prefect.settings import PREFECT_API_URL

    # The session's Prefect API (a flow process of its own would start a temporary server: ~10-20 s).
    env = {**nodes.env, "POSTTRAIN_CACHE_DIR": str(work / "driver-cache"), "PREFECT_API_URL": PREFECT_API_URL.value()}
    cmd = [sys.executable, str(REPO / "tests" / "cluster_driver.py"), cfg.model_dump_json(), str(result),
           *map(str, hidden)]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    if kill_in_update is not None:
        while log.read_text().count("rl_update: grpo on") < kill_in_update:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(nodes.worker_raylet(), 9)
    assert proc.wait(timeout=max(1, deadline - time.time())) == 0, log.read_text()[-5000:]
    return {**json.loads(result.read_text()), "log": log.read_text()}


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """The two nodes and a fresh root in the S3 store, for the module (the serve test serves what the flow trained)."""
    tmp = tmp_path_factory.mktemp("cluster")
    env = {k: v for k, v in s3.items() if k != "bucket"} | {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/cluster-mlflow.db",
        "POSTTRAIN_CODE_VERSION": "test-cluster",
    }
    with two_nodes(tmp, env, tmp / "head-cache") as nodes:
        yield SimpleNamespace(nodes=nodes, root=f"s3://{s3['bucket']}/{uuid.uuid4().hex}", tmp=tmp)


def test_rlhf_flow_on_two_nodes_sharing_no_folder(prefect_api, ray_session, cluster, tmp_path, monkeypatch):
    from flows.rlhf import rlhf_flow

    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "test-cluster")  # one key for both runs: keys hash the code
    one_node = rlhf_flow(_config(str(tmp_path / "local-store")))  # the session's one-machine Ray, a local store

    nodes, root, work = cluster.nodes, cluster.root, cluster.tmp
    # The flow machine's folders, all under /tmp: what the worker node must not see.
    hidden = [work / "driver-cache", work / "head-cache", work]
    run = _drive(nodes, _config(root), work, "killed", hidden, kill_in_update=2)
    log = run["log"]
    # The training ranks (warm: SFT's, then the RL updates') spanned the two nodes.
    spans = [line for line in log.splitlines() if "2 ranks on nodes" in line]
    assert spans and WORKER_IP in spans[0], spans
    # The lost node is named, and the update was retried without it.
    assert "the lost rank ran on node" in log and f"({WORKER_IP})" in log.split("the lost rank ran on node")[1][:40]
    assert run["digest"] == one_node["policy"].digest
    # The reward curve of a run on S3: a file on the flow's machine, under its cache folder (not a folder
    # named after the URI in the working directory).
    assert Path(run["curve_png"]).is_file() and Path(run["curve_png"]).is_relative_to(work / "driver-cache")
    assert not (REPO / "s3:").exists()

    # The node comes back (a fresh /tmp: an empty cache); a rerun builds nothing and ends on the same policy.
    nodes.kill_worker()
    nodes.start_worker()
    from ray_nodes import wait_for_nodes

    wait_for_nodes(nodes, 2, nodes.worker)
    again = _drive(nodes, _config(root), work, "rerun", hidden)
    assert again["digest"] == one_node["policy"].digest and "building" not in again["log"]
    (probe,) = again["probes"]
    assert probe["visible"] and not any(probe["visible"].values()), probe  # the namespace is in force
    assert all(Path(p).exists() for p in probe["visible"])  # ... and they do exist, here


def test_posttrain_serve_on_two_nodes_sharing_no_folder(cluster, tmp_path):
    """`posttrain serve` joins the cluster with the store on S3 and serves the policy the flow above trained
    (`latest:rl_update`). Its model worker runs on the worker node (`--worker-resources`), which fetched the base model
    from the store into its own cache; a tenant trains and saves; the worker uploads the checkpoint; a new client
    loads it there and matches the first client; a sampler samples from it. The gateway stays on the head, beside its
    journal."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.serve import checkpoints
    from posttrain_core.serve.process import ServiceProcess

    env = {**cluster.nodes.env, "POSTTRAIN_CACHE_DIR": str(tmp_path / "service-cache")}
    srv = ServiceProcess("tiny", "latest:rl_update", cluster.root, tmp_path / "state", tmp_path / "serve.log",
                         {"tml-a": "alice"}, env=env, memory_gb=1,
                         worker_resources=json.dumps({WORKER_RESOURCE: 1}))  # fmt: skip
    srv.start()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(srv.url + "/api/v1/posttrain/status", headers={"X-API-Key": "tml-a"}), timeout=60
        ) as r:
            (worker,) = json.loads(r.read())["workers"].values()
        assert worker["node"] == WORKER_IP, worker
        # Its base model is a copy in the worker node's own cache, a folder this machine does not have.
        assert worker["path"].startswith(WORKER_CACHE) and not Path(worker["path"]).exists(), worker

        sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-a")
        tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        ids = list(range(5, 30))
        batch = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                             loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})]  # fmt: skip
        losses = []
        for _ in range(3):
            out = tc.forward_backward(batch, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(out.metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        path = tc.save_state("on-node-b").result().path
        manifest = ArtifactStore(cluster.root).manifest(checkpoints.artifact_key(path))  # the store has it
        assert manifest["tinker_path"] == path and manifest["step"] == 3

        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        for client in (tc, resumed):
            client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        mine, theirs = (c.forward(batch, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
                        for c in (tc, resumed))  # fmt: skip
        assert abs(mine - theirs).max() < 1e-5
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, seed=3, temperature=1.0)
        sampled = sampler.sample(types.ModelInput.from_ints(ids[:8]), num_samples=2, sampling_params=params).result()
        assert [len(s.tokens) for s in sampled.sequences] == [4, 4]
        sc.close("success").result()
    finally:
        srv.stop()

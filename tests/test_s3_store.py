"""Stages on a store served over the S3 API (`s3_server`: 127.0.0.1, a process of its own): they publish there, read
their inputs through this machine's cache of it, and a rerun is a cache hit; `posttrain artifacts gc` on it deletes
in the store and drops this machine's copies.
"""

from __future__ import annotations

import uuid
from pathlib import Path


def test_stages_publish_to_and_read_through_an_s3_store(s3, tmp_path, monkeypatch, capsys):
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, ModelConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "node-cache"))  # this machine's cache starts empty
    root = f"s3://{s3['bucket']}/{uuid.uuid4().hex}"
    store = ArtifactStore(root)
    data = run_prepare_data(DataConfig(n_train=60, n_eval=8, n_rl_prompts=16), store)
    base = run_build_model(ModelConfig(size="tiny"), data.text, store)  # its tokenizer trains on the downloaded text
    assert base.uri.startswith(root + "/artifacts/") and (store.cache_root / data.text.key / "manifest.json").exists()
    assert store.manifest(base)["inputs"][0]["key"] == data.text.key  # lineage through the S3 store
    assert (store.local_path(base) / "config.json").exists()
    assert store.reports_root.is_relative_to(tmp_path / "node-cache")  # pictures stay on this machine

    again = ArtifactStore(root, workdir=tmp_path / "another-machine")  # nothing cached there
    assert run_prepare_data(DataConfig(n_train=60, n_eval=8, n_rl_prompts=16), again) == data
    assert run_build_model(ModelConfig(size="tiny"), data.text, again) == base  # cache hits: no download needed
    assert not (again.cache_root / data.text.key).exists()

    # gc keeps the newest of each stage (here everything) and reports on this machine's cache too.
    from posttrain_core.cli import cmd_gc

    cmd_gc(store, keep_last=1, stage=None, dry_run=False)
    out = capsys.readouterr().out
    assert "deleted 0 artifacts" in out and "removed 0 copies of deleted artifacts" in out, out


def test_a_worker_on_another_node_publishes_and_checkpoints_through_the_store(s3, tmp_path, monkeypatch):
    """What a Ray rank does on a node that shares no folder with the driver (`artifacts.node`), with two cache folders
    standing for two nodes: it reads its input from its own cache, keeps its in-stage checkpoints in the store (a
    rank on a third node resumes from the newest), and uploads its output, which the driver publishes manifest-last."""
    import dataclasses

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.artifacts.node import NodePath, Outbox, node_store, on_node

    root = f"s3://{s3['bucket']}/{uuid.uuid4().hex}"
    driver = ArtifactStore(root, workdir=tmp_path / "driver")
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("input")
    key_in, key_out = "a" * 64, "b" * 64
    ref = driver.publish(key_in, "dataset", src, {"stage": "test"})

    @dataclasses.dataclass(frozen=True)
    class Job:
        data_path: str | NodePath
        workdir: str
        outdir: str
        outbox: Outbox | None

    job = Job(NodePath(root, ref), "/nonexistent/driver-workdir", "/nonexistent/driver-outdir", Outbox(root, key_out))

    def on(node: str) -> Job:
        monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / node))
        node_store.cache_clear()  # a new process on that node
        return on_node(job)

    a = on("node-a")
    assert (Path(a.data_path) / "data.txt").read_text() == "input"
    assert Path(a.data_path).is_relative_to(tmp_path / "node-a")
    assert Path(a.workdir).is_relative_to(tmp_path / "node-a") and not Path(a.outdir).exists()
    for step in (3, 6, 9):  # rank 0 keeps the newest 2, in the store
        ckpt = Path(a.workdir) / "checkpoints" / f"step_{step:07d}.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_bytes(b"state %d" % step)
        job.outbox.keep(ckpt, keep_last=2)
    assert driver.fs.ls(driver.checkpoint_prefix(key_out), detail=False).__len__() == 2

    b = on("node-b")  # the stage retried on another node: the newest checkpoint is fetched there
    assert [p.name for p in sorted((Path(b.workdir) / "checkpoints").iterdir())] == ["step_0000009.pt"]
    Path(b.outdir).mkdir(parents=True)
    (Path(b.outdir) / "model.bin").write_bytes(b"weights")
    uploaded = job.outbox.ship(b.outdir)
    assert not Path(b.workdir).exists() and driver.get(key_out) is None  # uploaded, not yet an artifact

    out = driver.publish(key_out, "model", uploaded, {"stage": "test"})
    assert driver.get(key_out) == out and (driver.local_path(out) / "model.bin").read_bytes() == b"weights"
    assert out.digest == uploaded.digest
    driver.clear_staging(key_out)
    assert not driver.fs.exists(driver.checkpoint_prefix(key_out))


def test_a_lora_adapter_trained_on_one_node_loads_on_another(s3, tiny_inputs, tmp_path, monkeypatch):
    """An adapter records its base by the path the base had on the node that trained it (there: a copy in that
    node's cache). Read on another node, the base artifact comes into that node's cache beside the adapter."""
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import LoraConfig
    from posttrain_core.models.loading import check_model_path, load_causal_lm, save_checkpoint
    from posttrain_core.models.lora import apply_lora

    local, _, base = tiny_inputs
    root = f"s3://{s3['bucket']}/{uuid.uuid4().hex}"
    src = tmp_path / "base"
    import shutil

    shutil.copytree(local.local_path(base), src, ignore=shutil.ignore_patterns("manifest.json"))
    base_ref = ArtifactStore(root, workdir=tmp_path / "driver").publish(base.key, "model", src, {"stage": "build"})

    node_a = ArtifactStore(root, workdir=tmp_path / "node-a")
    model = apply_lora(load_causal_lm(str(node_a.local_path(base_ref))), LoraConfig(r=4), seed=0)
    out = tmp_path / "adapter"
    assert save_checkpoint(model, None, out)["adapter"]
    adapter = node_a.publish("c" * 64, "model", out, {"stage": "sft"})

    shutil.rmtree(tmp_path / "node-a")  # another machine's folders: not here
    node_b = ArtifactStore(root, workdir=tmp_path / "node-b")
    folder = node_b.local_path(adapter)
    assert (node_b.cache_root / base.key / "config.json").exists()  # fetched with the adapter
    assert check_model_path(folder)["is_adapter"]
    assert load_causal_lm(str(folder)).peft_config["default"].r == 4


def test_checks_on_the_flow_machine_read_a_metadata_view_not_the_weights(s3, tmp_path):
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.models.loading import check_model_path

    root = f"s3://{s3['bucket']}/{uuid.uuid4().hex}"
    src = tmp_path / "model"
    (src / "critic").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64, "vocab_size": 10}')
    (src / "model.safetensors").write_bytes(b"w" * 4096)
    (src / "trainer_state.pt").write_bytes(b"s" * 8192)
    (src / "critic" / "config.json").write_text("{}")
    store = ArtifactStore(root, workdir=tmp_path / "flow")
    ref = store.publish("d" * 64, "model", src, {"stage": "rl_update"})

    view = store.metadata_path(ref)
    assert check_model_path(view)["max_position_embeddings"] == 64 and (view / "critic" / "config.json").exists()
    assert (view / "trainer_state.pt").stat().st_size == 0 and (view / "model.safetensors").stat().st_size == 0
    assert not (store.cache_root / ref.key).exists()  # nothing heavy downloaded
    full = store.local_path(ref)
    assert (full / "model.safetensors").stat().st_size == 4096 and store.metadata_path(ref) == full

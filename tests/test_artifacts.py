"""Tests of the artifact store and stage keys: atomic publish, crash safety, concurrency, lineage, fsspec stores."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

import posttrain_core
from posttrain_core.artifacts import (
    ArtifactRef,
    ArtifactStore,
    content_digest,
    fsio,
    ref_from_manifest,
    start_writeback,
)
from posttrain_core.artifacts.keys import canonical_json, code_version, stage_key

REPO = Path(__file__).resolve().parents[1]
KEY = "ab" + "0" * 62


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def _publish(store: ArtifactStore, key: str, files: dict[str, bytes], **manifest) -> ArtifactRef:
    out = _write(store.new_output_dir(key), files)
    return store.publish(key, "dataset", out, {"stage": "test", **manifest}, schema_kind="sft")


def _entries(store: ArtifactStore, key: str) -> list[str]:
    return sorted(p.name for p in (Path(store.root) / "artifacts" / key[:2]).iterdir())


# --------------------------------------------------------------------------------------------- publish / get
def test_publish_get_roundtrip(store: ArtifactStore) -> None:
    files = {"data/part-0.arrow": b"arrow bytes" * 10, "stats.json": b"{}"}
    out = _write(store.new_output_dir(KEY), files)
    inputs = [ArtifactRef(kind="model", key="external-0123456789abcdef", uri="/models/base", digest="d" * 64)]
    ref = store.publish(
        KEY,
        "dataset",
        out,
        {"stage": "sft", "config": {"lr": 1e-3}, "inputs": inputs, "mlflow_run_id": "run1", "metrics": {"loss": 0.5}},
        schema_kind="sft",
    )
    assert ref == ArtifactRef(kind="dataset", key=KEY, uri=ref.uri, digest=ref.digest, schema_kind="sft")
    assert store.get(KEY) == ref
    assert ref.path == Path(store.root) / "artifacts" / "ab" / KEY
    assert {rel: (ref.path / rel).read_bytes() for rel in files} == files
    assert not out.exists()  # the content was moved, not copied

    m = store.manifest(KEY)
    assert store.manifest(ref) == m == json.loads((ref.path / "manifest.json").read_text())
    assert (m["kind"], m["key"], m["schema_kind"], m["digest"]) == ("dataset", KEY, "sft", ref.digest)
    assert m["files"] == [{"path": "data/part-0.arrow", "size": 110}, {"path": "stats.json", "size": 2}]
    assert datetime.fromisoformat(m["created"]).utcoffset().total_seconds() == 0
    assert m["posttrain_version"] == code_version()
    assert (m["stage"], m["config"], m["mlflow_run_id"], m["metrics"]) == ("sft", {"lr": 1e-3}, "run1", {"loss": 0.5})
    assert [ArtifactRef.model_validate(i) for i in m["inputs"]] == inputs
    assert ref_from_manifest(m, ref.uri) == ref
    assert store.list() == [ref] and store.list("dataset") == [ref] and store.list("model") == []


def test_get_unknown_key_is_none(store: ArtifactStore) -> None:
    assert store.get("ff" * 32) is None
    with pytest.raises(FileNotFoundError, match="ff" * 32):
        store.manifest("ff" * 32)
    with pytest.raises(ValueError, match="invalid artifact key"):
        store.get("../etc")


def test_digest_deterministic_and_content_sensitive(store: ArtifactStore, tmp_path: Path) -> None:
    files = {"a.bin": b"x" * 100, "sub/b.bin": b"y"}
    first = _publish(store, "k1" + "0" * 10, files)
    second = _publish(store, "k2" + "0" * 10, files)
    assert first.digest == second.digest == content_digest(first.path)
    assert _publish(store, "k3" + "0" * 10, {**files, "a.bin": b"x" * 99 + b"z"}).digest != first.digest
    assert _publish(store, "k4" + "0" * 10, {"a2.bin": b"x" * 100, "sub/b.bin": b"y"}).digest != first.digest


def test_digest_is_blake3_of_paths_sizes_and_bytes(store: ArtifactStore) -> None:
    import blake3

    ref = _publish(store, "k5" + "0" * 10, {"b.bin": b"yy", "a.bin": b"x"})
    expected = blake3.blake3(b"a.bin\x001\x00x" + b"b.bin\x002\x00yy").hexdigest()
    assert ref.digest == "blake3:" + expected == content_digest(ref.path)
    legacy = hashlib.sha256(b"a.bin\x001\x00x" + b"b.bin\x002\x00yy").hexdigest()
    assert content_digest(ref.path, like=legacy) == legacy  # a digest of an older store: recomputed as sha256


def test_an_artifact_from_an_older_store_with_a_sha256_digest_downloads_and_is_verified(remote_root: str) -> None:
    store = ArtifactStore(remote_root)
    ref = _publish(store, KEY, {"model.safetensors": b"w" * 1000})
    fs = store.fs
    manifest_path = f"{store._root}/artifacts/ab/{KEY}/manifest.json"
    manifest = json.loads(fs.cat_file(manifest_path))
    manifest["digest"] = hashlib.sha256(b"model.safetensors\x001000\x00" + b"w" * 1000).hexdigest()
    fs.pipe_file(manifest_path, json.dumps(manifest).encode())  # what a store written before BLAKE3 holds
    old = store.get(KEY)
    assert old.digest == manifest["digest"] != ref.digest
    assert (store.local_path(old) / "model.safetensors").read_bytes() == b"w" * 1000
    fresh = ArtifactStore(store.root)  # a new process: nothing cached from here on
    shutil.rmtree(fresh.cache_root / KEY)
    fs.pipe_file(f"{store._root}/artifacts/ab/{KEY}/model.safetensors", b"w" * 999 + b"!")  # corrupted in the store
    with pytest.raises(ValueError, match=f"content downloaded from .* has digest .*, not {old.digest}"):
        fresh.local_path(old)


def test_publish_existing_key_returns_existing(store: ArtifactStore) -> None:
    ref = _publish(store, KEY, {"a": b"1"})
    again = _publish(store, KEY, {"a": b"2"})
    assert again == ref and (ref.path / "a").read_bytes() == b"1"


def test_publish_rejects_bad_input(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        store.publish(KEY, "model", tmp_path / "missing", {})
    out = _write(store.new_output_dir(KEY), {"manifest.json": b"{}"})
    with pytest.raises(ValueError, match="manifest.json"):
        store.publish(KEY, "model", out, {})
    out = _write(store.new_output_dir(KEY), {"w": b"1"})
    with pytest.raises(ValueError, match="'digest'"):
        store.publish(KEY, "model", out, {"digest": "forged"})
    with pytest.raises(ValueError, match="kind"):
        store.publish(KEY, "tensor", out, {})  # type: ignore[arg-type]
    assert store.get(KEY) is None


@pytest.mark.parametrize("where", ["manifest", "rename"])
def test_exception_mid_publish_leaves_nothing(store: ArtifactStore, monkeypatch, where: str) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    if where == "manifest":
        monkeypatch.setattr(fsio, "write_synced", boom)
    else:
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if os.path.basename(src).startswith(".tmp-"):
                boom()
            return real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "rename", rename)
    out = _write(store.new_output_dir(KEY), {"w.bin": b"weights"})
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.publish(KEY, "model", out, {})
    assert store.get(KEY) is None
    assert _entries(store, KEY) == []  # no target, no temp folder
    assert (out / "w.bin").read_bytes() == b"weights"  # content given back: a retry can publish it
    monkeypatch.undo()
    assert store.publish(KEY, "model", out, {}).key == KEY


KILL_SCRIPT = r"""
import os, signal, sys
from posttrain_core.artifacts import ArtifactStore

store, key, where = ArtifactStore(sys.argv[1]), sys.argv[2], sys.argv[3]
out = store.new_output_dir(key)
for i in range(8):
    (out / f"shard-{i}.bin").write_bytes(os.urandom(128 * 1024))

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

real_rename = os.rename
def rename(src, dst, *args, **kwargs):
    if os.path.basename(os.fspath(src)).startswith(".tmp-"):
        die()  # killed with a complete temp folder, manifest included, just before the rename
    return real_rename(src, dst, *args, **kwargs)

if where == "fsync":
    os.fsync = die  # killed while flushing the content, before the manifest
else:
    os.rename = rename
print("copying", flush=True)
store.publish(key, "dataset", out, {"stage": "killed"})
print("survived", flush=True)
"""


@pytest.mark.parametrize("where", ["fsync", "rename"])
def test_sigkill_mid_publish_leaves_only_a_temp_folder(store: ArtifactStore, where: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, store.root, KEY, where], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "copying" in proc.stdout and "survived" not in proc.stdout
    assert store.get(KEY) is None and store.list() == []
    [leftover] = _entries(store, KEY)
    assert leftover.startswith(f".tmp-{KEY}-")
    assert store.sweep() == 0  # too young for the default age
    assert store.sweep(max_age_s=0) == 1
    assert _entries(store, KEY) == []
    assert _publish(store, KEY, {"a": b"1"}).key == KEY


def test_foreign_incomplete_target_raises(store: ArtifactStore) -> None:
    target = Path(store.root) / "artifacts" / KEY[:2] / KEY
    _write(target, {"junk": b"1"})
    out = _write(store.new_output_dir(KEY), {"a": b"1"})
    with pytest.raises(FileExistsError, match=str(target)):
        store.publish(KEY, "model", out, {})
    assert (out / "a").exists()
    (target / "manifest.json").write_text("{not json")
    assert store.get(KEY) is None and store.list() == []


# --------------------------------------------------------------------------------------------- concurrency
def _publish_in_process(root: str, key: str, barrier, results) -> None:
    store = ArtifactStore(root)
    out = _write(store.new_output_dir(key), {"weights.bin": b"same" * 4096, "config.json": b"{}"})
    barrier.wait(timeout=60)
    results.put(store.publish(key, "model", out, {"stage": "race", "pid": os.getpid()}).model_dump_json())


def test_concurrent_publish_from_processes(store: ArtifactStore) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_publish_in_process, args=(store.root, KEY, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    refs = [ArtifactRef.model_validate_json(results.get(timeout=60)) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert refs[0] == refs[1] == store.get(KEY)
    assert _entries(store, KEY) == [KEY]
    assert store.manifest(KEY)["pid"] in {p.pid for p in procs}
    assert content_digest(refs[0].path) == refs[0].digest


def test_concurrent_publish_from_threads(store: ArtifactStore) -> None:
    n = 6
    barrier, refs = threading.Barrier(n), [None] * n

    def worker(i: int) -> None:
        out = _write(store.new_output_dir(KEY), {"weights.bin": b"same" * 4096})
        barrier.wait(timeout=30)
        refs[i] = store.publish(KEY, "model", out, {"thread": i})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r == refs[0] for r in refs) and refs[0] == store.get(KEY)
    assert _entries(store, KEY) == [KEY]


def test_publish_losing_the_rename_race_returns_the_winner(store: ArtifactStore, monkeypatch) -> None:
    real_rename, raced = os.rename, []

    def rename(src, dst, *args, **kwargs):
        if os.path.basename(src).startswith(".tmp-") and not raced:
            raced.append(True)  # another publisher finishes between our checks and our rename
            winner = _write(store.new_output_dir(KEY), {"w": b"winner"})
            raced.append(store.publish(KEY, "model", winner, {"who": "winner"}))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    ours = _write(store.new_output_dir(KEY), {"w": b"loser"})
    ref = store.publish(KEY, "model", ours, {"who": "loser"})
    assert ref == raced[1] == store.get(KEY)
    assert (ref.path / "w").read_bytes() == b"winner" and store.manifest(ref)["who"] == "winner"
    assert _entries(store, KEY) == [KEY]


# --------------------------------------------------------------------------------------------- keys
class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True)
    lr: float = 1e-3
    steps: int = 10


def _ref(digest: str) -> ArtifactRef:
    return ArtifactRef(kind="dataset", key="k" * 8, uri="/x", digest=digest)


def test_stage_key_changes_exactly_with_its_inputs() -> None:
    from posttrain_core.stage import key_for

    inputs = ["a" * 64, "b" * 64]
    key = stage_key("sft", _Cfg(), inputs, version="1")
    assert len(key) == 64 and key == stage_key("sft", _Cfg(), tuple(inputs), version="1")
    refs = {"policy": _ref("a" * 64), "reference": _ref("b" * 64).model_copy(update={"uri": "/y"})}
    assert key_for("sft", _Cfg(), refs) == stage_key("sft", _Cfg(), inputs)  # only the digests count, not the URIs
    others = {
        stage_key("sft", _Cfg(steps=11), inputs, version="1"),
        stage_key("sft", _Cfg(), [inputs[0], "c" * 64], version="1"),
        stage_key("sft", _Cfg(), inputs[::-1], version="1"),
        stage_key("dpo", _Cfg(), inputs, version="1"),
        stage_key("sft", _Cfg(), inputs, version="2"),
        stage_key("sft", _Cfg(), inputs),
    }
    assert key not in others and len(others) == 6
    with pytest.raises(TypeError, match=r"ref\.digest"):
        stage_key("sft", _Cfg(), [_ref("a" * 64)], version="1")


def test_stage_key_bytes_are_stable() -> None:
    """Stores and Prefect caches on disk are keyed by these values: the payload's JSON must never change."""
    key = stage_key("sft", _Cfg(), ["a" * 64, "blake3:" + "b" * 64], version="1")
    assert key == "11ff916b143ce839c7f96de4da38b9d899bbf590f27af5914188b099e4fe20fa"
    payload = '{"config":{"lr":0.001,"steps":10},"inputs":["%s","blake3:%s"],"stage":"sft","version":"1"}'
    assert key == hashlib.sha256((payload % ("a" * 64, "b" * 64)).encode()).hexdigest()


def test_stage_key_ignores_dict_order() -> None:
    a = {"lr": 0.1, "sched": {"warmup": 5, "kind": "cos"}}
    b = {"sched": {"kind": "cos", "warmup": 5}, "lr": 0.1}
    assert canonical_json(a) == canonical_json(b) == '{"lr":0.1,"sched":{"kind":"cos","warmup":5}}'
    assert stage_key("s", a, [], "1") == stage_key("s", b, [], "1")
    assert canonical_json(_Cfg()) == canonical_json({"steps": 10, "lr": 1e-3})


def test_code_version(monkeypatch) -> None:
    monkeypatch.delenv("POSTTRAIN_CODE_VERSION", raising=False)
    version, h = code_version().split("+")
    assert version == posttrain_core.__version__
    assert len(h) == 12 and int(h, 16) >= 0
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "pinned-7")
    assert code_version() == "pinned-7"
    assert stage_key("s", {}, []) == stage_key("s", {}, [], version="pinned-7")


# --------------------------------------------------------------------------------------------- external
def test_register_external(store: ArtifactStore, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        store.register_external(missing)
    folder = _write(tmp_path / "hf-model", {"config.json": b"{}", "model.safetensors": b"w" * 100})
    ref = store.register_external(folder)
    assert ref.kind == "model" and ref.uri == str(folder) and ref.key == "external-" + ref.digest[:16]
    assert ref.external and ref.path == folder and store.local_path(ref) == folder
    assert store.register_external(folder) == ref
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # nothing written
    stat = (folder / "model.safetensors").stat()
    (folder / "model.safetensors").write_bytes(b"w" * 101)
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime, new size
    assert store.register_external(folder).digest != ref.digest
    jsonl = _write(tmp_path / "files", {"train.jsonl": b'{"a": 1}\n'}) / "train.jsonl"
    file_ref = store.register_external(jsonl, kind="dataset")
    assert file_ref.uri == str(jsonl) and store.local_path(file_ref) == jsonl and file_ref.digest != ref.digest


# --------------------------------------------------------------------------------------------- lineage
def test_lineage_walks_two_levels(store: ArtifactStore, tmp_path: Path) -> None:
    base = store.register_external(_write(tmp_path / "base", {"w": b"1"}))
    data = _publish(store, "da" + "1" * 62, {"rows": b"1"}, inputs=[])
    sft = _publish(store, "sf" + "2" * 62, {"w": b"2"}, inputs=[data, base])
    dpo = _publish(store, "dp" + "3" * 62, {"w": b"3"}, inputs=[sft, data])
    chain = store.lineage(dpo)
    assert [m["key"] for m in chain] == [dpo.key, sft.key, data.key, base.key]
    assert chain[0] == store.manifest(dpo)
    assert chain[3] == {"key": base.key, "uri": base.uri, "external": True, "kind": "model", "digest": base.digest}


# --------------------------------------------------------------------------------------------- refs, staging, roots
def test_ref_pickles_and_roundtrips_json() -> None:
    ref = ArtifactRef(kind="dataset", key=KEY, uri="/store/x", digest="d" * 64, schema_kind="prompts")
    assert pickle.loads(pickle.dumps(ref)) == ref
    assert ArtifactRef.model_validate_json(ref.model_dump_json()) == ref
    assert ArtifactRef.model_validate(json.loads(json.dumps(ref.model_dump()))) == ref
    assert len({ref, ref.model_copy()}) == 1
    with pytest.raises(ValidationError):
        ref.key = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="s3://bucket/x"):
        _ = ArtifactRef(kind="model", key=KEY, uri="s3://bucket/x", digest="d").path


def test_staging_dirs(store: ArtifactStore) -> None:
    staging = store.staging_dir(KEY)
    assert staging == Path(store.root) / "staging" / KEY and staging.is_dir()
    (staging / "ckpt-10").mkdir()
    assert store.staging_dir(KEY) == staging and (staging / "ckpt-10").is_dir()  # survives a retry
    a, b = store.new_output_dir(KEY), store.new_output_dir(KEY)
    assert a != b and a.parent == b.parent == staging and a.name.startswith("out-")
    store.clear_staging(KEY)
    assert not staging.exists()
    store.clear_staging(KEY)  # idempotent


def test_default_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("POSTTRAIN_STORE", raising=False)
    assert ArtifactStore().root == str((tmp_path / ".posttrain").resolve())
    monkeypatch.setenv("POSTTRAIN_STORE", str(tmp_path / "env-store"))
    assert ArtifactStore().root == str(tmp_path / "env-store")
    assert ArtifactStore(f"file://{tmp_path}/url-store").root == str(tmp_path / "url-store")


def test_remote_fsspec_store(remote_root: str, tmp_path: Path) -> None:
    store = ArtifactStore(remote_root)
    assert not store.is_local and store.staging_root.is_relative_to(tmp_path / "node-cache")
    files = {"model.safetensors": b"w" * 1000, "tok/vocab.json": b"{}"}
    assert store.get(KEY) is None
    ref = _publish(store, KEY, files)
    assert ref.uri == f"{store.root}/artifacts/ab/{KEY}" and ref.uri.startswith(remote_root.split("://")[0] + "://")
    assert store.get(KEY) == ref and store.list() == [ref]
    assert store.manifest(ref)["files"] == [
        {"path": "model.safetensors", "size": 1000},
        {"path": "tok/vocab.json", "size": 2},
    ]
    assert _publish(store, KEY, {"other": b"1"}) == ref
    local = store.local_path(ref)
    assert local.is_relative_to(store.cache_root)
    assert {rel: (local / rel).read_bytes() for rel in files} == files and content_digest(local) == ref.digest
    assert store.local_path(ref) == local  # cached, not downloaded again
    with pytest.raises(ValueError, match="local_path"):
        _ = ref.path
    fs = store.fs
    fs.pipe_file(f"{store._root}/artifacts/ab/.tmp-{KEY}-dead/manifest.json", b"{}")
    fs.invalidate_cache()
    assert store.list() == [ref] and store.sweep(max_age_s=0) == 1
    assert fs.ls(f"{store._root}/artifacts/ab", detail=False) == [f"{store._root}/artifacts/ab/{KEY}"]


# --------------------------------------------------------------------------------------------- delete
def test_delete_counts_generations_and_clears_staging(store: ArtifactStore) -> None:
    ref = _publish(store, KEY, {"a.bin": b"1"})
    (store.staging_dir(KEY) / "checkpoint").write_bytes(b"c")
    assert store.generation(KEY) == 0
    assert store.delete(KEY) is True
    assert store.get(KEY) is None and store.list() == [] and _entries(store, KEY) == []
    assert store.generation(KEY) == 1 and not (store.staging_root / KEY).exists()
    assert (Path(store.root) / "tombstones" / KEY).read_text() == "1\n"
    assert store.delete(KEY) is False and store.generation(KEY) == 1  # nothing there: not counted again
    again = _publish(store, KEY, {"a.bin": b"1"})
    assert again == ref and store.generation(KEY) == 1  # same key, same content: rebuilt as it was
    assert store.delete(KEY) and store.generation(KEY) == 2
    with pytest.raises(ValueError, match="invalid artifact key"):
        store.delete("../etc")


DELETE_KILL_SCRIPT = r"""
import os, shutil, signal, sys
from posttrain_core.artifacts import ArtifactStore

store, key = ArtifactStore(sys.argv[1]), sys.argv[2]
out = store.new_output_dir(key)
(out / "w.bin").write_bytes(os.urandom(64 * 1024))
store.publish(key, "model", out, {"stage": "killed"})
real_rmtree = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if "-del-" in os.path.basename(os.fspath(path)):
        os.kill(os.getpid(), signal.SIGKILL)  # killed after the rename, before the content is gone
    return real_rmtree(path, *args, **kwargs)
shutil.rmtree = rmtree
print("deleting", flush=True)
store.delete(key)
print("survived", flush=True)
"""


def test_sigkill_mid_delete_hides_the_artifact_and_sweep_removes_the_rest(store: ArtifactStore) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", DELETE_KILL_SCRIPT, store.root, KEY], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "deleting" in proc.stdout and "survived" not in proc.stdout
    assert store.get(KEY) is None and store.list() == [] and store.generation(KEY) == 1
    [leftover] = _entries(store, KEY)
    assert leftover.startswith(f".tmp-{KEY}-del-")
    assert store.sweep() == 1  # a deleted artifact is garbage at any age
    assert _entries(store, KEY) == []


def test_delete_from_a_remote_store(remote_root: str, monkeypatch) -> None:
    store = ArtifactStore(remote_root)
    ref = _publish(store, KEY, {"model.safetensors": b"w" * 100, "tok/vocab.json": b"{}"})
    assert store.local_path(ref).is_dir()
    assert store.delete(KEY) and store.get(KEY) is None and store.generation(KEY) == 1
    assert not store.fs.exists(f"{store._root}/artifacts/ab/{KEY}") and not (store.cache_root / KEY).exists()
    assert store.fs.cat_file(f"{store._root}/tombstones/{KEY}") == b"1\n"

    # Killed after the manifest went, before the content: invisible at once; sweep() (or delete again) finishes.
    _publish(store, KEY, {"model.safetensors": b"w" * 100})
    real_rm = store.fs.rm

    def rm(path, *args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(store.fs, "rm", rm)
    with pytest.raises(KeyboardInterrupt):
        store.delete(KEY)
    monkeypatch.setattr(store.fs, "rm", real_rm)
    assert store.get(KEY) is None and store.list() == [] and store.generation(KEY) == 2
    assert store.fs.exists(f"{store._root}/artifacts/ab/{KEY}/model.safetensors")
    assert store.sweep(max_age_s=0) == 1
    assert not store.fs.exists(f"{store._root}/artifacts/ab/{KEY}")
    assert _publish(store, KEY, {"model.safetensors": b"w" * 100}).key == KEY


def test_start_writeback_starts_the_disk_write_of_a_folder_or_a_file_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    files = {"a.bin": os.urandom(1 << 20), "sub/b.bin": b"b"}
    for rel, data in files.items():
        (tmp_path / rel).write_bytes(data)
    before = content_digest(tmp_path)
    start_writeback(tmp_path)
    start_writeback(tmp_path / "a.bin")
    start_writeback(tmp_path / "missing")  # nothing to do, no error: it only hurries the disk
    assert content_digest(tmp_path) == before
    if sys.platform.startswith("linux"):
        fd = os.open(tmp_path / "a.bin", os.O_RDONLY)
        try:
            assert fsio._sync_file_range()(fd, 0, 0, 2) == 0  # the call the kernel accepted
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------- node caches
def test_a_machines_cache_drops_deleted_artifacts_and_interrupted_downloads_then_keeps_its_bound(
    remote_root: str, tmp_path: Path, monkeypatch
) -> None:
    """Three cached copies of 1,000 bytes on this machine; another machine deletes one artifact from the store; a
    download killed here left a temp folder. Trimming to 1,500 bytes removes the deleted artifact's copy and the
    temp folder, then evicts the least recently used copy; a copy used within `min_idle_s` is never evicted."""
    from posttrain_core.artifacts import cache

    store = ArtifactStore(remote_root)
    keys = [f"c{i}" + "0" * 62 for i in range(3)]
    refs = [_publish(store, key, {"w.bin": bytes([i]) * 1000}) for i, key in enumerate(keys)]
    copies = [store.local_path(ref) for ref in refs]
    old = time.time() - 7200
    for i, copy in enumerate(copies):  # used two hours ago, copy 0 first
        os.utime(copy / "manifest.json", (old + i, old + i))
    killed = store.cache_root / f".tmp-{keys[0]}-{uuid.uuid4().hex}"
    (killed / "w.bin").parent.mkdir(parents=True)
    (killed / "w.bin").write_bytes(b"partial")
    os.utime(killed, (old, old))
    ArtifactStore(remote_root, workdir=tmp_path / "other-machine").delete(keys[1])  # gc on another machine
    assert copies[1].exists()  # still cached here, until this machine trims

    report = cache.trim(store, max_bytes=1500)
    assert report.deleted_in_store == [keys[1]] and report.interrupted == [killed.name]
    assert report.evicted == [keys[0]] and report.kept_bytes < 1500
    assert [c.exists() for c in copies] == [False, False, True]
    assert store.local_path(refs[0]).is_dir()  # evicted: downloaded again, checked against its digest

    # A bound of 0 evicts every copy but the one used just now (by local_path): a stage may be reading it.
    assert cache.trim(store, max_bytes=0).evicted == [keys[2]] and (store.cache_root / keys[0]).is_dir()
    monkeypatch.setenv("POSTTRAIN_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="POSTTRAIN_CACHE_GB='lots'"):
        cache.cache_bound_bytes()

"""Stages on a store served over the S3 API (`s3_server`: 127.0.0.1, a process of its own): they publish there, read
their inputs through this machine's cache of it, and a rerun is a cache hit; `posttrain artifacts gc` on it deletes
in the store and drops this machine's copies.
"""

from __future__ import annotations

import uuid


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

    again = ArtifactStore(root, workdir=tmp_path / "another-machine")  # nothing cached there
    assert run_prepare_data(DataConfig(n_train=60, n_eval=8, n_rl_prompts=16), again) == data
    assert run_build_model(ModelConfig(size="tiny"), data.text, again) == base  # cache hits: no download needed
    assert not (again.cache_root / data.text.key).exists()

    # gc keeps the newest of each stage (here everything) and reports on this machine's cache too.
    from posttrain_core.cli import cmd_gc

    cmd_gc(store, keep_last=1, stage=None, dry_run=False)
    out = capsys.readouterr().out
    assert "deleted 0 artifacts" in out and "removed 0 copies of deleted artifacts" in out, out

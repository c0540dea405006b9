"""The `posttrain` command: store inspection, gc (with lineage, locks, crash leftovers, Prefect cache) in
`posttrain_core.cli`, and `run` in `flows.cli` (the console script, which hands the rest to the core's). A full
`posttrain run` of the SFT flow is in test_sft_flow.py."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from flows.cli import main as posttrain
from posttrain_core.artifacts import ArtifactStore
from posttrain_core.cli import main


def test_ls_show_lineage(tiny_inputs, capsys):
    store, data, base = tiny_inputs
    assert main(["--store", str(store.root), "artifacts", "ls"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["KEY", "KIND", "SCHEMA", "STAGE"] and "SIZE" in header
    assert "build_model" in out and "prepare_data.sft" in out and "KiB" in out
    assert main(["artifacts", "ls", "--store", str(store.root), "--stage", "build_model", "--kind", "model"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [base.key[:12]]
    assert main(["--store", str(store.root), "artifacts", "show", base.key[:12]]) == 0
    assert json.loads(capsys.readouterr().out)["stage"] == "build_model"
    assert main(["--store", str(store.root), "artifacts", "lineage", base.key[:12]]) == 0
    assert capsys.readouterr().out.split() == ["build_model", base.key[:12], "prepare_data.text", data.text.key[:12]]
    assert main(["--store", str(store.root), "artifacts", "sweep"]) == 0
    with pytest.raises(SystemExit, match="no artifact matches key 'zzz'"):
        main(["--store", str(store.root), "artifacts", "show", "zzz"])


# ---------------------------------------------------------------------------------------------------- gc
@pytest.fixture
def gc_store(tmp_path):
    """A store of its own (gc deletes): three prepare_data runs A, B, C (5 datasets each) and two tiny models, mA on
    A's text and the newer mB on B's text."""
    from posttrain_core.config import DataConfig, ModelConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model

    store = ArtifactStore(tmp_path / "store")
    data = {name: run_prepare_data(DataConfig(n_train=40, n_eval=8, seed=i), store) for i, name in enumerate("ABC")}
    tiny = ModelConfig(size="tiny", vocab_size=300)
    models = {name: run_build_model(tiny, data[name].text, store) for name in "AB"}
    return store, data, models


def _keys(refs) -> set[str]:
    return {getattr(refs, name).key for name in ("sft", "eval", "text", "prompts", "preferences")}


def test_gc_keeps_newest_per_stage_and_their_lineage(gc_store, capsys):
    from posttrain_core.config import ModelConfig
    from posttrain_core.models.build import run_build_model
    from posttrain_core.stage import build_lock

    store, data, models = gc_store
    root = ["--store", str(store.root)]
    everything = {r.key for r in store.list()}
    assert len(everything) == 17
    expected_gone = _keys(data["A"]) | {models["A"].key}
    kept = everything - expected_gone  # C: newest data; mB: newest model, so B's data (its lineage) stays too

    # Dry run: lists what would go, deletes nothing.
    assert main([*root, "artifacts", "gc", "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 6 artifacts" in out and "nothing was deleted" in out
    assert f"would delete  {models['A'].key[:12]}  build_model" in out
    assert f"{data['B'].text.key[:12]}  prepare_data.text: input of {models['B'].key[:12]}" in out
    assert {r.key for r in store.list()} == everything

    # A build holding mA's lock: mA is skipped, and so is its lineage (all of A's data).
    with build_lock(store, models["A"].key, "build_model"):
        assert main([*root, "artifacts", "gc", "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert f"skip    {models['A'].key[:12]}  build_model: locked by a running build" in out
    assert f"skip    {data['A'].text.key[:12]}  prepare_data.text: input of {models['A'].key[:12]}" in out
    assert "deleted 0 artifacts" in out and "skipped 6" in out
    assert {r.key for r in store.list()} == everything

    # Unlocked: A's model and data go (children first), the rest stays; deletions are counted per key.
    assert main([*root, "artifacts", "gc", "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted 6 artifacts" in out and "KiB" in out
    assert out.index(f"deleted {models['A'].key[:12]}") < out.index(f"deleted {data['A'].text.key[:12]}")
    assert {r.key for r in store.list()} == kept
    assert all(store.get(k) is None and store.generation(k) == 1 for k in expected_gone)
    assert all(store.generation(k) == 0 for k in kept)
    assert not (store.staging_root / models["A"].key).exists()
    assert [m["stage"] for m in store.lineage(models["B"])] == ["build_model", "prepare_data.text"]
    assert main([*root, "artifacts", "gc", "--keep-last", "1"]) == 0
    assert "deleted 0 artifacts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="it was deleted"):
        main([*root, "artifacts", "show", models["A"].key])

    # A stage whose input was deleted says so (and how to get it back).
    with pytest.raises(FileNotFoundError, match=r"deleted from the store \(1x\).*posttrain artifacts gc.*rebuilds"):
        run_build_model(ModelConfig(size="tiny", vocab_size=300), data["A"].text, store)

    # --stage prunes one stage only; the lineage of what stays is still kept.
    assert main([*root, "artifacts", "gc", "--keep-last", "0", "--stage", "build_model"]) == 0
    assert "deleted 1 artifacts" in capsys.readouterr().out
    assert {r.key for r in store.list()} == kept - {models["B"].key}
    with pytest.raises(SystemExit, match=r"no artifact of stage 'sft' in the store \(stages: prepare_data.eval, "):
        main([*root, "artifacts", "gc", "--keep-last", "1", "--stage", "sft"])


def test_sweep_removes_a_crashed_delete(gc_store, capsys):
    store, data, _ = gc_store
    ref = data["C"].sft
    # What a delete() killed between its rename and its rmtree leaves: the folder moved to `.tmp-{key}-del-{uuid}`.
    target = Path(ref.uri)
    doomed = target.parent / f".tmp-{ref.key}-del-{uuid.uuid4().hex}"
    os.rename(target, doomed)
    assert store.get(ref.key) is None and ref.key not in {r.key for r in store.list()}
    assert main(["--store", str(store.root), "artifacts", "sweep"]) == 0  # at any age: it is garbage by construction
    assert capsys.readouterr().out.strip() == "removed 1 temporary folders"
    assert not doomed.exists() and not [p for p in target.parent.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------------------------------ Prefect cache
def test_stage_cache_key_moves_on_after_a_delete(tmp_path):
    from tasks.common import stage_cache

    store = ArtifactStore(tmp_path / "store")
    key = "ab" + "0" * 62
    cache_key = stage_cache(lambda params, store: key)
    params = {"store_root": str(store.root)}
    before = cache_key(None, params)
    assert before.startswith(f"{key}-") and cache_key(None, params) == before
    out = store.new_output_dir(key)
    (out / "a.bin").write_bytes(b"1")
    store.publish(key, "dataset", out, {"stage": "test"})
    assert cache_key(None, params) == before  # publishing does not move it: only a deletion does
    assert store.delete(key)
    assert cache_key(None, params) == f"{before}-g1"
    assert cache_key(None, {"store_root": str(tmp_path / "other")}) != before  # and stores never share records


@pytest.mark.slow
def test_rerun_after_gc_rebuilds_instead_of_returning_a_deleted_ref(prefect_api, prefect_logging, tmp_path, capsys):
    from prefect import flow

    from posttrain_core.config import DataConfig
    from tasks.data import prepare_data

    @flow(name="cli-gc-data")
    def data_flow(cfg, root):  # no annotations: they would not resolve in a local scope
        state = prepare_data(cfg, root, return_state=True)
        return state.name, state.result()

    store = ArtifactStore(tmp_path / "store")
    cfg = DataConfig(n_train=40, n_eval=8)
    first_state, first = data_flow(cfg, str(store.root))
    again_state, again = data_flow(cfg, str(store.root))
    assert (first_state, again_state) == ("Completed", "Cached") and again == first

    assert main(["--store", str(store.root), "artifacts", "gc", "--keep-last", "0"]) == 0
    assert "deleted 5 artifacts" in capsys.readouterr().out
    assert store.list() == [] and store.generation(first.sft.key) == 1

    rerun_state, rerun = data_flow(cfg, str(store.root))
    assert rerun_state == "Completed"  # not a cache hit on the record that holds the deleted refs
    assert store.get(rerun.sft.key) == rerun.sft and rerun.sft.key == first.sft.key
    assert rerun.sft.digest == first.sft.digest  # deterministic stage: the same content again
    assert data_flow(cfg, str(store.root))[0] == "Cached"  # the new record serves later runs


# --------------------------------------------------------------------------------------------------- run
def test_the_console_script_has_run_and_hands_the_rest_to_the_core(tiny_inputs, capsys):
    store, _, base = tiny_inputs
    assert posttrain(["artifacts", "ls", "--store", str(store.root), "--kind", "model"]) == 0
    assert base.key[:12] in [row.split()[0] for row in capsys.readouterr().out.splitlines()[1:]]
    with pytest.raises(SystemExit) as exc:
        posttrain(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "{artifacts,models,run,serve}" in out
    assert "posttrain artifacts gc --keep-last N" in out and "posttrain run CONFIG.yaml" in out
    assert "posttrain serve --base-model NAME=PATH" in out
    with pytest.raises(SystemExit, match="--base-model 'tiny': expected NAME=PATH"):
        posttrain(["serve", "--base-model", "tiny"])
    assert "posttrain models import FILE.gguf" in out
    with pytest.raises(SystemExit) as exc:
        main(["run", "cfg.yaml"])  # the core library knows no flows
    assert exc.value.code == 2 and "invalid choice: 'run'" in capsys.readouterr().err


def _run_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


SFT_TINY = """\
flow: sft
config:
  store: {store}
  data: {{n_train: 200, n_eval: 16}}
  model: {{size: tiny, vocab_size: 300}}
  pretrain: null
  sft: {{max_steps: 10, global_batch_size: 16, micro_batch_size: 8, max_seq_len: 64, warmup_steps: 2}}
  eval: {{max_new_tokens: 4, max_prompts: 16}}
"""


def _exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        posttrain(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_run_rejects_bad_config_before_starting(tmp_path, capsys):
    store = tmp_path / "store"
    path = _run_file(tmp_path, SFT_TINY.format(store=store))
    err = _exit_2(["run", str(path), "--set", "sft.max_steps=many", "--set", "data.bogus=1"], capsys)
    assert "invalid sft config (2 error(s))" in err
    assert "sft.max_steps: Input should be a valid integer" in err and "(got 'many')" in err
    assert "data.bogus: Extra inputs are not permitted" in err
    err = _exit_2(["run", str(path), "--set", "sft.max_steps=5", "--set", "sft.micro_batch_size=3"], capsys)
    assert "sft: Value error, global_batch_size (16) must be a multiple" in err
    err = _exit_2(["run", str(path), "--set", "pretrain.max_steps"], capsys)
    assert "--set 'pretrain.max_steps': expected dotted.key=value" in err
    err = _exit_2(["run", str(path), "--set", "data.n_train.x=1"], capsys)
    assert "--set data.n_train.x: data.n_train is 200, not a section" in err
    assert not store.exists()  # nothing started


def test_run_names_a_bad_flow_or_file(tmp_path, capsys):
    err = _exit_2(["run", str(_run_file(tmp_path, "flow: nope\nconfig: {}\n"))], capsys)
    assert "flow: 'nope' is not a flow; choose one of sft, rlhf, preference, eval" in err
    err = _exit_2(["run", str(_run_file(tmp_path, "flow: sft\nconfg: {}\n"))], capsys)
    assert "unknown top-level field(s) 'confg'" in err
    err = _exit_2(["run", str(tmp_path / "missing.yaml")], capsys)
    assert "cannot read" in err and "missing.yaml" in err
    err = _exit_2(["run", str(_run_file(tmp_path, "flow: [sft\n"))], capsys)
    assert "run.yaml is not valid YAML" in err

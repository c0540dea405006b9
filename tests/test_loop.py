"""The training loop's pieces, in-process (no Ray): schedules, data order, collation, bf16, checkpoint/resume."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from posttrain_core.config import SFTConfig
from posttrain_core.train.loop import IGNORE, TrainJob, collate, global_batch, lr_lambda, train_loop


def test_lr_schedules_by_hand():
    cfg = SFTConfig(max_steps=12, warmup_steps=2, min_lr_ratio=0.1, schedule="cosine")
    f = lr_lambda(cfg)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half way: 0.55
    assert f(12) == pytest.approx(0.1)
    lin = lr_lambda(SFTConfig(max_steps=12, warmup_steps=2, min_lr_ratio=0.0, schedule="linear"))
    assert lin(7) == pytest.approx(0.5)
    assert lr_lambda(SFTConfig(warmup_steps=0, schedule="constant"))(100) == 1.0


def test_global_batches_are_deterministic_and_cover_each_epoch():
    n, b = 10, 4
    stream = [i for step in range(5) for i in global_batch(step, n, b, seed=3)]
    assert stream == [i for step in range(5) for i in global_batch(step, n, b, seed=3)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream != [i for step in range(5) for i in global_batch(step, n, b, seed=4)]


def test_collate_pads_right_and_ignores_padding():
    ids, labels, mask = collate([([5, 6, 7], [IGNORE, 6, 7]), ([8], [8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert labels.tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_bf16_training_and_resume_in_process(tiny_inputs, tmp_path):
    """world=1 needs no process group: run 2 steps with a checkpoint, then continue to 4 from it."""
    from transformers import AutoModelForCausalLM

    store, data, base = tiny_inputs
    common = dict(
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        warmup_steps=0,
        checkpoint_every=2,
        log_every=1,
        num_workers=1,
        dtype="bfloat16",
        lr=1e-2,
    )

    def job(max_steps: int, out: str) -> TrainJob:
        return TrainJob(
            "sft",
            SFTConfig(max_steps=max_steps, **common),
            str(store.local_path(data.sft)),
            str(store.local_path(base)),
            str(tmp_path / "work"),
            str(tmp_path / out),
        )

    first = train_loop(job(3, "out1"), rank=0, world=1)
    assert first["resumed_from_step"] == 0 and len(first["loss_history"]) == 3
    assert all(math.isfinite(x) for x in first["loss_history"])
    second = train_loop(job(5, "out2"), rank=0, world=1)  # the step-2 checkpoint of the first run is the newest
    assert second["resumed_from_step"] == 2 and second["steps_run"] == 3
    assert second["loss_history"][0] == pytest.approx(first["loss_history"][2], rel=1e-6)  # same step-3 batch
    AutoModelForCausalLM.from_pretrained(tmp_path / "out2")


def test_tracking_defaults_to_sqlite_in_the_store(monkeypatch, tmp_path):
    from posttrain_core import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking.flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "null"}


def test_gradient_checkpointing_trains_the_same_steps(tiny_inputs, tmp_path):
    """Activations recomputed in the backward pass: the same losses and weights as keeping them (float rounding)."""
    from safetensors.torch import load_file

    from posttrain_core.models.loading import enable_gradient_checkpointing
    from posttrain_core.models.tiny import build_tiny_model

    model = build_tiny_model(vocab_size=300)
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)
    enable_gradient_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)

    store, data, base = tiny_inputs
    common = dict(max_steps=3, global_batch_size=8, micro_batch_size=4, max_seq_len=64, warmup_steps=0,
                  checkpoint_every=0, num_workers=1, lr=1e-2)  # fmt: skip
    runs = {}
    for gc in (False, True):
        out = tmp_path / f"gc-{gc}"
        cfg = SFTConfig(gradient_checkpointing=gc, **common)
        runs[gc] = train_loop(
            TrainJob("sft", cfg, str(data.sft.path), base.uri, str(tmp_path / f"w-{gc}"), str(out)), 0, 1
        )
        runs[gc]["weights"] = load_file(str(out / "model.safetensors"))
    assert runs[True]["loss_history"] == pytest.approx(runs[False]["loss_history"], abs=1e-5)
    for name, w in runs[False]["weights"].items():
        assert (runs[True]["weights"][name] - w).abs().max() < 1e-4, name


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc tuning")
def test_workers_keep_freed_memory_for_the_next_step():
    """`keep_freed_memory` (called by every rank and rollout actor): a freed 256 MiB tensor stays mapped for the next
    step to reuse, instead of being unmapped and faulted in again page by page."""
    code = textwrap.dedent(
        """
        import os, torch
        from posttrain_core.cluster import keep_freed_memory
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        applied = keep_freed_memory()
        x = torch.ones(64 << 20)  # 256 MiB, written
        before = rss()
        del x
        print(applied, before - rss())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    applied, returned_mib = out.split()
    assert applied == "True"
    assert int(returned_mib) < 16, out  # still resident



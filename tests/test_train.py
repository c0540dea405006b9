"""The training loop on Ray workers: loss independent of the worker count, resume after a killed worker."""

from __future__ import annotations

import pytest

from posttrain_core.config import SFTConfig

pytestmark = pytest.mark.slow


def _history(store, ref):
    return store.manifest(ref)["loss_history"]


def test_two_workers_match_one_worker_on_the_same_global_batch(ray_session, tiny_inputs):
    """Same global batch of 8: 1 worker x (4 x 2 accumulation) vs 2 workers x 4. Loss over the global token count."""
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.train.sft import run_sft

    store, data, base = tiny_inputs
    common = dict(
        max_steps=4,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        warmup_steps=0,
        checkpoint_every=0,
        lr=1e-2,
        log_every=1,
    )
    one = run_sft(SFTConfig(num_workers=1, **common), data.sft, base, store)
    two = run_sft(SFTConfig(num_workers=2, **common), data.sft, base, store)
    h1, h2 = _history(store, one), _history(store, two)
    assert len(h1) == len(h2) == 4
    assert h1 == pytest.approx(h2, rel=1e-4, abs=1e-5)
    assert h1[-1] < h1[0]  # it does train
    m1, m2 = load_causal_lm(one.uri), load_causal_lm(two.uri)
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert (p1 - p2).abs().max().item() < 1e-4, n


def test_killed_worker_resumes_from_last_in_stage_checkpoint(
    prefect_api, ray_session, tiny_inputs, tmp_path, fail_training_after
):
    """Rank 0 really exits (os._exit) after step 10's checkpoint; Prefect retries the task; the retry resumes at 10
    and ends exactly where an uninterrupted run ends."""
    from prefect import flow

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.train.sft import run_sft
    from tasks.train import sft

    store, data, base = tiny_inputs
    cfg = SFTConfig(
        max_steps=20,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=64,
        checkpoint_every=5,
        warmup_steps=2,
        log_every=5,
    )

    @flow
    def resume_flow(root: str):
        return sft(cfg, data.sft, base, root, return_state=True)

    root = str(tmp_path / "resume-store")
    with fail_training_after(10):
        task_state = resume_flow(root)
    assert task_state.is_completed(), task_state

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(task_state.state_details.task_run_id)
    assert task_run.run_count == 2  # the first attempt died with its worker

    resumed_store = ArtifactStore(root)
    ref = task_state.result()
    manifest = resumed_store.manifest(ref)
    assert manifest["resumed_from_step"] == 10
    assert len(manifest["loss_history"]) == 10  # steps 11..20 only
    assert not (resumed_store.staging_dir(ref.key) / "checkpoints").exists()  # staging swept after publish

    # An uninterrupted run (other store, same key) reaches the same losses: data position, optimizer, scheduler
    # and RNG state were all restored.
    clean = ArtifactStore(tmp_path / "clean-store")
    clean_ref = run_sft(cfg, data.sft, base, clean)
    assert clean_ref.key == ref.key
    assert _history(clean, clean_ref)[10:] == pytest.approx(manifest["loss_history"], rel=1e-4, abs=1e-5)

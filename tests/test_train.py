"""The training loop on Ray workers: loss independent of the worker count.

(Resume after a killed worker, against an uninterrupted run: test_faults.py.)
"""

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


def test_training_stages_share_the_process_warm_ranks(ray_session, tiny_inputs):
    """Every trainer runs on the process's warm ranks (`WarmGroup.process()`): a second SFT stage takes the same 2
    processes, each hosting a new trainer, though a 1-rank stage ran between them (a set of ranks per count); a stage
    on warm ranks publishes the same bits as on ranks started for it."""
    from posttrain_core.train.sft import run_sft
    from posttrain_core.warm import RANKS, WarmGroup, counted

    store, data, base = tiny_inputs
    common = dict(max_steps=2, global_batch_size=8, micro_batch_size=4, max_seq_len=64, warmup_steps=0,
                  checkpoint_every=0, log_every=1, num_workers=2)  # fmt: skip
    warm = WarmGroup.process()
    run_sft(SFTConfig(lr=3e-3, **common), data.sft, base, store)
    two = counted(RANKS, 2)
    ranks = [a._actor_id.hex() for a in warm.members(two)]
    run_sft(SFTConfig(lr=3e-3, **{**common, "num_workers": 1}), data.sft, base, store)
    second = run_sft(SFTConfig(lr=4e-3, **common), data.sft, base, store)
    assert len(ranks) == 2 and [a._actor_id.hex() for a in warm.members(two)] == ranks
    digest = second.digest

    store.delete(second.key)
    warm.discard(two)  # the same stage again, on ranks started for it
    again = run_sft(SFTConfig(lr=4e-3, **common), data.sft, base, store)
    assert again.digest == digest and [a._actor_id.hex() for a in warm.members(two)] != ranks

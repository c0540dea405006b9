"""Warm rollout engines (`cluster.WarmGroup`, `rollout.pool`): engines that outlive rollout stages take each new
policy (vLLM: in-place weight update; hf: reload in the same actor), give the rows fresh engines give, recover from a
dead actor, never publish rows of another policy, and are gone once the group is released."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from posttrain_core.config import RolloutConfig
from posttrain_core.rollout.pool import ROLE
from posttrain_core.warm import counted

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_b(tiny_inputs, tmp_path_factory):
    """A second policy with the base's architecture and tokenizer (weights scaled: it samples differently)."""
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer, save_checkpoint

    store, _, base = tiny_inputs
    model = load_causal_lm(store.local_path(base))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    path = tmp_path_factory.mktemp("policy-b") / "model"
    save_checkpoint(model, load_tokenizer(store.local_path(base)), path)
    return store.register_external(path)


def _rows(store, ref) -> list[tuple]:
    from posttrain_core.data.io import read_dataset

    t = read_dataset(store.local_path(ref), "rollouts")
    cols = ["prompt_id", "sample_index", "response_ids", "policy_digest"]
    return list(zip(*(t.column(c).to_pylist() for c in cols), strict=True))


def _engines(group, n: int) -> list[str]:
    """The ids of the group's `n` policy engines (a set per engine count)."""
    return [a._actor_id.hex() for a in group.members(counted(ROLE, n))]


def _dies(actor, within_s: float = 60.0) -> bool:
    """Whether the actor is dead, or dies within `within_s` (a kill takes effect asynchronously)."""
    import time

    import ray

    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    return False


def _fresh_rows(cfg: RolloutConfig, tiny_inputs, policy_b, root) -> list[tuple]:
    """Policy B's rows from engines started for this stage alone (a group of its own): what warm engines must give."""
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.warm import WarmGroup

    store = ArtifactStore(root)
    with WarmGroup.owned("fresh") as group:
        ref = run_rollout(cfg, tiny_inputs[1].eval, policy_b, store, warm=group)
    assert store.manifest(ref)["engine_load"] == "started"
    return _rows(store, ref)


HF_CFG = RolloutConfig(n=3, max_tokens=6, num_engines=2, batch_size=4, max_prompts=10, seed=3)


@pytest.fixture(scope="module")
def hf_rows_b(ray_session, tiny_inputs, policy_b, tmp_path_factory) -> list[tuple]:
    """`_fresh_rows` with HF_CFG, which both hf pool tests compare with."""
    return _fresh_rows(HF_CFG, tiny_inputs, policy_b, tmp_path_factory.mktemp("cold"))


def _check_pool(
    cfg: RolloutConfig, tiny_inputs, policy_b, tmp_path, new_policy_action: str, fresh_b, kill: bool = True
) -> None:
    import ray

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.warm import WarmGroup

    _, data, base = tiny_inputs
    warm = ArtifactStore(tmp_path / "warm")
    with WarmGroup.owned("test") as group:
        a = run_rollout(cfg, data.eval, base, warm, warm=group)
        actors, handles = _engines(group, cfg.num_engines), group.members(counted(ROLE, cfg.num_engines))
        assert len(actors) == cfg.num_engines
        b = run_rollout(cfg, data.eval, policy_b, warm, warm=group)
        assert _engines(group, cfg.num_engines) == actors  # the same actors served both policies
        assert warm.manifest(a)["engine_load"] == "started"
        assert warm.manifest(b)["engine_load"] == new_policy_action
        assert "engine_load_s" in warm.manifest(b)["metrics"]
        rows_a, rows_b = _rows(warm, a), _rows(warm, b)
        assert {r[3] for r in rows_a} == {base.digest} and {r[3] for r in rows_b} == {policy_b.digest}
        assert [r[2] for r in rows_a] != [r[2] for r in rows_b]  # the new weights are in use
        # The rows equal those of engines started for a stage alone (released with it) from policy B.
        assert fresh_b == rows_b

        if not kill:
            return
        # A dead engine actor (killed between stages) is replaced; the next stage still gets base's rows.
        ray.kill(handles[0], no_restart=True)
        c = run_rollout(cfg, data.eval, base, ArtifactStore(tmp_path / "after-kill"), warm=group)
        assert _engines(group, cfg.num_engines) != actors
        assert _rows(ArtifactStore(tmp_path / "after-kill"), c) == rows_a
        handles = group.members(counted(ROLE, cfg.num_engines))
    assert group.members(counted(ROLE, cfg.num_engines)) == []  # released with the group: its actors are gone
    assert all(_dies(h) for h in handles)


def test_hf_pool_reloads_each_policy_in_the_same_actors(ray_session, tiny_inputs, policy_b, hf_rows_b, tmp_path):
    _check_pool(HF_CFG, tiny_inputs, policy_b, tmp_path, "reloaded", hf_rows_b)


def test_vllm_pool_updates_weights_in_place(ray_session, tiny_inputs, policy_b, tmp_path, vllm_or_skip):
    """What the hf pool test checks, but the replacement of a dead actor: the group's, whatever the engine."""
    cfg = RolloutConfig(engine="vllm", n=2, max_tokens=6, num_engines=1, batch_size=8, max_prompts=6, seed=3)
    vllm_or_skip(cfg)
    _check_pool(
        cfg,
        tiny_inputs,
        policy_b,
        tmp_path,
        "updated",
        _fresh_rows(cfg, tiny_inputs, policy_b, tmp_path / "cold"),
        kill=False,
    )


def test_rows_of_another_policy_are_never_published(tiny_inputs):
    from posttrain_core.rollout.stage import _check_policy

    _, _, base = tiny_inputs
    table = pa.table({"prompt_id": ["p0", "p1"], "policy_digest": [base.digest, "0" * 64]})
    _check_policy(table.slice(0, 1), base, "rollout")
    with pytest.raises(RuntimeError, match=r"1 samples \(first: prompt 'p1'\).*nothing is published"):
        _check_policy(table, base, "rollout")


def test_hf_pool_prefetch_gives_the_rows_of_the_published_policy(
    ray_session, tiny_inputs, policy_b, hf_rows_b, tmp_path
):
    """An RL update hands the next policy's weights to the pool before publishing it (`prefetch_rollout`): the
    rollout stage of that policy takes the prefetched rows, which equal fresh engines' rows; a prefetch of another
    key, or of weights that do not fit the model, is never used, and the stage's rows are still right."""
    import ray

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.rollout.stage import prefetch_rollout, run_rollout
    from posttrain_core.warm import WarmGroup

    _, data, base = tiny_inputs
    cfg, expected = HF_CFG, hf_rows_b
    weights_b = {k: v.numpy() for k, v in load_causal_lm(policy_b.uri).state_dict().items()}
    with WarmGroup.owned("test") as group:
        store = ArtifactStore(tmp_path / "warm")
        assert not prefetch_rollout(group, cfg, data.eval, base, policy_b.key, lambda: ray.put(weights_b), store), (
            "no engines yet: no prefetch"
        )
        run_rollout(cfg, data.eval, base, store, warm=group)  # the engines serve base, like an update's input
        assert not prefetch_rollout(group, cfg, data.eval, policy_b, policy_b.key, lambda: ray.put(weights_b), store), (
            "the engines do not serve policy B: no prefetch"
        )
        assert prefetch_rollout(group, cfg, data.eval, base, policy_b.key, lambda: ray.put(weights_b), store)
        ref = run_rollout(cfg, data.eval, policy_b, store, warm=group)
        manifest = store.manifest(ref)
        assert manifest["engine_load"] == "prefetched"
        assert manifest["metrics"]["generate_overlap_s"] >= 0
        assert _rows(store, ref) == expected  # stamped with policy B's digest, the same samples

        # Back to base; a prefetch under another key, or of weights that do not fit, is discarded: the stage reloads
        # policy B from its folder.
        for i, (weights, key) in enumerate([(weights_b, "f" * 64), ({"lm_head.weight": weights_b["lm_head.weight"]},
                                                                    policy_b.key)]):  # fmt: skip
            other = ArtifactStore(tmp_path / f"other-{i}")
            run_rollout(cfg, data.eval, base, other, warm=group)
            assert prefetch_rollout(group, cfg, data.eval, base, key, lambda w=weights: ray.put(w), other)
            ref = run_rollout(cfg, data.eval, policy_b, other, warm=group)
            assert other.manifest(ref)["engine_load"] == "reloaded", i
            assert _rows(other, ref) == expected, i

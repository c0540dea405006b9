"""The RL update stage on a tiny model on Ray (2 workers): it moves log-probs the way the advantages say.

Responses to the same prompts get hand-set rewards (samples 0-1 of a prompt: 1, samples 2-3: 0), so GRPO and PPO
must raise the log-prob of the rewarded responses and lower the others'.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sampled(tiny_inputs, ray_session):
    """(store, policy ref, rollouts ref) from the real rollout stage on the tiny base model."""
    from posttrain_core.config import RolloutConfig
    from posttrain_core.rollout.stage import run_rollout

    store, data, base = tiny_inputs
    cfg = RolloutConfig(n=4, max_prompts=6, max_tokens=6, num_engines=1, batch_size=8, seed=3)
    return store, base, run_rollout(cfg, data.prompts, base, store)


@pytest.fixture(scope="module")
def ranks(ray_session):
    """The process's warm group, handed to every update as a flow run hands it (`warm=`): each update still loads its
    policy from the store unless the ranks built it."""
    from posttrain_core.warm import WarmGroup

    return WarmGroup.process()


def _scored_with(store, rollouts, rewards_of, name: str):
    """Publish the rollouts as scored_rollouts with reward = rewards_of(sample_index)."""
    from posttrain_core.artifacts.keys import stage_key
    from posttrain_core.config import ScoreConfig
    from posttrain_core.data.io import read_dataset, write_dataset
    from posttrain_core.rewards.score import score_rollouts

    table = score_rollouts(read_dataset(store.local_path(rollouts), "rollouts"), ScoreConfig())
    rewards = [rewards_of(k) for k in table.column("sample_index").to_pylist()]
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float32()))
    key = stage_key(f"test-scored-{name}", {"rewards": rewards}, [rollouts.digest])
    if store.get(key):
        return store.get(key)
    out = store.new_output_dir(key)
    write_dataset(table, "scored_rollouts", out)
    return store.publish(key, "dataset", out, {"stage": "test"}, schema_kind="scored_rollouts")


def _sequence_logprobs(model_path: str, store, rollouts) -> list[float]:
    import torch

    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.train.rl_batch import RLBatch, encode, response_logprobs

    rows = read_dataset(store.local_path(rollouts), "rollouts").to_pylist()
    batch = RLBatch(
        prompt_ids=[r["prompt_ids"] for r in rows],
        response_ids=[r["response_ids"] for r in rows],
        response_mask=[[1] * len(r["response_ids"]) for r in rows],
        logprobs=[r["logprobs"] for r in rows],
        rewards=[0.0] * len(rows),
        groups=[0] * len(rows),
        correct=[False] * len(rows),
    )
    model = load_causal_lm(model_path).eval()
    ids, attn, pos, labels, mask = encode(batch, list(range(len(rows))), 0)
    with torch.no_grad():
        logp = response_logprobs(model, ids, attn, pos, labels).logp
    return (logp * mask).sum(-1).tolist()


@pytest.mark.parametrize(
    "algorithm,lora",
    [("grpo", False), ("ppo", False), ("reinforce_pp_baseline", True)],
)
def test_update_raises_rewarded_and_lowers_unrewarded_logprobs(sampled, algorithm, lora, ranks):
    from posttrain_core.config import LoraConfig, RLConfig
    from posttrain_core.models.loading import check_model_path
    from posttrain_core.train.rl_stage import run_rl_update

    store, base, rollouts = sampled
    scored = _scored_with(store, rollouts, lambda k: 1.0 if k < 2 else 0.0, "half")
    cfg = RLConfig(
        algorithm=algorithm,
        lr=3e-3 if lora else 1e-3,
        ppo_epochs=2,
        mini_batches=2,
        micro_batch_size=4,
        lora=LoraConfig(r=4, alpha=8) if lora else None,
    )
    new = run_rl_update(cfg, [scored], base, base, store, warm=ranks)

    before = _sequence_logprobs(str(store.local_path(base)), store, rollouts)
    after = _sequence_logprobs(str(store.local_path(new)), store, rollouts)
    k = [i % 4 for i in range(len(before))]
    up = [a - b for a, b, s in zip(after, before, k, strict=True) if s < 2]
    down = [a - b for a, b, s in zip(after, before, k, strict=True) if s >= 2]
    assert sum(up) / len(up) > 0 > sum(down) / len(down), (up, down)

    manifest = store.manifest(new)
    metrics = manifest["metrics"]
    assert metrics["logp_mismatch_mean"] < 1e-4, metrics  # the hf engine's log-probs are the trainer's
    assert metrics["optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
    assert metrics["zero_advantage_frac"] < 0.5
    assert check_model_path(new.uri)["is_adapter"] is lora
    assert (manifest["critic"] is not None) is (algorithm == "ppo")
    if lora:  # the reference is the base with the adapter disabled: KL starts at 0 exactly
        assert metrics["kl_k1"] == 0.0 and metrics["kl_k3"] == 0.0


def test_stale_rollouts_are_refused(sampled, tiny_inputs, ranks):
    """Samples of one policy given to the update of another: an error naming the row, nothing published."""
    from posttrain_core.config import RLConfig
    from posttrain_core.train.rl_stage import run_rl_update

    store, base, rollouts = sampled
    scored = _scored_with(store, rollouts, lambda k: float(k % 2), "alt")
    cfg = RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8)
    first = run_rl_update(cfg, [scored], base, base, store, warm=ranks)
    n_before = len(store.list())
    with pytest.raises(ValueError, match=r"row 0 was sampled by policy .* stale weights"):
        run_rl_update(cfg, [scored], first, base, store, warm=ranks)
    assert len(store.list()) == n_before


def test_update_is_cached_and_continues_optimizer_state(sampled, tiny_inputs):
    """Same inputs: a cache hit. The next update (on the new policy's own samples) continues its optimizer state:
    in a warm group from the ranks' memory, with the same bits as fresh ranks that reload it from the artifact."""
    import torch

    from posttrain_core.config import RLConfig, RolloutConfig
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.train.rl_stage import run_rl_update
    from posttrain_core.train.rl_state import STATE_FILE
    from posttrain_core.warm import RANKS, WarmGroup, counted

    store, base, rollouts = sampled
    scored = _scored_with(store, rollouts, lambda k: float(k == 0), "first")
    cfg = RLConfig(algorithm="rloo", lr=1e-3, micro_batch_size=8, mini_batches=1)
    rollout_cfg = RolloutConfig(n=4, max_prompts=6, max_tokens=6, num_engines=1, batch_size=8, seed=4)
    with WarmGroup.owned("test") as warm:
        a = run_rl_update(cfg, [scored], base, base, store, warm=warm)
        ranks = warm.members(counted(RANKS, cfg.num_workers))
        assert len(ranks) == cfg.num_workers
        assert run_rl_update(cfg, [scored], base, base, store, warm=warm) == a  # cache hit
        assert store.manifest(a)["metrics"]["optimizer_steps"] == 1
        state = torch.load(store.local_path(a) / STATE_FILE, weights_only=False)
        assert state["step"] == 1 and state["policy_optimizer"]["state"], "Adam moments are carried to the next update"

        again = run_rollout(rollout_cfg, tiny_inputs[1].prompts, a, store)
        second = _scored_with(store, again, lambda k: float(k == 1), "second")
        b = run_rl_update(cfg, [second], a, base, store, warm=warm)
        metrics = store.manifest(b)["metrics"]
        assert metrics["optimizer_steps"] == 2 and metrics["continued_in_memory"] == 1.0
        assert warm.members(counted(RANKS, cfg.num_workers)) == ranks  # the same ranks did both updates
    assert warm.members(counted(RANKS, cfg.num_workers)) == []  # released with the group

    store.delete(b.key)  # the same update by fresh ranks that load policy, reference and optimizer from `a`
    with WarmGroup.owned("fresh") as fresh:
        reloaded = run_rl_update(cfg, [second], a, base, store, warm=fresh)
    assert store.manifest(reloaded)["metrics"]["continued_in_memory"] == 0.0
    assert reloaded.digest == b.digest  # policy weights, Adam moments and step: identical


def test_reference_log_probs_computed_inside_the_update_match_the_separate_pass(sampled, ranks):
    """One optimizer step per batch with the KL in the loss (GRPO, 1 epoch x 1 mini-batch): the driver needs nothing
    from `prepare`, so each update micro-step computes its rows' reference log-probs itself. With 2 mini-batches the
    separate pass runs instead. Both measure the sampling policy against the reference on the same tokens, so the
    KL to the reference and the engine-vs-trainer gap they report must agree."""

    from posttrain_core.config import LoraConfig, RLConfig
    from posttrain_core.train.rl_stage import run_rl_update

    store, base, rollouts = sampled
    scored = _scored_with(store, rollouts, lambda k: 1.0 if k < 2 else 0.0, "half")
    # a reference that is not the policy, so that the KL term is not trivially 0
    reference = run_rl_update(RLConfig(algorithm="grpo", lr=1e-2, micro_batch_size=8, seed=9), [scored], base, base,
                              store, warm=ranks)  # fmt: skip
    settings = dict(algorithm="grpo", lr=1e-3, ppo_epochs=1, kl_coef=0.5, micro_batch_size=8)
    separate = store.manifest(
        run_rl_update(RLConfig(**settings, mini_batches=2), [scored], base, reference, store, warm=ranks)
    )
    inside = store.manifest(
        run_rl_update(RLConfig(**settings, mini_batches=1), [scored], base, reference, store, warm=ranks)
    )

    a, b = separate["metrics"], inside["metrics"]
    assert a["reference_in_update"] == 0.0 and b["reference_in_update"] == 1.0
    assert a["kl_k1"] > 1e-3 and b["kl_loss"] > 0, (a, b)  # the reference differs from the policy
    for name in ("kl_k1", "kl_k3", "logp_mismatch_mean"):
        assert math.isclose(a[name], b[name], rel_tol=1e-4, abs_tol=1e-6), (name, a[name], b[name])

    # LoRA: the reference is the policy with its adapter disabled, computed inside the update too (KL exactly 0)
    lora = RLConfig(**settings, mini_batches=1, lora=LoraConfig(r=4, alpha=8))
    c = store.manifest(run_rl_update(lora, [scored], base, base, store, warm=ranks))["metrics"]
    assert c["reference_in_update"] == 1.0 and c["kl_k1"] == 0.0 and c["kl_k3"] == 0.0, c


def test_shared_prompts_and_the_worker_count_leave_the_update_the_same(sampled, ranks):
    """Each group's prompt run once (a rank takes whole groups), on 2 workers or 1, or every row in full (gradient
    checkpointing keeps no KV cache to share): the same losses, entropy and gradient norm, since every split of a
    mini-batch sums to the same gradient."""
    from posttrain_core.config import RLConfig
    from posttrain_core.train.rl_stage import run_rl_update

    store, base, rollouts = sampled
    scored = _scored_with(store, rollouts, lambda k: [1.0, 0.0, 0.5, 0.0][k], "shared")
    settings = dict(algorithm="grpo", lr=1e-3, ppo_epochs=1, mini_batches=2, kl_coef=0.1)
    # micro-batch sizes differ so that each run is its own stage (another key), not a cache hit
    two = store.manifest(
        run_rl_update(RLConfig(**settings, micro_batch_size=4), [scored], base, base, store, warm=ranks)
    )
    one = store.manifest(
        run_rl_update(RLConfig(**settings, micro_batch_size=8, num_workers=1), [scored], base, base, store, warm=ranks)
    )
    full = store.manifest(
        run_rl_update(
            RLConfig(**settings, micro_batch_size=6, gradient_checkpointing=True),
            [scored],
            base,
            base,
            store,
            warm=ranks,
        )
    )

    # 6 prompts x 4 samples: a mini-batch of 12 rows holds whole groups on each rank, so prompts run once per group
    assert two["metrics"]["prompt_tokens_shared_frac"] > 0.2, two["metrics"]
    assert one["metrics"]["prompt_tokens_shared_frac"] > 0.2 and full["metrics"]["prompt_tokens_shared_frac"] == 0.0
    for other in (one, full):
        for name in ("pg_loss", "kl_loss", "entropy", "clip_frac", "grad_norm", "logp_mismatch_mean"):
            a, b = two["metrics"][name], other["metrics"][name]
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (name, a, b)


def test_a_policy_with_dropout_takes_its_old_log_probs_from_an_eval_mode_pass(sampled, tiny_inputs, tmp_path, ranks):
    """A policy with active dropout and one optimizer step per batch: its train-mode forward is stochastic, so the
    old log-probs come from `prepare`'s eval-mode pass (as they would with more steps), and match the engine's."""
    import json
    import shutil

    from posttrain_core.config import RLConfig, RolloutConfig
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.train.rl_stage import run_rl_update

    store, base, _ = sampled
    folder = tmp_path / "dropout-policy"
    shutil.copytree(store.local_path(base), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    policy = store.register_external(str(folder), kind="model")
    cfg = RolloutConfig(n=4, max_prompts=6, max_tokens=6, num_engines=1, batch_size=8, seed=6)
    rollouts = run_rollout(cfg, tiny_inputs[1].prompts, policy, store)
    scored = _scored_with(store, rollouts, lambda k: float(k % 2), "dropout")
    rl = RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8, mini_batches=1, kl_coef=0.0, kl_placement="none")
    metrics = store.manifest(run_rl_update(rl, [scored], policy, policy, store, warm=ranks))["metrics"]
    assert metrics["reference_in_update"] == 0.0, metrics  # `prepare` ran, for the dropout
    assert metrics["logp_mismatch_mean"] < 1e-4, metrics  # a train-mode (dropout) pass would differ by far more


def test_update_on_vllm_rollouts_checks_the_engine_trainer_mismatch(
    sampled, tiny_inputs, vllm_or_skip, vllm_warm, ranks
):
    """Rollouts from the vLLM engine (its own environment, seeded T=1 sampling) feed the update; the mismatch between
    the engine's log-probs and the trainer's recomputed ones is logged and small (same weights, fp32 both sides)."""
    from posttrain_core.config import RLConfig, RolloutConfig
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.train.rl_stage import run_rl_update

    cfg = RolloutConfig(engine="vllm", n=4, max_prompts=6, max_tokens=6, num_engines=1, batch_size=8, seed=5)
    vllm_or_skip(cfg)
    store, base, _ = sampled
    rollouts = run_rollout(cfg, tiny_inputs[1].prompts, base, store, warm=vllm_warm)
    scored = _scored_with(store, rollouts, lambda k: float(k % 2), "vllm")
    new = run_rl_update(
        RLConfig(algorithm="grpo", lr=1e-3, micro_batch_size=8), [scored], base, base, store, warm=ranks
    )
    metrics = store.manifest(new)["metrics"]
    assert metrics["logp_mismatch_mean"] < 1e-2, metrics  # two engines: not bit-identical, but close
    assert metrics["logp_mismatch_max"] < 0.1, metrics

"""Off-policy corrections (`algorithms/off_policy.py`) against hand-computed examples, and how the update's targets
apply them (`train/rl_targets.py`)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain_core.algorithms.off_policy import OFF_POLICY_CORRECTIONS, OffPolicyInputs, correction_metrics

# Two rows of three tokens; row 1's last token is padding. w = pi_prox / mu = 1, 3, 0.25 | 1.5, 0.4, (pad).
PROX = torch.log(torch.tensor([[0.3, 0.6, 0.1], [0.6, 0.2, 0.5]]))
MU = torch.log(torch.tensor([[0.3, 0.2, 0.4], [0.4, 0.5, 0.5]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _weights(name: str, **kw) -> torch.Tensor:
    return OFF_POLICY_CORRECTIONS[name](OffPolicyInputs(PROX, MU, MASK, **kw))


def test_each_correction_against_a_hand_computed_example():
    close = dict(atol=1e-6, rtol=0)
    torch.testing.assert_close(_weights("none"), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), **close)
    torch.testing.assert_close(_weights("decoupled"), torch.tensor([[1.0, 3.0, 0.25], [1.5, 0.4, 0.0]]), **close)
    torch.testing.assert_close(_weights("tis", cap=2.0), torch.tensor([[1.0, 2.0, 0.25], [1.5, 0.4, 0.0]]), **close)
    kept = _weights("token_mask", low=0.5, high=2.0)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), **close)
    # geometric means: row 0 (1 * 3 * 0.25)^(1/3) = 0.909 (kept), row 1 (1.5 * 0.4)^(1/2) = 0.775 (kept at 0.5,
    # rejected at 0.8)
    torch.testing.assert_close(_weights("seq_mask", low=0.5, high=2.0), MASK.float(), **close)
    torch.testing.assert_close(
        _weights("seq_mask", low=0.8, high=2.0), torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), **close
    )


def test_the_metrics_and_the_effective_sample_size_by_hand():
    inp = OffPolicyInputs(PROX, MU, MASK, cap=2.0)
    m = correction_metrics(inp, _weights("tis", cap=2.0))
    w = [1.0, 3.0, 0.25, 1.5, 0.4]
    assert m["is_weight_mean"] == pytest.approx(sum(w) / 5) and m["is_weight_max"] == pytest.approx(3.0)
    assert m["is_weight_min"] == pytest.approx(0.25) and m["is_clip_frac"] == pytest.approx(1 / 5)
    assert m["is_ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    assert m["is_masked_frac"] == 0.0
    assert correction_metrics(inp, _weights("token_mask"))["is_masked_frac"] == pytest.approx(3 / 5)
    on_policy = correction_metrics(OffPolicyInputs(PROX, PROX, MASK), _weights("none"))
    assert on_policy["is_ess"] == pytest.approx(1.0) and on_policy["is_weight_max"] == pytest.approx(1.0)


def test_an_impossible_behaviour_token_gives_a_finite_weight():
    inp = OffPolicyInputs(torch.zeros(1, 1), torch.full((1, 1), -1e4), torch.ones(1, 1))
    assert math.isfinite(float(OFF_POLICY_CORRECTIONS["decoupled"](inp)))


def test_on_policy_rows_leave_the_advantages_as_they_are_within_the_log_prob_tolerance():
    """L = 0 with an fp32 engine: mu and pi_prox agree to the existing log-prob tolerance (1e-5), so w = 1 within it
    and the corrected advantages (and with them the loss) equal the plain ones."""
    from posttrain_core.config import RLConfig
    from posttrain_core.train.rl_batch import Prepared, RLBatch
    from posttrain_core.train.rl_targets import compute_targets

    g = torch.Generator().manual_seed(0)
    old = (-torch.rand(4, 5, generator=g) * 3).tolist()
    engine = [[x + 1e-6 * (-1) ** i for i, x in enumerate(row)] for row in old]
    batch = RLBatch(prompt_ids=[[1]] * 4, response_ids=[[2] * 5] * 4, response_mask=[[1] * 5] * 4, logprobs=engine,
                    rewards=[1.0, 0.0, 1.0, 1.0], groups=[0, 0, 1, 1], correct=[True, False, True, True])  # fmt: skip
    plain, _ = compute_targets(RLConfig(kl_coef=0.0).resolved(), batch, Prepared(old_logp=old), 0.0, 1)
    for name in ("tis", "decoupled", "token_mask"):
        cfg = RLConfig(kl_coef=0.0, off_policy=name).resolved()
        corrected, metrics = compute_targets(cfg, batch, Prepared(old_logp=old), 0.0, 1)
        torch.testing.assert_close(
            torch.tensor(corrected.advantages), torch.tensor(plain.advantages), atol=1e-5, rtol=0
        )
        assert abs(metrics["is_weight_max"] - 1) < 1e-5 and metrics["is_ess"] == pytest.approx(1.0)


def test_a_lag_refuses_what_it_cannot_combine_with():
    from posttrain_core.config import RLConfig

    with pytest.raises(ValueError, match="dynamic sampling"):
        RLConfig(algorithm="dapo", rollout_lag=1)
    with pytest.raises(ValueError, match="PRIME"):
        RLConfig(algorithm="prime", rollout_lag=1)
    with pytest.raises(ValueError, match="is_low"):
        RLConfig(is_low=3.0, is_high=2.0)

"""Preference losses against hand-computed numbers: Bradley-Terry, DPO / IPO / cDPO, summed sequence log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain_core.algorithms.preference import DPO_LOSSES, LOSSES, bradley_terry_loss, dpo_loss


def _nls(x: float) -> float:
    """-log sigmoid(x) = log(1 + e^-x)."""
    return math.log1p(math.exp(-x))


def test_bradley_terry_hand_computed():
    # diffs: 1 - 0 = 1, 0 - 2 = -2, 3 - 3 = 0 (a tie counts as wrong)
    rc, rr = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.0, 2.0, 3.0])
    loss, acc = bradley_terry_loss(rc, rr)
    # log(1 + e^-1) = 0.313262, log(1 + e^2) = 2.126928, log 2 = 0.693147 -> mean 1.044446
    assert loss.item() == pytest.approx((0.3132617 + 2.1269280 + 0.6931472) / 3, abs=1e-6)
    assert loss.item() == pytest.approx(1.0444456, abs=1e-6)
    assert acc.item() == pytest.approx(1 / 3)
    loss_m, acc_m = bradley_terry_loss(rc, rr, margin=0.5)
    assert loss_m.item() == pytest.approx((_nls(0.5) + _nls(-2.5) + _nls(-0.5)) / 3, abs=1e-6)
    assert acc_m.item() == pytest.approx(1 / 3)  # the margin does not change the accuracy


def test_bradley_terry_gradient_and_shapes():
    rc = torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(rc, torch.tensor([0.0]))
    loss.backward()
    assert rc.grad.item() == pytest.approx(-0.5)  # d/dx -log sigmoid(x) at 0 = -(1 - 0.5)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


# Two pairs: Delta_1 = (-2 - -3) - (-5 - -4) = 1 - (-1) = 2; Delta_2 = (-1 - -1) - (-2 - -3) = 0 - 1 = -1.
LOGP_C, LOGP_R = torch.tensor([-2.0, -1.0]), torch.tensor([-5.0, -2.0])
REF_C, REF_R = torch.tensor([-3.0, -1.0]), torch.tensor([-4.0, -3.0])


def test_dpo_sigmoid_hand_computed():
    out = dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.5, loss_type="sigmoid")
    # beta Delta = 1, -0.5: (log(1 + e^-1) + log(1 + e^0.5)) / 2 = (0.313262 + 0.974077) / 2
    assert out["loss"].item() == pytest.approx((0.3132617 + 0.9740770) / 2, abs=1e-6)
    assert out["chosen_reward_B"].tolist() == pytest.approx([0.5, 0.0])  # 0.5 * (-2 + 3), 0.5 * (-1 + 1)
    assert out["rejected_reward_B"].tolist() == pytest.approx([-0.5, 0.5])  # 0.5 * (-5 + 4), 0.5 * (-2 + 3)
    assert out["margin"].item() == pytest.approx(0.25)  # mean(1.0, -0.5)
    assert out["accuracy"].item() == pytest.approx(0.5)


def test_ipo_hand_computed():
    out = dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.5, loss_type="ipo")
    # 1 / (2 beta) = 1: ((2 - 1)^2 + (-1 - 1)^2) / 2 = (1 + 4) / 2
    assert out["loss"].item() == pytest.approx(2.5)
    assert out["margin"].item() == pytest.approx(0.25)


def test_cdpo_hand_computed_and_limits():
    out = dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.5, loss_type="cdpo", label_smoothing=0.1)
    # pair 1 (x = 1): 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262; pair 2 (x = -0.5): 0.9 * 0.974077 + 0.1 * 0.474077
    expected = (0.9 * 0.3132617 + 0.1 * 1.3132617 + 0.9 * 0.9740770 + 0.1 * 0.4740770) / 2
    assert out["loss"].item() == pytest.approx(expected, abs=1e-6)
    plain = dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.5, loss_type="cdpo", label_smoothing=0.0)["loss"]
    sigmoid = dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.5)["loss"]
    assert plain.item() == pytest.approx(sigmoid.item())


def test_dpo_at_the_reference_and_gradient():
    logp_c = torch.tensor([-2.0], requires_grad=True)
    out = dpo_loss(logp_c, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-3.0]), beta=0.1)
    assert out["loss"].item() == pytest.approx(math.log(2))
    assert out["margin"].item() == 0.0 and out["accuracy"].item() == 0.0
    out["loss"].backward()
    assert logp_c.grad.item() == pytest.approx(-0.05)  # -beta * (1 - sigmoid(0))


def test_dpo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, loss_type="kto")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(LOGP_C, LOGP_R, REF_C, REF_R, beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(LOGP_C, LOGP_R[:1], REF_C, REF_R)


def test_registries():
    assert LOSSES["bradley_terry"] is bradley_terry_loss and LOSSES["dpo"] is dpo_loss
    assert sorted(DPO_LOSSES) == ["cdpo", "ipo", "sigmoid"]

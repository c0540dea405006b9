"""PRIME (docs/algorithms.md): the advantage's arithmetic, the accuracy band, and the implicit PRM's update and
credit, on the real PRM worker (an `RLWorker` rank, run in this process) and a tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain_core.algorithms.advantages import ADVANTAGES, AdvantageInputs, rloo_advantages, token_level_rewards
from posttrain_core.algorithms.prime import (
    band_filter,
    prime_advantages,
    process_rloo,
    ranking_accuracy,
    reinforce_pp_advantages,
)


def test_a_prm_equal_to_its_reference_gives_zero_process_rewards_and_the_outcome_rloo(prm_worker, synthetic):
    """The PRM before its first update is the reference: every process reward is exactly 0, and the advantage is
    RLOO(outcome) x reward_gt_coef on every token, whitened."""
    worker = prm_worker(lr=1e-3)
    rewards = worker.score(synthetic, list(range(len(synthetic))), 0.05)
    assert all(x == 0.0 for row in rewards for x in row)

    mask = torch.ones(len(synthetic), len(synthetic.response_ids[0]))
    outcome, groups = torch.tensor(synthetic.rewards), torch.tensor(synthetic.groups)
    process = torch.tensor(rewards)
    adv, _ = prime_advantages(outcome, process, mask, groups, gt_coef=5.0, dpo_coef=5.0)
    rloo = 5.0 * rloo_advantages(outcome, groups)
    flat = rloo[:, None].expand_as(mask)
    want = (flat - flat.mean()) / (flat.std() + 1e-8)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)


def test_the_process_rloo_of_two_groups_by_hand():
    """Two groups of two rows; per-token rewards r, masks m (row 1 has a tool token, row 3 is shorter)."""
    r = torch.tensor([[1.0, 2.0, 3.0], [0.5, 9.0, 0.5], [4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 0, 0], [1, 1, 1]])
    g = torch.tensor([7, 7, 3, 3])
    # mean reward per policy token: row 0: 2, row 1: 0.5 (the tool token's 9 is not the policy's), row 2: 4, row 3: 1.
    # each token minus the other row's mean: rows 0/1 against 0.5/2, rows 2/3 against 1/4; 0 where m = 0.
    want = torch.tensor([[0.5, 1.5, 2.5], [-1.5, 0.0, -1.5], [3.0, 0.0, 0.0], [-3.0, -3.0, -3.0]])
    torch.testing.assert_close(process_rloo(r, m, g), want)
    # ... and what the advantage makes of it: 5 x that (no outcome differences, no norm), summed backwards, whitened.
    adv, returns = prime_advantages(torch.zeros(4), r, m, g, gt_coef=5.0, dpo_coef=5.0, norm="none")
    want_returns = 5 * torch.tensor([[4.5, 4.0, 2.5], [-3.0, -1.5, -1.5], [3.0, 0.0, 0.0], [-9.0, -6.0, -3.0]])
    torch.testing.assert_close(returns, want_returns * m)
    torch.testing.assert_close(adv, reinforce_pp_advantages(5 * want, m > 0, 1.0)[0])


def test_the_registered_prime_advantage_reads_its_settings():
    m = torch.ones(4, 2)
    inputs = AdvantageInputs(
        token_level_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), m), m, torch.tensor([0, 0, 1, 1]),
        process_B_T=torch.zeros(4, 2), prime_gt_coef=2.0, prime_dpo_coef=0.0,
    )  # fmt: skip
    adv, returns = ADVANTAGES["prime"](inputs)
    assert returns is None and adv[0, 0] > 0 > adv[1, 0] and abs(float(adv[2, 0])) < 1e-6  # group 1: all equal


def test_ranking_accuracy_counts_pairs_within_a_prompt_and_ties_as_half():
    scores = torch.tensor([3.0, 1.0, 1.0, 0.0, 5.0, 5.0])
    correct = torch.tensor([True, False, False, True, True, False])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: correct {0: 3, 3: 0} vs wrong {1: 1, 2: 1}: 3 > 1 twice, 0 < 1 twice; group 1: a tie (0.5).
    assert ranking_accuracy(scores, correct, groups) == pytest.approx(2.5 / 5)
    assert ranking_accuracy(scores, torch.ones(6, dtype=torch.bool), groups) is None


def test_the_band_keeps_len_over_oversample_prompts_passing_ones_first():
    accuracy = {f"p{i}": a for i, a in enumerate([0.0, 0.5, 1.0, 0.25, 0.75, 1.0, 0.0, 0.5])}
    keep, passing = band_filter(accuracy, (0.2, 0.8), 2)
    assert keep == ["p1", "p3", "p4", "p7"] and passing == 4
    keep, passing = band_filter(accuracy, (0.2, 0.8), 4)
    assert keep == ["p1", "p3"]
    # too few pass: the failing prompts fill the batch, in order
    keep, passing = band_filter({"a": 0.0, "b": 0.5, "c": 1.0, "d": 0.0}, (0.2, 0.8), 2)
    assert keep == ["b", "a"] and passing == 1
    assert band_filter({"a": 0.0}, (0.2, 0.8), 4)[0] == ["a"]  # at least one prompt


def test_one_ce_step_raises_the_score_of_correct_rows_and_lowers_wrong_ones(prm_worker, synthetic):
    worker = prm_worker(lr=1e-4)
    rows = list(range(len(synthetic)))
    result = worker.update(synthetic, 0.05)
    assert result["before"] == [0.0] * len(rows) and result["loss"] == pytest.approx(torch.log(torch.tensor(2.0)))
    after = torch.tensor(result["after"])
    correct = torch.tensor(synthetic.correct)
    assert (after[correct] > 0).all() and (after[~correct] < 0).all(), after
    assert torch.sigmoid(after[correct]).min() > 0.5 > torch.sigmoid(after[~correct]).max()


def test_the_process_rewards_concentrate_on_the_token_that_decides(prm_worker, synthetic):
    """Every response is 7 random 'work' tokens and a last token that alone decides the outcome. After 5 PRM
    updates the credit |r_t| at the last position is over twice that of any other position (2.5-4x in
    bench/prime_credit.py's runs), and its sign is the outcome's."""
    worker = prm_worker(lr=1e-3)
    for _ in range(5):
        worker.update(synthetic, 0.05)
    r = torch.tensor(worker.score(synthetic, list(range(len(synthetic))), 0.05)).abs().mean(0)
    assert r[-1] > 2 * r[:-1].max(), r
    final = torch.tensor([row[-1] for row in worker.score(synthetic, list(range(len(synthetic))), 0.05)])
    assert (final[torch.tensor(synthetic.correct)] > 0).all() and (final[~torch.tensor(synthetic.correct)] < 0).all()


# ----------------------------------------------------------------------------------------------------- fixtures
RIGHT, WRONG = 41, 42  # the deciding token of a correct and of a wrong response


@pytest.fixture(scope="module")
def synthetic():
    """8 prompts x 4 responses: 7 random work tokens, then RIGHT (2 per prompt) or WRONG (2 per prompt)."""
    from posttrain_core.train.rl_batch import RLBatch

    rng = random.Random(0)
    prompts, responses, groups, correct = [], [], [], []
    for g in range(8):
        prompt = [rng.randrange(10, 40) for _ in range(4)]
        for s in range(4):
            prompts.append(prompt)
            responses.append([rng.randrange(10, 40) for _ in range(7)] + [RIGHT if s % 2 == 0 else WRONG])
            groups.append(g)
            correct.append(s % 2 == 0)
    return RLBatch(
        prompt_ids=prompts, response_ids=responses, response_mask=[[1] * 8 for _ in responses],
        logprobs=[[0.0] * 8 for _ in responses], rewards=[float(c) for c in correct], groups=groups, correct=correct,
    )  # fmt: skip


@pytest.fixture
def prm_worker(tiny_inputs, tmp_path):
    """A PRM rank (world size 1) holding the tiny model as PRM, and as its reference."""
    from posttrain_core.config import PrimeConfig, RLConfig
    from posttrain_core.train.prm import PRMSettings, PRMWorker
    from posttrain_core.train.rl_batch import RLJob

    _, _, base = tiny_inputs

    def make(lr: float) -> PRMWorker:
        rl = RLConfig(algorithm="prime", prime=PrimeConfig(lr=lr), num_workers=1, micro_batch_size=8)
        job = RLJob(cfg=PRMSettings.of(rl).rl_config(rl), policy_path=base.path, reference_path=base.path,
                    critic_path=None, state_path=None, outdir=str(tmp_path / "out"), stage="prm_update")  # fmt: skip
        worker = PRMWorker(0, 1)
        worker.load(job)
        return worker

    return make

"""Distillation maths on hand-enumerated vocabularies: the divergences' directions and limits, top-k with its tail
bucket, the single-sample estimators' expected gradients, the on-policy advantage, and convergence of both forms."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain_core.algorithms.distill import (
    DIVERGENCES,
    DistillInputs,
    kl,
    opd_advantages,
    with_tail,
)

S = torch.tensor([0.1, 0.2, 0.3, 0.4])
T = torch.tensor([0.5, 0.25, 0.15, 0.1])


def _full(s: torch.Tensor, t: torch.Tensor, beta: float = 0.5) -> DistillInputs:
    """Inputs whose top-k is the whole vocabulary (k = V)."""
    return DistillInputs(s.log()[None], t.log()[None], s.log()[None, None], t.log()[None, None], beta)


def _hand_kl(a, b) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a.tolist(), b.tolist(), strict=True))


def test_jsd_endpoints_are_the_two_kls_and_its_middle_is_symmetric():
    jsd = DIVERGENCES["jsd"]
    assert jsd(_full(S, T, 0.0)).item() == pytest.approx(_hand_kl(T, S), abs=1e-6)  # forward: KL(T || S)
    assert jsd(_full(S, T, 1.0)).item() == pytest.approx(_hand_kl(S, T), abs=1e-6)  # reverse: KL(S || T)
    assert jsd(_full(S, T, 0.5)).item() == pytest.approx(jsd(_full(T, S, 0.5)).item(), abs=1e-7)
    # Near the ends JSD_beta ~ beta KL(T || S) and ~ (1 - beta) KL(S || T): catches a swapped direction.
    assert jsd(_full(S, T, 1e-4)).item() / 1e-4 == pytest.approx(_hand_kl(T, S), rel=1e-3)
    assert jsd(_full(S, T, 1 - 1e-4)).item() / 1e-4 == pytest.approx(_hand_kl(S, T), rel=1e-3)
    assert _hand_kl(T, S) != pytest.approx(_hand_kl(S, T), abs=1e-3)  # the two directions differ here
    assert DIVERGENCES["forward_kl"](_full(S, T)).item() == pytest.approx(_hand_kl(T, S), abs=1e-6)
    assert DIVERGENCES["reverse_kl"](_full(S, T)).item() == pytest.approx(_hand_kl(S, T), abs=1e-6)


def test_top_k_with_its_tail_is_the_full_divergence_at_k_v_and_never_negative():
    g = torch.Generator().manual_seed(0)
    s_logits, t_logits = torch.randn(64, 6, 50, generator=g), torch.randn(64, 6, 50, generator=g) * 2
    s, t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    full = DistillInputs(s[..., 0], t[..., 0], s, t)  # k = V: every token is a bucket, the tails are empty
    torch.testing.assert_close(DIVERGENCES["forward_kl"](full), kl(t, s), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(DIVERGENCES["reverse_kl"](full), kl(s, t), atol=1e-5, rtol=1e-5)
    for k in (1, 4, 16):
        ids = t.topk(k, dim=-1).indices  # the teacher's top-k; the student's log-probs gathered there
        topk = DistillInputs(s[..., 0], t[..., 0], s.gather(-1, ids), t.gather(-1, ids), beta=0.3)
        for name in ("forward_kl", "reverse_kl", "jsd"):
            assert DIVERGENCES[name](topk).min().item() >= -1e-6, (name, k)
    # Why the tail bucket: where the student has more mass than the teacher on the top-k, the truncated sum is
    # negative (teacher 0.4 on its top token, student 0.9 there).
    s1, t1 = torch.tensor([[math.log(0.9)]]), torch.tensor([[math.log(0.4)]])
    assert (t1.exp() * (t1 - s1)).item() < 0 and DIVERGENCES["forward_kl"](
        DistillInputs(s1, t1, s1[..., None], t1[..., None])
    ).item() > 0
    assert with_tail(torch.tensor([math.log(0.5), math.log(0.25)])).exp().tolist() == pytest.approx([0.5, 0.25, 0.25])


@pytest.mark.parametrize(("name", "target"), [("k1", None), ("k2", "reverse"), ("k3", "forward")])
def test_the_estimators_expected_gradients_enumerated_on_a_vocabulary_of_8(name, target):
    """E_{y ~ S}[grad k(y)], summed exactly over the 8 tokens: 0 for k1, grad KL(S || T) for k2, grad KL(T || S)
    for k3 (gradients with respect to the student's logits)."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(8, generator=g, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(8, generator=g, dtype=torch.float64).log_softmax(-1)
    logp = theta.log_softmax(-1)
    per_token = DIVERGENCES[name](DistillInputs(logp, teacher))
    (expected,) = torch.autograd.grad((logp.exp().detach() * per_token).sum(), theta)
    if target is None:
        torch.testing.assert_close(expected, torch.zeros(8, dtype=torch.float64), atol=1e-12, rtol=0)
        return
    logp = theta.log_softmax(-1)
    divergence = kl(logp, teacher) if target == "reverse" else kl(teacher, logp)
    (want,) = torch.autograd.grad(divergence, theta)
    torch.testing.assert_close(expected, want, atol=1e-10, rtol=1e-8)
    assert want.abs().max() > 1e-3  # not trivially 0


def test_opd_advantages_sum_discounted_rewards_on_policy_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    teacher = torch.tensor([[-0.5, -2.5, -9.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # position 2: a tool turn's token
    r = [2 * 0.5, -2 * 0.5, 0.0, 0.0]  # -coef (logp - teacher), coef 2, masked out at 2
    assert opd_advantages(logp, teacher, mask, coef=2.0).tolist() == [pytest.approx(r)]
    discounted = opd_advantages(logp, teacher, mask, coef=2.0, discount=0.5)
    assert discounted.tolist() == [pytest.approx([r[0] + 0.5 * r[1], r[1], 0.0, 0.0])]
    task = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    assert opd_advantages(logp, teacher, mask, 2.0, 0.0, task, 0.5).tolist() == [pytest.approx([1.5, -0.5, 0.0, 0.5])]
    same = opd_advantages(logp, logp.clone(), mask)
    assert same.abs().max().item() == 0.0  # a teacher equal to the student: no signal at all


@pytest.mark.parametrize("form", ["on_policy", "jsd"])
def test_both_forms_converge_on_a_free_logits_table(form):
    """A student that is a free table of 8 logits reaches KL(S || T) < 1e-3: by the policy gradient with the
    on-policy advantage (its expectation over the 8 tokens, no sampling noise), or by the JSD backpropagated."""
    g = torch.Generator().manual_seed(2)
    teacher = (2 * torch.randn(8, generator=g)).log_softmax(-1)
    theta = torch.zeros(8, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.05)
    for _ in range(600):
        logp = theta.log_softmax(-1)
        if form == "on_policy":
            adv = opd_advantages(logp.detach()[None], teacher[None], torch.ones(1, 8))[0]
            loss = -(logp.exp().detach() * adv * logp).sum()  # E_{y ~ S}[-A(y) log S(y)]
        else:
            loss = DIVERGENCES["jsd"](DistillInputs(logp, teacher, logp[None], teacher[None], beta=0.5)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert kl(theta.log_softmax(-1), teacher).item() < 1e-3


# ------------------------------------------------------------------------------ alignment on a real model
@pytest.fixture(scope="module")
def peaked(tiny_inputs, tmp_path_factory):
    """(model folder, a batch of its own rollouts): the tiny model with its output layer scaled up, so that its
    next-token distributions are peaked and a one-token shift of its log-probs changes them a lot."""
    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer
    from posttrain_core.rollout.engine import SamplingSettings
    from posttrain_core.rollout.hf_engine import HFEngine

    store, data, base = tiny_inputs
    model = load_causal_lm(store.local_path(base))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    folder = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(folder)
    load_tokenizer(store.local_path(base)).save_pretrained(folder)
    engine = HFEngine(str(folder))
    prompts = read_dataset(store.local_path(data.prompts), "prompts").slice(0, 4)
    return engine, engine.generate(prompts, SamplingSettings(n=2, max_tokens=8, seed=3))


def _pad(rows, value=0.0):
    from posttrain_core.train.rl_batch import pad

    return pad(rows, max(len(r) for r in rows), value)


def _gaps(engine, rollouts, shift: int) -> tuple[float, float]:
    """(largest |advantage|, largest per-token JSD) when `engine` scores its own rollouts as the teacher, its
    columns shifted by `shift` tokens (0: aligned)."""
    from posttrain_core.train.rl_batch import encode, pad_topk, response_logprobs

    cols = engine.score(rollouts.select(["prompt_ids", "response_ids"]), topk=8).to_pydict()
    roll = (lambda row: row[shift:] + row[:shift]) if shift else (lambda row: row)  # noqa: E731
    teacher = [roll(r) for r in cols["teacher_logprobs"]]
    ids = [roll(r) for r in cols["teacher_topk_ids"]]
    top = [roll(r) for r in cols["teacher_topk_logprobs"]]
    responses = rollouts.column("response_ids").to_pylist()
    mask = _pad([[1.0] * len(r) for r in responses])
    adv = opd_advantages(_pad(rollouts.column("logprobs").to_pylist()), _pad(teacher), mask)
    rows = type("Rows", (), {})()
    rows.prompt_ids, rows.response_ids = rollouts.column("prompt_ids").to_pylist(), responses
    rows.response_mask = [[1] * len(r) for r in responses]
    width = mask.shape[1]
    input_ids, attn, pos, labels, _ = encode(rows, list(range(len(responses))), engine.pad_id)
    with torch.no_grad():
        student = response_logprobs(engine.model, input_ids, attn, pos, labels, gather=pad_topk(ids, width, torch.long))
    jsd = DIVERGENCES["jsd"](DistillInputs(student.logp, _pad(teacher), student.gathered, pad_topk(top, width)))
    return float((adv * mask).abs().max()), float((jsd * mask).abs().max())


def test_a_teacher_that_is_a_copy_of_the_student_gives_zero_advantage_and_loss(peaked):
    engine, rollouts = peaked
    adv, loss = _gaps(engine, rollouts, shift=0)
    # 0 up to float rounding: the engine's log-probs come from its KV-cached decode, the teacher's from one forward
    assert adv < 1e-4 and loss < 1e-5, (adv, loss)


def test_the_same_teacher_shifted_by_one_token_is_caught(peaked):
    """The classic off-by-one of teacher log-probs (vLLM's prompt_logprobs[i] scores token i, not i + 1): the
    alignment test above must fail on it."""
    engine, rollouts = peaked
    adv, loss = _gaps(engine, rollouts, shift=1)
    assert adv > 0.5 and loss > 0.05, (adv, loss)


def test_tool_tokens_get_no_teacher_signal():
    """Multi-turn rows: the teacher stage zeroes its log-probs on tool tokens (mask 0); the advantage and the
    masked divergence there are 0 whatever the two models say."""
    import pyarrow as pa

    from posttrain_core.algorithms.losses import aggregate
    from posttrain_core.rollout.teacher import _masked

    table = pa.table({
        "response_mask": pa.array([[1, 0, 0, 1], None], pa.list_(pa.int8())),
        "teacher_logprobs": pa.array([[-1.0, -2.0, -3.0, -4.0], [-1.0]], pa.list_(pa.float32())),
    })  # fmt: skip
    assert _masked(table).column("teacher_logprobs").to_pylist() == [[-1.0, 0.0, 0.0, -4.0], [-1.0]]
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    sampled, teacher = torch.tensor([[-0.5, -9.0, -9.0, -1.0]]), torch.tensor([[-1.0, 0.0, 0.0, -4.0]])
    adv = opd_advantages(sampled, teacher, mask, discount=0.9)
    assert adv[0, 1] == 0 and adv[0, 2] == 0 and adv[0, 0] != 0
    s = torch.randn(1, 4, 3).log_softmax(-1).requires_grad_()
    t = torch.randn(1, 4, 3).log_softmax(-1)
    per_token = DIVERGENCES["jsd"](DistillInputs(sampled, teacher, s, t))
    aggregate(per_token, mask, "token-mean").backward()
    assert s.grad[0, 1].abs().sum() == 0 and s.grad[0, 2].abs().sum() == 0 and s.grad[0, 0].abs().sum() > 0


@pytest.mark.parametrize(
    "algorithm, distill, message",
    [
        ("opd", None, "learns from a teacher: set rl.distill.teacher"),
        ("gkd", {"divergence": "k1"}, "'k1' as a supervised loss: its expected gradient is 0"),
        ("grpo", {"divergence": "k1", "loss_coef": 0.5}, "'k1' as a supervised loss"),
        ("gkd", {"topk": 0}, "compares distributions on the teacher's top-k tokens: set rl.distill.topk > 0"),
        ("opd", {"lmbda": 0.99}, "scores the student's own samples"),
        ("opd", {"seq_kd": True}, "scores the student's own samples"),
    ],
)
def test_a_distillation_config_that_cannot_work_is_refused_naming_the_field(algorithm, distill, message):
    from pydantic import ValidationError

    from posttrain_core.config import DistillConfig, RLConfig

    with pytest.raises(ValidationError, match=message):
        RLConfig(algorithm=algorithm, distill=DistillConfig(teacher="t", **distill) if distill is not None else None)


def test_the_teacher_stage_key_ignores_the_loss_settings():
    from posttrain_core.config import DistillConfig

    a = DistillConfig(teacher="a", beta=0.1, coef=2.0, divergence="k3", lmbda=0.5)
    assert a.scoring() == DistillConfig(teacher="b").scoring()  # a rerun with another loss reuses the scores
    assert DistillConfig(topk=4).scoring() != DistillConfig(topk=8).scoring()
    assert DistillConfig(engine="vllm").scoring() != DistillConfig().scoring()

"""examples/minimal_grpo.py: its update pinned on fixed responses, and a seeded run that learns.

The pinned numbers are of `update` (advantages, old and reference log-probs, two clipped optimizer steps) on fixed,
hand-written responses to two problems, with the tiny model as initialised: nothing is sampled, so no float rounding
can flip a token, and every pinned number is a continuous function of the weights. Another CPU or thread count
rounds differently by ~1e-7 relative; the tolerance is 1e-3. The end-to-end run, which samples, is checked for
behaviour only (finite, learning wired, the sampler's log-probs are the trainer's).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_grpo.py"

# Two calls of update(..., updates=2) on `fixed_batch`, policy seed 0, lr 5e-4 (the second sees a moved policy).
PINNED = [
    {"loss": 0.03452265448868275, "pg_loss": 0.03374256566166878, "kl": 0.019502222537994385,
     "entropy": 6.0908472537994385, "grad_norm": 2.0660600662231445},
    {"loss": 0.042548201978206635, "pg_loss": 0.03574032709002495, "kl": 0.17019686102867126,
     "entropy": 6.087885141372681, "grad_norm": 1.4830937385559082},
]  # fmt: skip


def _load_example():
    spec = importlib.util.spec_from_file_location("minimal_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load_example()


@pytest.fixture(scope="module")
def history(example):
    return example.run(steps=3, seed=0, prompts=8, samples=4, sft_steps=100, threads=1)


def fixed_batch(example, tokenizer, problems):
    """Four written responses to each of two problems (right, wrong, wrong, wrong), laid out as `sample` returns
    them: (seq_B_L, attn_B_L, P), prompts left-padded to P columns, each response ending with end-of-sequence."""
    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.heads import left_padded

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenize_prompt(tokenizer, example.user(p.question)) for p in problems]
    ids, attn = left_padded([p for p in prompts for _ in range(4)], pad)
    texts = [t for p in problems for t in (p.answer, str(int(p.answer) + 1), p.answer * 2, "7")]
    responses = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
    width = max(map(len, responses))
    r_ids = torch.full((len(responses), width), pad)
    r_attn = torch.zeros((len(responses), width), dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)], r_attn[i, : len(r)] = torch.tensor(r), 1
    return torch.cat([ids, r_ids], 1), torch.cat([attn, r_attn], 1), ids.shape[1]


def test_the_update_is_pinned_on_fixed_responses(example):
    from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems
    from posttrain_core.models.tiny import TINY_PRESETS, build_tiny_model
    from posttrain_core.models.tokenizer import train_tokenizer

    torch.set_num_threads(1)
    problems = make_problems(["arithmetic"], n=example.N_PROBLEMS, seed=0, max_digits=1, worked=False)
    tokenizer = train_tokenizer(corpus_for_tokenizer(problems))
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    policy = build_tiny_model(vocab_size=len(tokenizer), **special, **TINY_PRESETS["small"], seed=0)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.0)
    seq, attn, P = fixed_batch(example, tokenizer, problems[:2])
    rewards = example.score(tokenizer, seq, attn, P, [p.answer for p in problems[:2] for _ in range(4)])
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] * 2  # the verifier on the written answers: exact
    group = torch.arange(2).repeat_interleave(4)
    for pinned in PINNED:
        m = example.update(policy, reference, opt, seq, attn, P, rewards, group, updates=2)
        assert 0.0 <= m["clip_frac"] <= 1.0
        assert {k: m[k] for k in pinned} == pytest.approx(pinned, rel=1e-3, abs=1e-7)


def test_learning_is_wired(history):
    for m in history:
        assert all(math.isfinite(v) for v in m.values())
        # the loss reaches the policy's weights
        assert m["grad_norm"] > 0
        # the policy starts as a copy of the reference; a positive KL means the optimizer steps moved it
        assert m["kl"] > 0
        # the sampler's log-probs are the trainer's: the ratio is 1 at the first optimizer step of each batch
        assert m["logp_gap"] < 1e-5
        assert 0.0 <= m["clip_frac"] <= 1.0 and 0.0 <= m["acc"] <= 1.0
        assert 1.0 <= m["length"] <= 6.0
    assert history[-1]["kl"] > history[0]["kl"]  # the policy keeps moving away from the reference


def test_main_prints_one_line_per_step(example, monkeypatch, capsys):
    argv = ["minimal_grpo.py", "--steps", "2", "--prompts", "2", "--samples", "2", "--sft-steps", "5"]
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1"])
    example.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split() for line in lines[:2]] == [["step", "1"], ["step", "2"]]
    for key in ("reward", "acc", "loss", "kl", "clip", "entropy"):
        assert key in lines[0]
    assert lines[-1].startswith("done in")

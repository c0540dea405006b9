"""GRPO in one process: sample a group of answers per prompt, score them, make the better-than-average ones likelier.

What GRPO really is. For each prompt q, draw G responses o_1..o_G from the current policy and score each with a
verifier (reward r_i in {0, 1} here). Every token of response i gets the same advantage, its reward standardised
within its group: A_i = (r_i - mean(r)) / (std(r) + eps). There is no critic: the group is the baseline. The policy
then takes PPO's clipped step on the token ratio rho_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t), plus a k3 KL
penalty to a frozen reference model, both averaged over all response tokens of the batch ("token-mean"):

    loss = mean_t max(-A rho_t, -A clip(rho_t, 1 - 0.2, 1 + 0.2)) + 0.04 mean_t (e^x - x - 1),  x = ref_t - logp_t

A group whose answers are all right (or all wrong) has A = 0 and teaches nothing: prompts must be hard enough that
some samples fail and easy enough that some succeed.

The task: 32 single-digit arithmetic questions ("What is 7 + 8?" -> "15", exact match) from
`posttrain_core.data.synthetic`, answered by the tiny random-init Llama ("small" preset, 0.8M parameters) with a BPE
tokenizer trained on the task's texts. A random model never answers a number then <|im_end|>, so a supervised warm-up
(`--sft-steps` AdamW steps on the SFT chats, labels from `tokenize_chat`) first teaches the format and about half of
the facts; GRPO then raises the accuracy. `acc` is greedy accuracy on the same 32 questions (a memorised table: there
is nothing to generalise to). The reference model is the warmed-up one. Every random draw comes from one seeded
torch.Generator and the thread count is fixed, so the same arguments print the same numbers. One thread by default:
the ops are tiny, and a second thread gains little (25 s instead of 35 s) but can cost 10x when the cores are shared.

Run: .venv/bin/python examples/minimal_grpo.py [--steps 20 --prompts 32 --samples 8 --lr 5e-4 --seed 0]
The pipeline runs the same maths on Ray ranks in posttrain_core/train/rl_worker.py.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from posttrain_core.algorithms.advantages import broadcast_advantages, grpo_advantages, masked_mean
from posttrain_core.algorithms.losses import (
    LossSettings,
    clip_policy_loss,
    entropy_from_logits,
    kl_estimate,
    token_logprobs,
)
from posttrain_core.config import RL_PRESETS
from posttrain_core.data.chat import IGNORE_INDEX, tokenize_chat, tokenize_prompt
from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems
from posttrain_core.models.heads import left_padded
from posttrain_core.models.tiny import TINY_PRESETS, build_tiny_model
from posttrain_core.models.tokenizer import train_tokenizer
from posttrain_core.rewards.verifiers import exact_match

GRPO = RL_PRESETS["grpo"]  # the pipeline's preset: k3 KL in the loss with kl_coef 0.04, clip 0.2, token-mean
N_PROBLEMS, MAX_TOKENS, SFT_LR = 32, 6, 3e-3


def user(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def forward(model, ids_B_L: torch.Tensor, attn_B_L: torch.Tensor, **kw):
    """The model on a left-padded batch; positions count real tokens only (as if each row were alone)."""
    return model(input_ids=ids_B_L, attention_mask=attn_B_L, position_ids=(attn_B_L.cumsum(-1) - 1).clamp(min=0), **kw)


def sft_warmup(model, tokenizer, problems, steps: int, g: torch.Generator, batch: int = 32) -> None:
    """Next-token cross-entropy on the assistant turns only (labels are -100 elsewhere)."""
    turns = [user(p.question) + [{"role": "assistant", "content": p.solution}] for p in problems]
    chats = [tokenize_chat(tokenizer, t) for t in turns]  # (input_ids, labels)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        rows = [chats[i] for i in torch.randint(len(chats), (batch,), generator=g).tolist()]
        ids, attn = left_padded([r[0] for r in rows], tokenizer.pad_token_id)
        labels = left_padded([r[1] for r in rows], IGNORE_INDEX)[0]
        forward(model, ids, attn, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@torch.no_grad()
def sample(model, prompts: list[list[int]], n: int, eos: int, pad: int, g: torch.Generator | None):
    """n responses per prompt, one token at a time (g=None: greedy). Returns (ids_B_L, attn_B_L, P, logp_B_R): the
    response is columns P.. of ids, attn is 1 on it up to and including eos, logp are the sampled tokens' log-probs."""
    ids, attn = left_padded([p for p in prompts for _ in range(n)], pad)
    P, done, logps = ids.shape[1], torch.zeros(ids.shape[0], dtype=torch.bool), []
    for _ in range(MAX_TOKENS):
        logp_B_V = torch.log_softmax(forward(model, ids, attn).logits[:, -1].float(), dim=-1)
        next_B = logp_B_V.argmax(-1) if g is None else torch.multinomial(logp_B_V.exp(), 1, generator=g)[:, 0]
        logps.append(logp_B_V.gather(-1, next_B[:, None]))
        ids = torch.cat([ids, torch.where(done, pad, next_B)[:, None]], dim=1)
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        done |= next_B == eos
        if done.all():
            break
    return ids, attn, P, torch.cat(logps, dim=1) * attn[:, P:]


def response_logp(model, ids, attn, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_B_R of the response tokens under `model`, the logits_B_R_V that predict them): logits[t] -> token t+1."""
    logits_B_R_V = forward(model, ids, attn).logits[:, P - 1 : -1].float()
    labels_B_R = torch.where(attn[:, P:] > 0, ids[:, P:], IGNORE_INDEX)
    return token_logprobs(logits_B_R_V, labels_B_R), logits_B_R_V


def score(tokenizer, ids, attn, P: int, answers: list[str]) -> torch.Tensor:
    """The verifier: reward 1 iff the response's answer equals the reference answer."""
    texts = [tokenizer.decode(r[m > 0], skip_special_tokens=True) for r, m in zip(ids[:, P:], attn[:, P:], strict=True)]
    return torch.tensor([exact_match(None, t, a)["exact_match"] for t, a in zip(texts, answers, strict=True)])


def update(policy, reference, opt, seq, attn, P: int, rewards, group, updates: int) -> dict:
    """Steps 3-5 of a GRPO step on sampled responses (columns P.. of seq): advantages, old and reference log-probs,
    then `updates` optimizer steps. Returns the means over those steps of loss, pg_loss, kl, clip_frac, entropy and
    grad_norm, and `old_logp`, the sampling policy's recomputed log-probs."""
    mask = attn[:, P:].float()
    # 3. Group-standardised advantages, the same on every token of a response.
    adv = broadcast_advantages(grpo_advantages(rewards, group), mask)
    # 4. Log-probs of the sampling policy ("old") and of the reference, recomputed over prompt + response.
    with torch.no_grad():
        old = response_logp(policy, seq, attn, P)[0]
        ref = response_logp(reference, seq, attn, P)[0]
    # 5. One optimizer step per mini-batch of whole groups: in the first, rho = 1 (up to float rounding: old is
    # the current policy); later ones see a policy that has moved, which is where the clip bites.
    settings = LossSettings(loss_agg=GRPO["loss_agg"], clip_low=GRPO["clip_low"], clip_high=GRPO["clip_high"])
    policy.train()
    m = dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm"), 0.0)
    for rows in torch.arange(len(rewards)).chunk(updates):
        logp, logits = response_logp(policy, seq[rows], attn[rows], P)
        pg, info = clip_policy_loss(logp, old[rows], adv[rows], mask[rows], settings)
        kl = settings.aggregate(kl_estimate(logp, ref[rows], GRPO["kl_estimator"]), mask[rows])
        loss = pg + GRPO["kl_coef"] * kl
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = dict(loss=loss, pg_loss=pg, kl=kl, clip_frac=info["clip_frac"], grad_norm=grad_norm)
        stats["entropy"] = masked_mean(entropy_from_logits(logits.detach()), mask[rows])
        for k, v in stats.items():
            m[k] += v.item() / updates
    return {**m, "old_logp": old}


def run(steps: int = 20, seed: int = 0, prompts: int = 32, samples: int = 8, lr: float = 5e-4, sft_steps: int = 200,
        updates: int = 2, threads: int = 1, log=None) -> list[dict]:  # fmt: skip
    """Warm up, then `steps` GRPO steps of `prompts` x `samples` responses and `updates` optimizer steps each.

    Returns one dict per step, `log(metrics)` is called after each: loss, pg_loss, kl (k3 to the reference),
    clip_frac, entropy, grad_norm (means over the step's optimizer steps); reward (mean over the samples), acc
    (greedy, after the update), length (mean response tokens), logp_gap (max |sampler - trainer| log-prob), seconds.
    """
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    problems = make_problems(["arithmetic"], n=N_PROBLEMS, seed=seed, max_digits=1, worked=False)
    tokenizer = train_tokenizer(corpus_for_tokenizer(problems))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    special = dict(eos_token_id=eos, pad_token_id=pad, bos_token_id=tokenizer.bos_token_id)
    policy = build_tiny_model(vocab_size=len(tokenizer), **special, **TINY_PRESETS["small"], seed=seed)
    sft_warmup(policy, tokenizer, problems, sft_steps, g)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    encoded = [tokenize_prompt(tokenizer, user(p.question)) for p in problems]
    history = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        # 1. Sample a group of `samples` responses for each of `prompts` prompts (row b answers prompt b // samples).
        chosen = torch.randperm(len(problems), generator=g)[:prompts].tolist()
        policy.eval()
        seq, attn, P, sampled_logp = sample(policy, [encoded[i] for i in chosen], samples, eos, pad, g)
        mask = attn[:, P:].float()
        # 2. Verifier rewards; 3-5. advantages, old and reference log-probs, optimizer steps (`update`).
        rewards = score(tokenizer, seq, attn, P, [problems[i].answer for i in chosen for _ in range(samples)])
        group = torch.arange(len(chosen)).repeat_interleave(samples)
        m = update(policy, reference, opt, seq, attn, P, rewards, group, updates)
        # 6. Greedy accuracy of the updated policy on all the task's questions.
        policy.eval()
        e_seq, e_attn, e_P, _ = sample(policy, encoded, 1, eos, pad, None)
        acc = score(tokenizer, e_seq, e_attn, e_P, [p.answer for p in problems]).mean().item()
        old = m.pop("old_logp")
        m.update(step=step, reward=rewards.mean().item(), acc=acc, length=mask.sum(-1).mean().item(),
                 logp_gap=(sampled_logp - old).abs().max().item(), seconds=time.perf_counter() - t0)  # fmt: skip
        history.append(m)
        if log is not None:
            log(m)
    return history


def print_step(m: dict) -> None:
    print(f"step {m['step']:3d} | reward {m['reward']:.3f} | acc {m['acc']:.3f} | loss {m['loss']:+.4f} | "
          f"kl {m['kl']:.4f} | clip {m['clip_frac']:.3f} | entropy {m['entropy']:.3f} | len {m['length']:.2f} | "
          f"{m['seconds']:.2f}s", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="GRPO on single-digit arithmetic with a tiny Llama, in one process.")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=32, help=f"prompts per step (at most {N_PROBLEMS})")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt: the group size G")
    parser.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate (AdamW)")
    parser.add_argument("--sft-steps", type=int, default=200, help="supervised warm-up steps before GRPO")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (numbers can differ per count)")
    a = parser.parse_args()
    t0 = time.perf_counter()
    run(a.steps, a.seed, a.prompts, a.samples, a.lr, a.sft_steps, threads=a.threads, log=print_step)
    print(f"done in {time.perf_counter() - t0:.1f}s (warm-up included)")


if __name__ == "__main__":
    main()

"""RL benchmark: does each algorithm raise held-out accuracy over the SFT model, and where does an iteration's time go?

    python -m bench.rl_bench                              # SFT demo model (built or cached), every algorithm
    python -m bench.rl_bench --algorithms grpo,ppo --iterations 10
    python -m bench.rl_bench --model PATH                 # start from an existing checkpoint instead of the SFT demo
    python -m bench.rl_bench --algorithms grpo,prime --seeds 0,1 --prm-lr 1e-4   # PRIME against GRPO, two seeds
    python -m bench.rl_bench --real --algorithms grpo,prime --iterations 4 --prompts 16 --n 8   # on SmolLM2 (LoRA)
    python -m bench.rl_bench --algorithms grpo,grpo+rollout_lag=1+off_policy=tis   # RLConfig fields after '+'

Every algorithm runs the real `rlhf_flow` (ephemeral Prefect, local Ray, 2 update workers, hf rollout engine) from
the same starting policy, on the same prompts (the synthetic training prompts, arithmetic and letter reversal, the
next window of them every iteration), with the same seeds and rollout settings. Printed:

1. learning: held-out accuracy of the start policy and of the final policy, sampled (pass@1 of 8 samples per prompt
   at the rollout temperature: the quantity RL optimises; overall and on arithmetic) and greedy (overall and per
   family), and the training reward of the first and last iterations;
2. the reward curve (sample reward per iteration) of each algorithm;
3. time per iteration, median over the iterations: generation, scoring, training (old log-probs, advantages,
   optimizer steps), stage start-up (Ray actors, process groups, model loading) and orchestration (Prefect task
   runs, cache lookups, artifact I/O), as fractions of the iteration's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ALGORITHMS = ("grpo", "ppo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "vapo", "prime")
FAMILIES = ("arithmetic", "reverse")
PARTS = ("generate_s", "score_s", "train_s", "startup_s", "orchestration_s")


def sft_model(store: str) -> str:
    """The foundation demo's SFT model (`flows.sft` on its defaults), built once in `store` and cached after."""
    from flows.sft import sft_flow
    from posttrain_core.config import SFTFlowConfig

    return sft_flow(SFTFlowConfig(store=store))["model"].uri


def _fields(spec: str) -> tuple[str, dict]:
    """'grpo+rollout_lag=1+off_policy=tis' -> ('grpo', {'rollout_lag': 1, 'off_policy': 'tis'})."""
    name, *pairs = spec.split("+")
    fields = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        fields[key] = json.loads(value) if value[:1].isdigit() or value[:1] in "-[{" else value
    return name, fields


def run_algorithm(args, spec: str, start: str, seed: int = 0) -> dict:
    from flows.rlhf import rlhf_flow
    from posttrain_core.config import RLHFFlowConfig

    algorithm, extra = _fields(spec)
    rl = {
        "algorithm": algorithm, "lr": args.lr, "critic_lr": args.critic_lr, "num_workers": args.workers,
        "mini_batches": args.mini_batches, "ppo_epochs": args.epochs, "seed": seed, **extra,
    }  # fmt: skip
    if algorithm == "prime":  # the same rollout budget as the others: the band reorders, it drops nothing (f = 1)
        rl["prime"] = {"lr": args.prm_lr} if args.prm_lr else {}
    if args.real:  # `make demo-real`'s run (SmolLM2, LoRA, one-digit arithmetic), with this benchmark's budget
        from flows.real import real_config

        base = real_config()
        prime = {"prime": {"lr": args.prm_lr}} if algorithm == "prime" and args.prm_lr else {}
        cfg = base.model_copy(
            update=dict(
                store=args.store, iterations=args.iterations, eval_every=args.eval_every,
                rollout=base.rollout.model_copy(update={"n": args.n, "max_prompts": args.prompts, "seed": seed}),
                rl=RLHFFlowConfig.model_validate({"rl": {**base.rl.model_dump(exclude_unset=True),
                                                         "algorithm": algorithm, "seed": seed, **prime, **extra}}).rl,
            )
        )  # fmt: skip
        t0 = time.time()
        result = rlhf_flow(cfg)
        result["wall_s"] = time.time() - t0
        return result
    families = args.families.split(",") if args.families else []
    cfg = RLHFFlowConfig(
        store=args.store,
        model={"path": start},
        pretrain=None,
        sft=None,
        iterations=args.iterations,
        rollout={
            "n": args.n,
            "max_prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "families": families,
            "seed": seed,
        },
        rl=rl,
        eval_every=args.eval_every,
    )
    t0 = time.time()
    result = rlhf_flow(cfg)
    result["wall_s"] = time.time() - t0
    return result


def report(results: dict[str, dict], args) -> str:
    lines = [
        f"RL benchmark: {args.iterations} iterations x {args.prompts} prompts x n={args.n}, "
        f"max_tokens={args.max_tokens}, families={args.families or 'all'}, {args.epochs} epoch(s) x "
        f"{args.mini_batches} mini-batches, lr={args.lr} (critic {args.critic_lr}), {args.workers} update workers, "
        f"hf engine, torch threads={os.cpu_count()}",
        "",
        "1. learning on the 200 held-out prompts (start = the SFT model): sampled = mean exact match of 8 samples per",
        "   prompt at the rollout temperature (what RL optimises), greedy = exact match of the greedy answer",
        f"{'algorithm':<22} {'sampled':>15} {'change':>7} {'sampled arith':>14} {'greedy':>13} {'change':>7} "
        f"{'greedy arith':>13} {'greedy reverse':>14} {'train reward':>13} {'wall s':>7}",
    ]
    for name, r in results.items():
        ev = r["eval"]  # per evaluated iteration: greedy accuracy (per family) and sampled_pass@k
        first, last = min(ev), max(ev)
        a0, a1 = ev[first]["accuracy"], ev[last]["accuracy"]
        s0, s1 = ev[first]["sampled_pass@1"], ev[last]["sampled_pass@1"]
        fam = {f: (ev[first].get(f"accuracy/{f}", 0.0), ev[last].get(f"accuracy/{f}", 0.0)) for f in FAMILIES}
        ar0, ar1 = (ev[k].get("sampled_pass@1/arithmetic", float("nan")) for k in (first, last))
        lines.append(
            f"{name:<22} {s0:>6.3f} -> {s1:.3f} {s1 - s0:>+7.3f} {ar0:>5.3f} -> {ar1:.3f} "
            f"{a0:>5.3f} -> {a1:.3f} {a1 - a0:>+7.3f} "
            f"{fam['arithmetic'][0]:>5.3f} -> {fam['arithmetic'][1]:.3f} {fam['reverse'][0]:>6.3f} -> "
            f"{fam['reverse'][1]:.3f} {r['curve'][0]['reward_mean']:>5.3f} -> {r['curve'][-1]['reward_mean']:.3f} "
            f"{r['wall_s']:>7.0f}"
        )
    lines += ["", "1b. held-out sampled accuracy (pass@1) per evaluated iteration (--eval-every)"]
    for name, r in results.items():
        lines.append(f"{name:<22} " + " ".join(f"{k}:{e['sampled_pass@1']:.3f}" for k, e in sorted(r["eval"].items())))
    lines += ["", "1c. per iteration: wall s, the update's wait for its rows, the engines' wait for a policy"]
    for name, r in results.items():
        lines.append(f"{name:<22} " + " ".join(
            f"{t['wall_s']:.1f}/{t.get('update_wait_s', 0):.1f}/{t.get('rollout_wait_s', 0):.1f}" for t in r["timings"]
        ))  # fmt: skip
    lines += ["", "2. reward curve (sample reward mean per iteration)"]
    for name, r in results.items():
        lines.append(f"{name:<22} " + " ".join(f"{row['reward_mean']:.3f}" for row in r["curve"]))
    lines += [
        "",
        "3. time per iteration: median wall seconds, and each part's share of the summed iteration time",
        f"{'algorithm':<22} {'wall s':>7} " + " ".join(f"{p[:-2]:>13}" for p in PARTS),
    ]
    for name, r in results.items():
        total = {k: sum(t[k] for t in r["timings"]) for k in ("wall_s", *PARTS)}  # fractions of the summed time
        median = statistics.median(t["wall_s"] for t in r["timings"])
        lines.append(f"{name:<22} {median:>7.1f} " + " ".join(f"{total[p] / total['wall_s']:>13.2f}" for p in PARTS))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=256, help="prompts per iteration")
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="policy learning rate (default: RLConfig's)")
    p.add_argument("--critic-lr", type=float, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=None, help="optimizer steps per epoch (default: RLConfig's)")
    p.add_argument("--epochs", type=int, default=None, help="passes over each iteration's batch (default: RLConfig's)")
    p.add_argument("--families", default="", help="task families to train on, comma-separated ('' = all)")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every k iterations (0: start and end)")
    p.add_argument("--seeds", default="0", help="seeds (rollout and update), comma-separated: a run per algorithm each")
    p.add_argument("--prm-lr", type=float, default=None, help="prime: the PRM's learning rate (default: PrimeConfig's)")
    p.add_argument("--model", default=None, help="start policy (default: the SFT demo model, built in --store)")
    p.add_argument("--real", action="store_true", help="make demo-real's run (SmolLM2, LoRA) instead of the demo's")
    p.add_argument("--store", default=None, help="artifact store (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args()
    from posttrain_core.config import RLConfig

    defaults = RLConfig()
    args.lr = args.lr or defaults.lr
    args.critic_lr = args.critic_lr or defaults.critic_lr
    args.mini_batches = args.mini_batches or defaults.mini_batches
    args.epochs = args.epochs or defaults.ppo_epochs
    args.store = args.store or tempfile.mkdtemp(prefix="posttrain-rl-bench-")
    start = "" if args.real else args.model or sft_model(args.store)
    results = {}
    seeds = [int(x) for x in args.seeds.split(",")]
    for name in args.algorithms.split(","):
        for seed in seeds:
            results[name if len(seeds) == 1 else f"{name} s{seed}"] = run_algorithm(args, name, start, seed)
            print(report(results, args), flush=True)
    if args.json:
        keep = ("curve", "timings", "accuracy", "eval", "wall_s")
        Path(args.json).write_text(json.dumps({k: {f: v[f] for f in keep} for k, v in results.items()}, indent=1))
    print("\n" + report(results, args))


if __name__ == "__main__":
    main()

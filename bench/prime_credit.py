"""Where PRIME's implicit PRM puts the credit, on a task built for it: each response is 7 random "work" tokens and a
last token that alone decides the outcome (RIGHT or WRONG, half the samples each).

The PRM (the tiny model, `train.prm.PRMWorker` in this process, the same code the `prm_update` stage runs on Ray)
takes K CE updates on 32 prompts x 4 samples; then its process rewards r_t = beta (log pi_prm - log pi_ref) are read
on those rows and on 32 fresh prompts. Prints the mean |r_t| per position and the last position's ratio to the
largest other, per seed; plots the held-out credit per position after each K. Usage:
    python -m bench.prime_credit [--seeds 0,1] [--steps 1,3,5,10] [--lr 1e-3] [--out docs/prime_credit.png]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

RIGHT, WRONG, WORK = 41, 42, 7


def rows(n_prompts: int, seed: int):
    from posttrain_core.train.rl_batch import RLBatch

    rng = random.Random(seed)
    prompts, responses, groups, correct = [], [], [], []
    for g in range(n_prompts):
        prompt = [rng.randrange(10, 40) for _ in range(4)]
        for s in range(4):
            prompts.append(prompt)
            responses.append([rng.randrange(10, 40) for _ in range(WORK)] + [RIGHT if s % 2 == 0 else WRONG])
            groups.append(g)
            correct.append(s % 2 == 0)
    n = WORK + 1
    return RLBatch(prompt_ids=prompts, response_ids=responses, response_mask=[[1] * n for _ in responses],
                   logprobs=[[0.0] * n for _ in responses], rewards=[float(c) for c in correct], groups=groups,
                   correct=correct)  # fmt: skip


def credit(worker, batch, beta: float) -> list[float]:
    import torch

    return torch.tensor(worker.score(batch, list(range(len(batch))), beta)).abs().mean(0).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", default="1,3,5,10")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.05)
    parser.add_argument("--out", default="docs/prime_credit.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, ModelConfig, PrimeConfig, RLConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model
    from posttrain_core.train.prm import PRMSettings, PRMWorker
    from posttrain_core.train.rl_batch import RLJob

    work = Path(tempfile.mkdtemp(prefix="prime-credit-"))
    store = ArtifactStore(work / "store")
    base = run_build_model(ModelConfig(size="tiny"), run_prepare_data(DataConfig(), store).text, store)
    steps = [int(s) for s in args.steps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 3.5), squeeze=False)
    print("| seed | K updates | rows | mean abs r_t per position (1..8) | last / max(other) |\n|---|---|---|---|---|")
    for ax, seed in zip(axes[0], seeds, strict=True):
        rl = RLConfig(algorithm="prime", prime=PrimeConfig(lr=args.lr, beta=args.beta), num_workers=1,
                      micro_batch_size=32, seed=seed)  # fmt: skip
        job = RLJob(cfg=PRMSettings.of(rl).rl_config(rl), policy_path=base.path, reference_path=base.path,
                    critic_path=None, state_path=None, outdir=str(work / "out"), stage="prm_update")  # fmt: skip
        worker = PRMWorker(0, 1)
        worker.load(job)
        train, held = rows(32, 2 * seed), rows(32, 2 * seed + 1)
        done = 0
        for k in steps:
            for _ in range(k - done):
                worker.update(train, args.beta)
            done = k
            for name, batch in (("train", train), ("held-out", held)):
                c = credit(worker, batch, args.beta)
                ratio = c[-1] / max(c[:-1])
                print(f"| {seed} | {k} | {name} | {' '.join(f'{x:.4f}' for x in c)} | {ratio:.2f} |")
                if name == "held-out":
                    ax.plot(range(1, len(c) + 1), c, marker="o", label=f"{k} updates")
        ax.set(title=f"seed {seed}: held-out credit per position", xlabel="response position (8 = deciding token)",
               ylabel="mean |r_t|")  # fmt: skip
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=96)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()

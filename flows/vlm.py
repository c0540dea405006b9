"""SFT then GRPO on a tiny vision-language model that must read the picture to answer.

The synthetic shapes task (`posttrain_core.data.shapes`): 56 x 56 pictures of one to three coloured shapes, and
questions whose text is the same whatever the answer ("What colour is the shape?", "How many shapes are there?"),
so a reward can only come through the vision tower. The model is a tiny random-init Qwen2-VL built on the
project's own tokenizer (`model.arch="qwen2_vl"`); the same rlhf flow as text runs it: data -> tiny VLM -> SFT
(vision tower trained too: a random tower has nothing to offer frozen) -> N x [rollout -> score -> GRPO update] ->
held-out evaluation, greedy and sampled.
    make demo-vlm        # or: python -m flows.vlm
The ablation (`vlm_config(blank_images=True)`) runs the same with every picture replaced by a blank one of its size:
held-out accuracy then stays near chance, which is what shows the model reads the pixels.
"""

from __future__ import annotations

from posttrain_core.config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RLConfig,
    RLHFFlowConfig,
    RolloutConfig,
    SFTConfig,
)


def vlm_config(seed: int = 0, blank_images: bool = False, iterations: int = 250) -> RLHFFlowConfig:
    """The embedded defaults of `make demo-vlm` (docs/vlm.md says what each choice is for)."""
    return RLHFFlowConfig(
        experiment="posttrain-vlm",
        # SFT sees 2,000 labelled pictures; RL draws 128 fresh ones per iteration from 40,000 of its own (never the
        # same picture twice in the demo), so what RL adds is read from new pixels through the reward alone.
        data=DataConfig(
            families=["shapes"],
            n_train=2000,
            n_eval=1000,
            n_rl_prompts=40000,
            slip_rate=0.0,
            seed=seed,
            blank_images=blank_images,
        ),
        model=ModelConfig(arch="qwen2_vl", size="tiny", vocab_size=384, seed=seed),
        pretrain=None,
        sft=SFTConfig(
            max_steps=1500,
            global_batch_size=32,
            micro_batch_size=16,
            lr=3e-3,
            warmup_steps=20,
            max_seq_len=96,
            checkpoint_every=100,
            train_vision=True,
            seed=seed,
        ),
        iterations=iterations,
        rollout=RolloutConfig(n=8, max_prompts=128, max_tokens=8, temperature=1.0, batch_size=64, seed=seed),
        rl=RLConfig(
            algorithm="grpo",
            lr=5e-4,
            warmup_steps=10,
            mini_batches=2,
            micro_batch_size=32,
            train_vision=True,
            seed=seed,
        ),
        eval=EvalConfig(max_new_tokens=8),
        eval_samples=4,
    )


if __name__ == "__main__":
    import sys

    from flows.rlhf import main

    main(vlm_config(blank_images="--blank-images" in sys.argv[1:]))

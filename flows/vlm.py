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


def vlm_config(seed: int = 0, blank_images: bool = False, iterations: int = 6) -> RLHFFlowConfig:
    """The embedded defaults of `make demo-vlm` (docs/vlm.md says what each choice is for)."""
    return RLHFFlowConfig(
        experiment="posttrain-vlm",
        data=DataConfig(
            families=["shapes"], n_train=6000, n_eval=200, n_rl_prompts=1024, seed=seed, blank_images=blank_images
        ),
        model=ModelConfig(arch="qwen2_vl", size="tiny", vocab_size=384, seed=seed),
        pretrain=None,
        sft=SFTConfig(
            max_steps=3000, global_batch_size=32, micro_batch_size=16, lr=3e-3, warmup_steps=20, max_seq_len=96,
            checkpoint_every=100, train_vision=True, seed=seed,
        ),  # fmt: skip
        iterations=iterations,
        rollout=RolloutConfig(n=8, max_prompts=32, max_tokens=8, temperature=1.0, batch_size=64, seed=seed),
        rl=RLConfig(algorithm="grpo", lr=5e-4, mini_batches=2, micro_batch_size=32, train_vision=True, seed=seed),
        eval=EvalConfig(max_new_tokens=8),
        eval_samples=4,
    )


if __name__ == "__main__":
    import sys

    from flows.rlhf import main

    main(vlm_config(blank_images="--blank-images" in sys.argv[1:]))

"""On-policy distillation on a real pretrained model: SmolLM2-135M-Instruct learns one-digit arithmetic from a teacher.

The teacher is the policy `make demo-real` trains (SmolLM2-135M-Instruct + its GRPO LoRA adapter): this demo runs
that flow first, which is all cache hits when the store already holds it, and trains it when it does not. The
student is the base model with a fresh adapter; each iteration it samples, the teacher scores every sampled token
(the cached teacher_logprobs stage), and the advantage of each token is -(log pi_student - log pi_teacher): no
verifier is needed to learn (the reward is still computed, to report accuracy).
    make demo-distill        # or: python -m flows.distill
From Python, with your own teacher (any model path; it must share the student's tokenizer):
    rlhf_flow(distill_config("/models/my-teacher"))
"""

from __future__ import annotations

from posttrain_core.config import DistillConfig, RLConfig, RLHFFlowConfig


def distill_config(teacher: str, algorithm: str = "opd", seed: int = 0, iterations: int = 6) -> RLHFFlowConfig:
    """`make demo-real`'s settings (same prompts, sampling budget and adapter) with the student learning from
    `teacher` (algorithm "opd"), or from the verifier as demo-real does (algorithm "grpo", the comparison)."""
    from flows.real import real_config

    base = real_config()
    rl = base.rl.model_dump(exclude={"algorithm", "distill", "seed"}, exclude_none=True)
    distill = DistillConfig(teacher=teacher) if algorithm in ("opd", "gkd") else None
    return base.model_copy(
        update=dict(
            experiment="posttrain-distill",
            iterations=iterations,
            rollout=base.rollout.model_copy(update={"seed": seed}),
            rl=RLConfig(**rl, algorithm=algorithm, seed=seed, distill=distill),
        )
    )


def teacher_policy():
    """The policy `make demo-real` trains (a cache hit when the store has it): the demo's teacher."""
    from flows.real import real_config
    from flows.rlhf import rlhf_flow

    return rlhf_flow(real_config())["policy"]


if __name__ == "__main__":
    from flows.rlhf import main

    main(distill_config(teacher_policy().key))

"""Multi-turn RL with tools on the synthetic tool task: the tiny model learns when and how to call a tool.

The same rlhf flow as `python -m flows.rlhf`, on the `lookup` and `calc` families (posttrain_core.data.tool_tasks):
codes only the `lookup` tool knows, 3-digit products only the `calc` tool computes, next to products by 0 that need
no tool. SFT warm-starts on demonstrations that use the tools imperfectly (calls skipped, arguments
mangled, needless calls); GRPO then rewards a right answer and charges each call (`ScoreConfig.tool_call_cost`), so
the policy must learn to call where it helps and only there.
    make demo-tools        # or: python -m flows.tools
"""

from __future__ import annotations

from posttrain_core.config import (
    DataConfig,
    EvalConfig,
    RLConfig,
    RLHFFlowConfig,
    RolloutConfig,
    ScoreConfig,
    SFTConfig,
    ToolConfig,
)
from posttrain_core.data.tool_tasks import TOOLS


def tools_config() -> RLHFFlowConfig:
    """The embedded defaults of `make demo-tools` (docs/tools.md has what each choice is for)."""
    tools = ToolConfig(tools=list(TOOLS), parser="compact", max_turns=3, max_tool_response_tokens=16,
                       max_total_tokens=96)  # fmt: skip
    return RLHFFlowConfig(
        experiment="posttrain-tools",
        data=DataConfig(families=["lookup", "calc"], n_train=3000, n_eval=200, n_rl_prompts=2000, slip_rate=0.3),
        sft=SFTConfig(max_steps=1500),
        iterations=20,
        rollout=RolloutConfig(n=8, max_prompts=64, max_tokens=24, tools=tools),
        score=ScoreConfig(verifiers={"numeric": 1.0}, tool_call_cost=0.2),
        rl=RLConfig(algorithm="grpo", lr=2e-4, mini_batches=4),
        eval=EvalConfig(verifier="numeric", max_new_tokens=24),
        eval_samples=4,
    )


if __name__ == "__main__":
    from flows.rlhf import main

    result = main(tools_config())
    before, after = result["eval"][0], result["eval"][max(result["eval"])]
    for name in ("sampled_tool_precision", "sampled_tool_recall", "tool_precision", "tool_recall"):
        print(f"held-out {name.replace('_', ' ')}: start {before.get(name, float('nan')):.3f} -> after RL "
              f"{after.get(name, float('nan')):.3f}")  # fmt: skip

"""The RL loop's plan, which the flow follows: each iteration's rollout window and seed, the scoring settings an
algorithm implies, and DAPO's dynamic sampling (when enough prompts with mixed rewards have been sampled).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from posttrain_core.config import RLConfig, RolloutConfig, ScoreConfig

if TYPE_CHECKING:
    from posttrain_core.artifacts import ArtifactRef, ArtifactStore

log = logging.getLogger(__name__)


class DynamicSamplingError(RuntimeError):
    """Every generation batch so far had too few prompts with non-uniform rewards."""


def iteration_rollout(
    cfg: RolloutConfig, iteration: int, gen_batch: int = 0, max_gen_batches: int = 1, oversample: int = 1
) -> RolloutConfig:
    """The rollout settings of one iteration: the next window of `max_prompts` prompts and a seed of its own.

    Iteration k (from 1; 0 is the initial policy's batch for value pretraining), generation batch j takes the
    window starting at ((k - 1) * max_gen_batches + j) * max_prompts, wrapping around the prompts. With
    `oversample` > 1 (rl.accuracy_band's oversample_factor) a window is that many times max_prompts wide.
    """
    width = (cfg.max_prompts or 0) * oversample
    window = (max(iteration - 1, 0) * max_gen_batches + gen_batch) * width
    update = {"prompt_start": window, "seed": cfg.seed + 1000 * iteration + gen_batch}
    if oversample > 1:
        update["max_prompts"] = width
    return cfg.model_copy(update=update)


def score_config_for(rl: RLConfig, score: ScoreConfig, rollout: RolloutConfig) -> ScoreConfig:
    """DAPO turns on overlong shaping (budget = rollout.max_tokens, buffer a quarter of it) unless already set."""
    if rl.preset("overlong") and score.overlong_max_tokens is None:
        buffer = max(1, rollout.max_tokens // 4)
        return score.model_copy(update={"overlong_max_tokens": rollout.max_tokens, "overlong_buffer": buffer})
    return score


def informative_groups(store: ArtifactStore, scored: ArtifactRef) -> tuple[int, int]:
    """(groups whose rewards are not all equal, groups) of a scored-rollouts artifact."""
    from posttrain_core.data.io import read_dataset

    table = read_dataset(store.local_path(scored), "scored_rollouts").select(["prompt_id", "reward"])
    groups: dict[str, set[float]] = {}
    for pid, r in zip(table.column("prompt_id").to_pylist(), table.column("reward").to_pylist(), strict=True):
        groups.setdefault(pid, set()).add(round(r, 6))
    return sum(len(v) > 1 for v in groups.values()), len(groups)


def check_dynamic_sampling(counts: list[tuple[int, int]], want: int, max_gen_batches: int) -> bool:
    """Whether to stop sampling: True once the batches so far hold `want` informative groups, or after
    `max_gen_batches` batches with at least one (the update then trains on fewer groups, with a warning).

    Raises:
        DynamicSamplingError: `max_gen_batches` batches and not one group with non-uniform rewards.
    """
    have = sum(k for k, _ in counts)
    if have >= want:
        return True
    if len(counts) < max_gen_batches:
        return False
    seen = sum(n for _, n in counts)
    if have == 0:
        raise DynamicSamplingError(
            f"dynamic sampling: only 0 of the {want} wanted prompts have non-uniform rewards after "
            f"max_gen_batches={max_gen_batches} generation batches ({seen} prompts sampled; every group was "
            "all-correct or all-wrong, so every advantage is zero). Raise rl.max_gen_batches or rollout.n, use "
            "easier prompts or a stronger starting policy, or set rl.dynamic_sampling=false"
        )
    log.warning(
        "dynamic sampling: %d of the %d wanted prompts have non-uniform rewards after max_gen_batches=%d "
        "(%d prompts sampled); updating on those", have, want, max_gen_batches, seen,
    )  # fmt: skip
    return True

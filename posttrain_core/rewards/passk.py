"""pass@k: the unbiased estimator over n samples per problem, over a scored table (the evaluate stage reports it).

pass@k = E_problems[1 - C(n - c, k) / C(n, k)] (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples: 1 - C(n - c, k) / C(n, k).

    Computed as the stable product 1 - prod_{i = n-c+1}^{n} (1 - k / i) (no huge binomials); 1.0 when n - c < k
    (every k-subset holds a correct sample).

    Example: n=5, c=2: k=1 -> 0.4, k=2 -> 1 - (1 - 2/4)(1 - 2/5) = 0.7.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_table(scored: pa.Table, ks: Sequence[int]) -> dict[str, float]:
    """Mean pass@k over the prompts of a `scored_rollouts` table (from its `correct` column).

    Samples whose `correct` is null (a prompt without an answer) are left out; every prompt must have >= max(ks)
    samples.

    Returns:
        {"pass@k": value for each k, "num_prompts": prompts counted}.
    """
    groups: dict[str, list[bool]] = {}
    for pid, ok in zip(scored.column("prompt_id").to_pylist(), scored.column("correct").to_pylist(), strict=True):
        if ok is not None:
            groups.setdefault(pid, []).append(bool(ok))
    if not groups:
        raise ValueError("pass@k: no sample has a verifier outcome (do the prompts have answers?)")
    out: dict[str, float] = {}
    for k in ks:
        short = next((p for p, xs in groups.items() if len(xs) < k), None)
        if short is not None:
            raise ValueError(f"pass@{k}: prompt {short!r} has only {len(groups[short])} samples")
        out[f"pass@{k}"] = sum(pass_at_k(len(xs), sum(xs), k) for xs in groups.values()) / len(groups)
    out["num_prompts"] = float(len(groups))
    return out


def pass_at_k_by_family(scored: pa.Table, prompts: pa.Table, ks: Sequence[int]) -> dict[str, float]:
    """`pass_at_k_table` over all prompts, plus "pass@k/<family>" for each family named in the prompts' `meta`
    ({"family": ...}, as the synthetic tasks write it; prompts without one count only in the overall numbers)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from posttrain_core.rollout.prompts import prompt_families

    out = pass_at_k_table(scored, ks)
    families: dict[str, list[str]] = {}
    for pid, family in prompt_families(prompts).items():
        if family:
            families.setdefault(family, []).append(pid)
    for family, ids in sorted(families.items()):
        part = scored.filter(pc.is_in(scored.column("prompt_id"), pa.array(ids)))
        if part.num_rows:
            out.update({f"{k}/{family}": v for k, v in pass_at_k_table(part, ks).items() if k.startswith("pass@")})
    return out

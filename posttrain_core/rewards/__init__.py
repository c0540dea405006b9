"""Rewards for rollouts: rule-based verifiers, reward-model scores and shaping terms, combined with weights.

`score.py` (the score stage), `shaping.py` (DAPO overlong shaping), `passk.py` (the unbiased pass@k estimator).
"""

"""The learning rate of each optimizer step: the training loop's schedule, GPT-3's warm-up and
decay in tokens."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config.schema import OptimizerConfig


def learning_rate(step: int, optim: OptimizerConfig, tokens_per_step: int, total_steps: int):
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then decay.

    Warm-up and decay are measured in tokens as in the GPT-3 paper: warm-up over
    ``warmup_tokens``, then cosine (or linear) decay to ``min_learning_rate_ratio`` of the peak
    at ``decay_tokens`` (the end of the run when 0), constant afterwards.
    """
    peak = optim.learning_rate
    tokens = (step + 1) * tokens_per_step
    if tokens <= optim.warmup_tokens:
        return peak * tokens / optim.warmup_tokens
    if optim.lr_schedule == "constant":
        return peak
    end = optim.decay_tokens or total_steps * tokens_per_step
    floor = peak * optim.min_learning_rate_ratio
    if end <= optim.warmup_tokens:
        return floor
    progress = min(1.0, (tokens - optim.warmup_tokens) / (end - optim.warmup_tokens))
    if optim.lr_schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

"""How many micro-batches a step may hold, and the counts the planner weighs: each bounded, so
that planning an absurd size answers in seconds (a loop over every count up to a flag's value
is what made ``--global_batch_size 1000000000`` hang)."""

from __future__ import annotations

import math

from config.errors import ConfigError
from execution.planning.memory import micro_batches_per_pass
from execution.planning.run_shape import MOST_MICRO_BATCHES, RunShape


def pass_counts(micro_batches: int) -> list[int]:
    """The pass counts worth planning for ``micro_batches`` per step, ascending: for each
    distinct number of micro-batches per pass (``ceil(micro_batches / passes)``), the fewest
    passes that hold it. These are the divisors of ``micro_batches`` and, where a pass count
    does not divide it, the counts whose last pass runs short (7: 1, 2, 3, 4 and 7 passes).

    Jumps from one count to the next instead of trying every count: about
    ``2 sqrt(micro_batches)`` steps."""
    counts, passes = [], 1
    while True:
        counts.append(passes)
        per_pass = micro_batches_per_pass(micro_batches, passes)
        if per_pass == 1:
            return counts
        passes = math.ceil(micro_batches / (per_pass - 1))  # the fewest holding one less


def check_micro_batches(run: RunShape) -> None:
    """Refuses a step of more micro-batches per replica than :data:`MOST_MICRO_BATCHES`, in
    one line naming the flags that set it and the largest global batch they allow."""
    micro, dp, micro_batches = run.micro_batch_size, run.mesh.dp, run.gradient_accumulation
    if micro_batches <= MOST_MICRO_BATCHES:
        return
    per_step = micro * dp
    token_bytes = micro_batches * micro * (run.sequence_length + 1) * 8
    raise ConfigError(
        f"--global_batch_size {run.global_batch_size:,} over --micro_batch_size "
        f"{micro} x --data_parallel {dp} is {micro_batches:,} "
        f"micro-batches per replica per step; the planner takes 1 to {MOST_MICRO_BATCHES:,} "
        "(it costs every pass count a step splits into, and a step holds its tokens in host "
        f"memory: {token_bytes / 1e9:,.1f} GB here); use --global_batch_size at most "
        f"{MOST_MICRO_BATCHES * per_step:,} or a larger --micro_batch_size or --data_parallel"
    )


def check_plan_for_batch(global_batch_size: int, devices: int, largest_micro_batch: int) -> None:
    """``--plan_for``'s :func:`check_micro_batches`: refuses a global batch that every layout of
    ``devices`` would split into too many micro-batches per replica (the fewest: micro-batches
    of ``largest_micro_batch`` on ``devices`` data-parallel replicas). The search leaves out
    the layouts that would, where others would not."""
    fewest = global_batch_size // (largest_micro_batch * devices)
    if fewest > MOST_MICRO_BATCHES:
        raise ConfigError(
            f"--plan_for {devices} with --global_batch_size {global_batch_size:,}"
            f": even micro-batches of {largest_micro_batch} on {devices} data-parallel "
            f"replicas make {fewest:,} micro-batches per replica per step; the planner takes 1 "
            f"to {MOST_MICRO_BATCHES:,}; use --global_batch_size at most "
            f"{MOST_MICRO_BATCHES * largest_micro_batch * devices:,} or plan for more devices"
        )


def divisors_of(number: int) -> list[int]:
    """The divisors of ``number``, ascending, found in pairs up to its square root."""
    small = [n for n in range(1, math.isqrt(number) + 1) if number % n == 0]
    return small + [number // n for n in reversed(small) if n * n != number]

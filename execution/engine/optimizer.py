"""AdamW on flat shards, global-norm clipping and the learning-rate schedule."""

from __future__ import annotations

import math
from concurrent.futures import Executor

import torch

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


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor applied to every gradient; same formula as ``torch.nn.utils.clip_grad_norm_``."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


@torch.no_grad()
def adamw_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    optim: OptimizerConfig,
    weight_decay: bool,
    grad_scale: float,
) -> None:
    """One decoupled-weight-decay Adam update of a float32 shard, in place.

    The arithmetic follows ``torch.optim.AdamW`` (single-tensor path) so that the two agree to
    rounding. ``grad_scale`` folds loss-scale removal and clipping into the gradient.

    Args:
        weight, grad, exp_avg, exp_avg_sq: float32 tensors of equal shape.
        step: 1-based count of updates including this one (bias correction).
        lr: Learning rate of this step.
        optim: Betas, epsilon and the weight-decay rate.
        weight_decay: Whether this shard is decayed (matrices and embeddings only).
        grad_scale: Multiplier applied to ``grad`` before use.
    """
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if weight_decay and optim.weight_decay:
        weight.mul_(1.0 - lr * optim.weight_decay)
    exp_avg.lerp_(g, 1.0 - optim.beta1)
    exp_avg_sq.mul_(optim.beta2).addcmul_(g, g, value=1.0 - optim.beta2)
    bias_correction1 = 1.0 - optim.beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - optim.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(optim.eps)
    weight.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def adamw_threaded_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    pool: Executor,
    chunk_elements: int = 1 << 16,
    **hyper,
) -> None:
    """:func:`adamw_` on cache-sized chunks of flat host shards, chunks spread over ``pool``.

    The update is elementwise, so every chunk computes exactly what :func:`adamw_` computes for
    those elements (bitwise, tested). Two gains on a CPU: the seven passes of the update run
    over a chunk while it sits in cache instead of streaming whole shards through memory seven
    times, and torch releases the GIL inside each op, so the pool's threads run chunks in
    parallel. Chunks below torch's internal grain size run single-threaded inside torch, so the
    pool does not oversubscribe the cores.

    Args:
        weight, grad, exp_avg, exp_avg_sq: Contiguous 1-D float32 tensors of equal length.
        pool: Threads to run on (e.g. ``ThreadPoolExecutor(os.cpu_count())``), owned by the caller.
        chunk_elements: Elements per chunk (64 Ki float32: 256 KiB per tensor).
        **hyper: ``step``, ``lr``, ``optim``, ``weight_decay``, ``grad_scale`` of :func:`adamw_`.
    """
    tensors = (weight, grad, exp_avg, exp_avg_sq)
    assert all(
        t.dim() == 1 and t.is_contiguous() and t.numel() == weight.numel() for t in tensors
    ), "flat shards of equal length"

    def run(start: int) -> None:
        adamw_(*(t[start : start + chunk_elements] for t in tensors), **hyper)

    futures = [pool.submit(run, start) for start in range(0, weight.numel(), chunk_elements)]
    for future in futures:
        future.result()  # re-raises a worker's error here

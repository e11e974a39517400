"""AdamW on flat shards, global-norm clipping, the learning-rate schedule, and the driver that
updates every shard a rank holds (:class:`AdamWDriver`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import torch

from execution.parallel.sharding import DECAYED_KINDS
from modelling.host_threads import one_core_pool

if TYPE_CHECKING:
    from config.schema import OptimizerConfig
    from execution.engine.state import StateStore

# Elements per chunk of a host AdamW update: 64 Ki float32 (256 KiB per tensor) stay in cache.
HOST_CHUNK_ELEMENTS = 1 << 16


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
    mask: torch.Tensor | None = None,
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
        mask: RigL's bool mask of a sparse shard: the gradient outside it is not applied (it
            is the dense gradient, which RigL reads to grow connections, so it is masked here,
            not in place), and the weights outside it are exactly zero after the update.
    """
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if mask is not None:
        g = g.masked_fill(~mask, 0.0)
    if weight_decay and optim.weight_decay:
        weight.mul_(1.0 - lr * optim.weight_decay)
    exp_avg.lerp_(g, 1.0 - optim.beta1)
    exp_avg_sq.mul_(optim.beta2).addcmul_(g, g, value=1.0 - optim.beta2)
    bias_correction1 = 1.0 - optim.beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - optim.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(optim.eps)
    weight.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if mask is not None:
        weight.masked_fill_(~mask, 0.0)


def adamw_threaded_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    pool: Executor,
    chunk_elements: int = 1 << 16,
    mask: torch.Tensor | None = None,
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
        mask: RigL's mask of a sparse shard, as for :func:`adamw_`.
        **hyper: ``step``, ``lr``, ``optim``, ``weight_decay``, ``grad_scale`` of :func:`adamw_`.
    """
    tensors = (weight, grad, exp_avg, exp_avg_sq)
    assert all(
        t.dim() == 1 and t.is_contiguous() and t.numel() == weight.numel() for t in tensors
    ), "flat shards of equal length"

    def run(start: int) -> None:
        piece = slice(start, start + chunk_elements)
        chunk_mask = None if mask is None else mask[piece]
        adamw_(*(t[piece] for t in tensors), mask=chunk_mask, **hyper)

    futures = [pool.submit(run, start) for start in range(0, weight.numel(), chunk_elements)]
    for future in futures:
        future.result()  # re-raises a worker's error here


class AdamWDriver:
    """AdamW on every part's shards of one rank, one row of one kind at a time.

    Device-placed weights are updated on the device. Host-placed ones are updated where they
    live, by the host's cores (:func:`adamw_threaded_`, bitwise :func:`adamw_`): weights and
    moments never cross the host link, only gradients kept on the device do.

    Args:
        state: The rank's buffers.
        optim: Betas, epsilon and weight decay.
        host_threads: Threads for host updates (this process's share of the node's cores).
    """

    def __init__(self, state: StateStore, optim: OptimizerConfig, host_threads: int):
        self.state, self.optim, self.host_threads = state, optim, max(1, host_threads)
        self.steps = 0  # updates applied (AdamW's bias correction counts them)

    def update(self, lr: float, grad_scale: float) -> None:
        """One update of every shard with the step's gradients times ``grad_scale``."""
        self.steps += 1
        hyper = {"step": self.steps, "lr": lr, "optim": self.optim, "grad_scale": grad_scale}
        state = self.state
        on_host = state.places["weights"].remote
        with self._pool() if on_host else contextlib.nullcontext() as pool:
            masks = state.masks  # RigL's, where a kind is sparse
            if not on_host:
                for part, row in state.part_rows():
                    for kind in state.specs[part]:
                        mask = masks.of(part, kind, row, True) if masks is not None else None
                        w, g, m, v = state.load_optimizer_row(part, kind, row)
                        decay = kind in DECAYED_KINDS
                        adamw_(w, g, m, v, weight_decay=decay, mask=mask, **hyper)
                return
            for part, kind, row, piece, tensors in state.host_update_pieces():
                # Meta tensors (a dry run) hold nothing to compute, and the host's update is
                # priced by its elements (Window.host_update_elements), not by its ops.
                if not tensors[0].is_meta:
                    mask = masks.of(part, kind, row, False) if masks is not None else None
                    adamw_threaded_(
                        *tensors,
                        pool=pool,
                        chunk_elements=HOST_CHUNK_ELEMENTS,
                        weight_decay=kind in DECAYED_KINDS,
                        mask=None if mask is None else mask[piece],
                        **hyper,
                    )
                state.refresh_weight_copy(part, kind, row, piece)

    @contextlib.contextmanager
    def _pool(self) -> Iterator[Executor]:
        with one_core_pool(self.host_threads, "host-adamw") as pool:
            yield pool

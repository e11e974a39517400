"""What lives for one step (or one evaluation chunk) and is gone after it.

:class:`Step` holds the step's tokens, the losses its head emits, the gradient reductions in
flight and the running sum of squares for the global norm. The phase bodies
(:mod:`execution.engine.phases.bodies`, :mod:`execution.engine.phases.head`) are functions of a step and a
phase; the engine (:mod:`execution.engine.engine`) makes a fresh step for every call, so
nothing of one step can leak into the next, and no method of the engine works only half-way
through one. A step sees the rank through its :class:`~execution.engine.phases.phase_context.PhaseContext`
only, never the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from execution.engine.phases.gradients import (
    AccumulatorPool,
    Accumulators,
    InFlight,
    start_reduction,
)
from execution.engine.phases.phase_context import PhaseContext
from execution.engine.phases.schedule import Phase
from execution.engine.plan import EnginePlan
from modelling.dropout import BlockSeeds, mix_seed
from modelling.task_heads import TaskHead

# Elements of a gradient whose squares are summed at once for the global norm: a chunk's
# float64 copy (8 MiB) stays in cache while it is squared and summed, so the norm reads each
# float32 gradient once from memory (a whole shard widened at once moves 36 bytes an element,
# 4 here: 170 -> 10-25 ms for 38.7M on a CPU), and no shard-sized copy joins the working set.
NORM_CHUNK = 1 << 20
# On an accelerator (and in a dry run, which plans for one) a chunk is a launch of three kernels,
# not a cache's worth: 1M-element chunks were 5,400 launches per gpt3_175B layer (and half of
# its dry run's time in the meter). 16M elements keep a chunk's float64 copy at 128 MiB.
DEVICE_NORM_CHUNK = 1 << 24
# The most chunks of one shard: past 1024 chunks (2^30 elements, a 4 GiB float32 shard) the
# chunks grow instead, so a step's norm stays a bounded number of ops whatever the model's
# size (a dry run meters every op; a 2^40-element shard would otherwise be a million chunks).
MOST_NORM_CHUNKS = 1024


@dataclass
class Batch:
    """The tokens a step (or an evaluation chunk) works on, and what its head emits: losses,
    or with ``keep_outputs`` its outputs (a task's logits)."""

    ids: torch.Tensor  # [micro_batches, micro_batch, seq]
    labels: torch.Tensor
    step: int | None  # None: evaluation (no dropout, no backward)
    losses: list[torch.Tensor]
    keep_outputs: bool = False
    outputs: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(
        cls, tokens: torch.Tensor, step: int | None, cp, task_head: type[TaskHead] | None = None
    ) -> Batch:
        """Inputs and labels of ``tokens``, cut to sequence piece ``cp.rank`` of ``cp.size``:
        the tokens this rank holds outside attention.

        Rows are ``[..., seq + 1]`` tokens for the language model (labels: the next token),
        ``[..., seq + 2]`` for a task's head (labels: its ``TARGET_WIDTH`` targets, never
        split: a task runs without a context axis).
        """
        if task_head:
            width = task_head.TARGET_WIDTH
            return cls(tokens[..., :-width], tokens[..., -width:], step, [])
        ids, labels = tokens[..., :-1], tokens[..., 1:]
        if cp.size > 1:
            piece = ids.shape[-1] // cp.size
            ids, labels = (t.narrow(-1, cp.rank * piece, piece) for t in (ids, labels))
        return cls(ids, labels, step, [])

    @property
    def training(self) -> bool:
        return self.step is not None

    @property
    def micro_batches(self) -> int:
        return self.ids.shape[0]


def dropout_seeds(
    plan: EnginePlan, dp_rank: int, step: int | None, layer: int, micro: int
) -> BlockSeeds | None:
    """Dropout seeds of (step, global layer, global micro-batch); None disables dropout
    (evaluation, or no dropout). The embedding is layer -1.

    The same on every rank that runs the micro-batch: each draws its part of the whole
    tensor's masks (:mod:`modelling.dropout`). The micro-batch index is global (replica
    ``dp_rank``'s ``micro``-th), so the masks depend on neither the data-parallel rank nor the
    number of passes.
    """
    if step is None or plan.model.dropout_prob == 0.0:
        return None
    base = (plan.seed, step, layer, dp_rank * plan.gradient_accumulation + micro)
    return BlockSeeds(*(mix_seed(*base, kind) for kind in range(3)))


class Step:
    """One step's state on one rank, and the operations the phase bodies share.

    Args:
        context: What the phase bodies may use of the rank (read, never changed).
        batch: The step's tokens.
    """

    def __init__(self, context: PhaseContext, batch: Batch):
        self.context = context
        self.batch = batch
        self.grad_sumsq = torch.zeros((), dtype=torch.float64, device=context.device)
        self.in_flight = InFlight(context.plan.overlap_communication)
        self.pool = AccumulatorPool(context.specs, context.device)

    def entries(self, phase: Phase) -> Iterator[tuple[int, int]]:
        """(micro-batch index in the step, activation buffer entry) for each of the phase's:
        a pipeline stage keeps each pass it holds at once in a slot of its own."""
        layout = self.context.state.activations.layout
        slot = phase.pass_index % layout.in_flight * layout.entries
        return ((m, slot + m - phase.micro_batches.start) for m in phase.micro_batches)

    def seeds(self, layer: int, micro: int) -> BlockSeeds | None:
        """Dropout seeds of this step's ``micro``-th micro-batch in global ``layer``."""
        context = self.context
        seeds = dropout_seeds(context.plan, context.dp.rank, self.batch.step, layer, micro)
        if seeds is not None and context.compiled:  # a graph for every seed (compiled.py)
            return seeds.as_tensors()
        return seeds

    def layer_seeds(self, n: int, micro: int) -> BlockSeeds | None:
        """Dropout seeds of this stage's decoder layer ``n`` (seeded by its global index)."""
        return self.seeds(self.context.stage.first_layer + n, micro)

    def embedding_seed(self, micro: int) -> int | None:
        seeds = self.seeds(-1, micro)
        return seeds and seeds.attention_residual

    def accumulators(self, part: str) -> Accumulators:
        """Float32 gradient accumulators of ``part`` for one phase."""
        return self.pool.take(part)

    def finish_grads(self, acc: Accumulators, row: int, phase: Phase, norm: bool = True) -> None:
        """Reduces a phase's gradients and adds them to the step's; the last pass counts the
        norm (``norm``). The reduction is started now and completed by :class:`InFlight`."""
        context = self.context
        acc.complete()
        reductions = start_reduction(
            acc.flats,
            context.rts,
            context.dp_cp,
            context.dp.size,
            context.plan.overlap_communication,
        )

        def complete() -> None:
            shards = {kind: wait() for kind, wait in reductions.items()}
            total = context.state.grads.accumulate(acc.part, row, shards, first=phase.first_pass)
            if norm and phase.last_pass:
                masks = context.state.masks  # sparse: the norm of the gradient applied
                applied = total.values() if masks is None else masks.masked(acc.part, row, total)
                self.count_in_norm(applied)
            # The shards may be views of the accumulators: reused only once read.
            self.pool.release(acc)

        self.in_flight.add(phase, complete)

    def count_in_norm(self, shards) -> None:
        """Adds gradient shards' squares to the step's sum for the global norm."""
        for shard in shards:
            self.grad_sumsq += sum_of_squares(shard)


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s squares in float64 (each float32 square is exact in float64),
    by chunks of :data:`NORM_CHUNK` elements on a CPU, :data:`DEVICE_NORM_CHUNK` elsewhere, and
    at most :data:`MOST_NORM_CHUNKS` of them."""
    flat = tensor.reshape(-1)
    chunk = NORM_CHUNK if tensor.device.type == "cpu" else DEVICE_NORM_CHUNK
    chunks = flat.split(max(chunk, -(-flat.numel() // MOST_NORM_CHUNKS)))
    # A copy even of a float64 chunk: squaring in place must not touch the gradient.
    squares = [c.to(torch.float64, copy=True).square_().sum() for c in chunks]
    return torch.stack(squares).sum()

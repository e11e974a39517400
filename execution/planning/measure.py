"""One measurement of a step, shared by the planner, the dry run and ``--plan_for``.

:func:`meta_step` runs the real engine's set-up and one training step on meta tensors under a
:class:`~execution.planning.step_meter.StepMeter`: every shape, split and collective of the real
code runs without memory, data or devices, and what it allocates and computes is counted. The
planner measures three layers and two passes of one micro-batch of it for a plan's working set; the dry run
measures the full step of every kind of rank; ``--plan_for`` measures shrunk steps and
extrapolates.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from config.schema import PretrainingConfig
from execution.engine.phases import PhasedEngine
from execution.engine.plan import MemoryPlan, Placement
from execution.parallel.mesh import ParallelLayout
from execution.planning.memory import RankShape
from execution.planning.step_meter import FlashAttentionOnMeta, StepMeter


@dataclass
class StepMeasurement:
    """What one training step on meta tensors did.

    Attributes:
        engine: The engine that ran it (its buffers, and its layout's collective counters).
        working_set: Peak bytes allocated beyond the buffers.
        flops: Floating-point operations executed (recomputation included).
    """

    engine: PhasedEngine
    working_set: int
    flops: int


def meta_step(
    config: PretrainingConfig, plan: MemoryPlan, layout: ParallelLayout, flash: bool = True
) -> StepMeasurement:
    """Builds the engine of ``config`` on ``layout`` (meta) and measures one training step.

    Args:
        config: The run, or a shrunk copy of it (:func:`shrunk_config`).
        plan: Passes and placements to run by.
        layout: A meta layout: ``ParallelLayout.shapes_only`` or one built on a fake job.
        flash: Attention runs as the flash kernel a GPU (or a CPU without dropout) would use.
    """
    ex = config.execution
    engine = PhasedEngine(config, layout, plan)
    shape = (config.gradient_accumulation, ex.micro_batch_size, config.model.sequence_length + 1)
    tokens = torch.zeros(shape, dtype=torch.long, device="meta")
    attention = FlashAttentionOnMeta() if flash else contextlib.nullcontext()
    with attention, StepMeter() as meter:
        engine.train_step(tokens, step=0, lr=config.training.optimizer.learning_rate)
    return StepMeasurement(engine, meter.peak, meter.flops)


def shrunk_config(
    config: PretrainingConfig, layers: int, micro_batches: int, passes: int
) -> PretrainingConfig:
    """``config`` with fewer layers and micro-batches per replica, and fixed passes: the same
    shards and phases, for measuring a step quickly."""
    out = copy.deepcopy(config)
    out.model.layers = layers
    ex = out.execution
    out.training.global_batch_size = micro_batches * ex.micro_batch_size * ex.data_parallel
    ex.passes = passes
    return out


_MEASURED: dict[tuple, int] = {}


def measured_working_set(config: PretrainingConfig, device_type: str) -> int:
    """Peak bytes one step allocates beyond the buffers, measured, for this rank's shapes.

    Runs up to three decoder layers and two passes of one micro-batch of the real engine on
    meta tensors (collectives only shape their outputs), with every state on the host: loads
    from the host are copies, so this bounds every placement. Attention runs as the kernel the
    device would use (flash on a GPU, and on a CPU without dropout). With overlapped
    communication a phase also holds the next phase's gathered weights and the previous
    phase's gradients in flight: the middle of three layers meets the worst of that within a
    pass (a layer ahead and a layer behind), which every further layer repeats, and the second
    pass meets it across a pass boundary (the embedding's gradients in flight behind the next
    pass's first phases). Further micro-batches repeat a phase's body, so the result does not
    depend on more layers, passes or micro-batches.
    """
    ex = config.execution
    flash = device_type == "cuda" or config.model.dropout_prob == 0.0
    small = shrunk_config(config, layers=min(3, config.model.layers), micro_batches=2, passes=2)
    # Keyed by what is measured: configs that differ only in layers or micro-batches share it.
    key = (
        RankShape.from_config(small),
        flash,
        config.model.dropout_prob,
        ex.prefetch,
        ex.overlap_communication,
    )
    if key not in _MEASURED:
        host = Placement("host", "host", "host")
        plan = MemoryPlan(2, 1, host, {}, 0, 0, shared_memory=False)
        mesh = (ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2)
        layout = ParallelLayout.shapes_only(*mesh)
        _MEASURED[key] = meta_step(small, plan, layout, flash).working_set
    return _MEASURED[key]

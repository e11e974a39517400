"""One measurement of a step, shared by the planner, the dry run and ``--plan_for``.

:func:`meta_step` runs the real engine's set-up and one training step on meta tensors under a
:class:`~execution.planning.step_meter.StepMeter`: every shape, split and collective of the real
code runs without memory, data or devices, and what it allocates and computes is counted. The
planner measures three layers and two passes of one micro-batch of it for a plan's working set; the dry run
measures the full step of every kind of rank; ``--plan_for`` measures shrunk steps and
extrapolates.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch

from config.schema import OptimizerConfig
from execution.engine.engine import PhasedEngine, StepHooks
from execution.engine.phases.attention_kernels import AttentionKernel
from execution.engine.phases.phase_context import sinks_in_head
from execution.engine.phases.recompute import (
    attention_kernel,
    kept_layer_on_meta,
    meta_block,
)
from execution.engine.phases.schedule import Phase, weights_loaded
from execution.engine.plan import EnginePlan, MemoryPlan, Placement, compiles
from execution.engine.update.optimizer import adamw_
from execution.parallel.mesh import ParallelLayout
from execution.planning.compiled_costs import apply_changes, phase_changes
from execution.planning.memory import RankShape
from execution.planning.op_costs import OpCosts
from execution.planning.run_shape import RunShape
from execution.planning.step_meter import MetaResults, StepMeter
from modelling.dropout import BlockSeeds


@dataclass
class Window:
    """What happened while one phase ran (``kind``), or after the last (``optimizer``: the
    norm, the update and their transfers).

    Attributes:
        kind: The phase's kind (:mod:`execution.engine.phases.schedule`) or ``optimizer``.
        flops: Floating-point operations executed.
        attention_flops: The part of them the fused attention kernels ran.
        host_bytes: Bytes copied over the host link.
        calls: Per axis, the collectives issued, counted by (op, payload bytes, issued
            asynchronously): each is priced at its own size, and waited for where issued or
            not.
        costs: The kernels, bytes and matmul shapes of its ops (:mod:`~.op_costs`).
        host_update_elements: Elements the host AdamW updates (the optimizer's window, where
            weights live on the host: its threads are not metered), priced at the measured
            update rate where there is one.
        host_update_bytes: Bytes those updates read and write, priced at host memory
            bandwidth where no update rate was measured.
        host_update_rows: (part, row, elements) of each row the host update writes, in its
            order (the order the next step first loads them).
        overlap_update: The run's ``--overlap_update`` (the optimizer's window): whether the
            host update runs behind the next step.
        loads: The (part, row) whose weights the phase loads.
        micro_batches: The micro-batches its body ran (0 for the optimizer).
        rows: The rows the optimizer's window updates (0 for a phase).
        run_as: How the step ran, as its host's time was measured
            (``DeviceSpec.host_row``): its parts compiled, its recompute mode, and whether
            it draws dropout masks.
    """

    kind: str
    flops: int = 0
    host_bytes: int = 0
    attention_flops: int = 0
    calls: dict[str, Counter] = field(default_factory=dict)
    costs: OpCosts = field(default_factory=OpCosts)
    host_update_elements: int = 0
    host_update_bytes: int = 0
    host_update_rows: tuple[tuple[str, int, int], ...] = ()
    overlap_update: str = "false"
    loads: tuple[tuple[str, int], ...] = ()
    micro_batches: int = 0
    rows: int = 0
    run_as: tuple[bool, str, bool] = (False, "full", False)


class PhaseRecorder:
    """Splits a step's FLOPs, host copies and collectives into one :class:`Window` per phase,
    by reading the counters at each phase's start (the engine's ``on_phase`` hook)."""

    def __init__(self, meter: StepMeter, engine: PhasedEngine, compiled: bool = False):
        self.meter, self.engine = meter, engine
        plan = engine.plan
        self.run_as = (compiled, plan.memory.recompute, plan.model.dropout_prob > 0)
        self.windows: list[Window] = []
        self._last = self._counters()
        self._kind: str | None = None
        self._loads: tuple[tuple[str, int], ...] = ()
        self._micro_batches = 0

    def _counters(self) -> tuple:
        store, axes = self.engine.state, self.engine.layout.axes()
        return (
            self.meter.flops,
            store.host_to_device + store.device_to_host,
            {a.name: Counter(a.sized_calls) for a in axes},
            self.meter.attention_flops,
            self.meter.costs.copy(),
        )

    def _close(self) -> None:
        now = self._counters()
        if self._kind is not None:
            flops, host, calls, attention = (
                now[0] - self._last[0],
                now[1] - self._last[1],
                {a: now[2][a] - self._last[2][a] for a in now[2]},
                now[3] - self._last[3],
            )
            optimizer = self._kind == "optimizer"
            rows = host_update_rows(self.engine) if optimizer else ()
            host_update = sum(elements for *_, elements in rows)
            window = Window(
                kind=self._kind,
                flops=flops,
                host_bytes=host,
                attention_flops=attention,
                calls=calls,
                costs=now[4] - self._last[4],
                host_update_elements=host_update,
                host_update_bytes=host_update * _adamw_bytes_per_element(),
                host_update_rows=rows,
                overlap_update=self.engine.plan.overlap_update if optimizer else "false",
                loads=self._loads,
                micro_batches=self._micro_batches,
                rows=len(self.engine.state.part_rows()) if optimizer else 0,
                run_as=self.run_as,
            )
            self.windows.append(window)
        self._last = now

    def start(self, phase: Phase | None) -> None:
        """The engine's ``on_phase``: a phase starts (None: the step's phases are done)."""
        self._close()
        self._kind = phase.kind if phase is not None else "optimizer"
        self._loads = tuple(weights_loaded(phase)) if phase is not None else ()
        self._micro_batches = len(phase.micro_batches) if phase is not None else 0

    def finish(self) -> None:
        """Closes the optimizer's window (call after the step)."""
        self._close()
        self._kind = None


def host_update_rows(engine: PhasedEngine) -> tuple[tuple[str, int, int], ...]:
    """(part, row, elements) of each row one AdamW update of the engine's host-placed weights
    writes, in its order (none where the weights live on the device)."""
    state = engine.state
    if not state.places["weights"].remote:
        return ()
    return tuple(
        (part, row, sum(t[row].numel() for t in state.parts[part].weights.values()))
        for part, row in engine.optimizer.order
    )


@functools.cache
def _adamw_bytes_per_element() -> int:
    """Bytes :func:`adamw_` reads and writes per element (metered on meta tensors)."""
    n = 1 << 10
    w, g, m, v = (torch.empty(n, device="meta") for _ in range(4))
    with StepMeter() as meter:
        adamw_(
            w, g, m, v, step=1, lr=1.0, optim=OptimizerConfig(), weight_decay=True, grad_scale=0.5
        )
    return meter.costs.memory_bytes // n


@dataclass
class StepMeasurement:
    """What one training step on meta tensors did.

    Attributes:
        engine: The engine that ran it (its buffers, and its layout's collective counters).
        working_set: Peak bytes allocated beyond the buffers.
        flops: Floating-point operations executed (recomputation included).
        windows: The same per phase (:class:`Window`), in order.
    """

    engine: PhasedEngine
    working_set: int
    flops: int
    windows: list[Window] = field(default_factory=list)


def meta_step(
    plan: EnginePlan,
    layout: ParallelLayout,
    kernel: str = "flash",
    measurements: Measurements | None = None,
    compiled_on: str | None = None,
    head_sinks: bool | None = None,
) -> StepMeasurement:
    """Builds the engine of ``plan`` on ``layout`` (meta) and measures one training step.

    Args:
        plan: The rank's plan, or a shrunk copy of it (:meth:`EnginePlan.shrunk`): the same
            shards and phases with fewer layers and micro-batches, measured quickly.
        layout: A meta layout: ``ParallelLayout.shapes_only`` or one built on a fake job.
        kernel: The attention kernel to run as (:func:`attention_kernel`; a GPU's by
            default).
        measurements: The planning's, whose meta results the step replays and adds to.
        compiled_on: The device type whose compiled parts (``--compile``) the step is priced
            with (:mod:`~execution.planning.compiled_costs`); None: eager.
        head_sinks: Whether the head sums its weight's gradient where it makes it
            (``PhaseContext.head_sinks``); None: as a run compiled as ``compiled_on`` does.
    """
    measurements = measurements or Measurements()
    replayed = measurements.meta_results
    engine = PhasedEngine(plan, layout, AttentionKernel.on_meta(kernel))
    # Metered eager, but with the head's gradient as the run computes it.
    compiled = compiled_on is not None
    sinks = sinks_in_head(compiled, engine.context.dtype) if head_sinks is None else head_sinks
    engine.context = dataclasses.replace(engine.context, head_sinks=sinks)
    row = plan.sequence_length + plan.model.label_columns
    shape = (plan.gradient_accumulation, plan.micro_batch_size, row)
    tokens = torch.zeros(shape, dtype=torch.long, device="meta")
    # Metered once per process, on meta tensors of its own, and before this step's meter
    # starts: inside it, that first metering would count as the step's ops.
    _adamw_bytes_per_element()
    with StepMeter(replayed, engine.state.host_buffers()) as meter:
        recorder = PhaseRecorder(meter, engine, compiled_on is not None)
        if engine.kept is not None:  # kept in place: the activations' figure, not working set
            engine.kept.on_keep = meter.disown
        hooks = StepHooks(on_phase=recorder.start)
        engine.train_step(tokens, step=0, lr=plan.optimizer.learning_rate, hooks=hooks)
        recorder.finish()
    if compiled_on is not None:  # each part's call priced once per planning
        changes = phase_changes(engine, kernel, compiled_on, measurements.layers)
        apply_changes(recorder.windows, changes)
    return StepMeasurement(engine, meter.peak, meter.flops, recorder.windows)


class Measurements:
    """Steps measured on meta tensors while planning, kept for the rest of one planning (a
    run's start, a dry run, a ``--plan_for`` search) so that each distinct shape is measured
    once. Whoever starts the planning makes one and passes it down; nothing is kept between
    plannings that were not given the same one.

    Attributes:
        working_sets: :func:`measured_working_set`'s results by what they depend on.
        probes: ``--plan_for``'s shrunk steps by shape and device spec
            (:mod:`execution.planning.plan_search`).
        meta_results: Meta ops run so far, replayed by later steps
            (:class:`~execution.planning.step_meter.MetaResults`).
        layers: What a decoder layer keeps and recomputes, by its shapes
            (:attr:`~execution.planning.memory.RankShape.layer_memo`).
    """

    def __init__(self) -> None:
        self.working_sets: dict[tuple, int] = {}
        self.probes: dict[str, tuple] = {}
        self.meta_results = MetaResults()
        self.layers: dict = {}  # RankShape.layer_memo: what a decoder layer keeps, recomputes


def measured_working_set(
    run: RunShape,
    device_type: str,
    recompute: str = "full",
    measurements: Measurements | None = None,
) -> int:
    """Peak bytes one step allocates beyond the buffers, measured, for this rank's shapes.

    Runs up to three decoder layers and two passes of one micro-batch of the real engine on
    meta tensors (collectives only shape their outputs), with every state on the host: loads
    from the host are copies, so this bounds every placement. Attention runs as the kernel the
    device would use (:func:`attention_kernel`), and layers keep for their backward what
    ``recompute`` says. With overlapped communication a phase also holds the next phase's
    gathered weights and the previous phase's gradients in flight: the middle of three layers
    meets the worst of that within a pass (a layer ahead and a layer behind), which every
    further layer repeats, and the second pass meets it across a pass boundary (the
    embedding's gradients in flight behind the next pass's first phases). Further
    micro-batches repeat a phase's body, so the result does not depend on more layers, passes
    or micro-batches. ``measurements``: where earlier results of this planning are kept.
    """
    measurements = measurements or Measurements()
    known = measurements.working_sets
    layers = min(3, run.model.layers)
    whole = RankShape.of(run, layer_memo=measurements.layers)
    kernel = attention_kernel(device_type, run.model.dropout_prob, whole.dtype)
    # Keyed by what is measured: runs that differ only in layers or micro-batches share it.
    rank = dataclasses.replace(
        whole,
        shapes=dataclasses.replace(whole.shapes, layers=layers),
        gradient_accumulation=2,
        stage=None,  # one stage of a pipeline runs a subset of the whole model's phases
    )
    flags = (run.prefetch, run.overlap_communication, run.fixed_weight_buffers)
    compiled = compiles(run.compile, device_type)
    key = (rank, kernel, *flags, recompute, compiled)
    if key not in known:
        host = Placement("host", "host", "host")
        kept = rank.kept(recompute, kernel).entry
        memory = MemoryPlan(
            passes=2,
            micro_batches_per_pass=1,
            placement=host,
            state_bytes={},
            working_set=0,
            traffic=0,
            shared_memory=False,
            recompute=recompute,
            kept=kept,
        )
        plan = run.engine_plan(memory).shrunk(layers, micro_batches=2, passes=2)
        mesh = run.mesh  # without its pipeline axis, as the rank's stage above
        layout = ParallelLayout.shapes_only(mesh.dp, mesh.tp1, mesh.tp2, cp=mesh.cp)
        step = meta_step(
            plan, layout, kernel, measurements, head_sinks=sinks_in_head(compiled, whole.dtype)
        )
        known[key] = step.working_set
    return known[key]


def recompute_flops(rank: RankShape, recompute: str, kernel: str) -> int:
    """FLOPs one decoder layer's backward spends per micro-batch recomputing what its forward
    did not keep, measured on meta tensors with attention as ``kernel``: the whole layer
    forward (``full``), what a checkpointed attention core recomputes beyond keeping
    everything (``selective``: a layer's forward and backward against ``none``'s; checkpoint
    stops recomputing once the backward has what it needs, so this is less than the core's
    forward), or nothing (``none``)."""
    if recompute == "none":
        return 0
    # A layer's shard and micro-batch decide it, not the replicas or the batch: measured once
    # per planning for all the layouts --plan_for weighs that share them.
    key = ("recompute_flops", rank.shapes, rank.micro_batch, rank.sequence, rank.dtype)
    key += (recompute, kernel)
    if key not in rank.layer_memo:
        rank.layer_memo[key] = _layer_recompute_flops(
            rank.shapes, rank.micro_batch, rank.sequence, rank.dtype, recompute, kernel
        )
    return rank.layer_memo[key]


def _layer_recompute_flops(s, micro_batch, sequence, dtype, recompute, kernel) -> int:
    if recompute == "selective":
        flops = []
        for mode in ("selective", "none"):
            with StepMeter() as meter:
                kept_layer_on_meta(s, micro_batch, sequence, dtype, mode, kernel)
            flops.append(meter.flops)
        return flops[0] - flops[1]
    x = torch.empty(micro_batch, sequence, s.hidden // s.tp2, dtype=dtype, device="meta")
    seeds = BlockSeeds(1, 2, 3) if s.dropout_prob else None
    block = meta_block(s, kernel)
    with StepMeter() as meter, torch.no_grad():
        block(x, seeds)
    return meter.flops

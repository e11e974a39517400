"""The phased training step (docs/design.md, "The phases of a step"): the engine of one rank.

Four concerns, four places:

- *which* phases run, in which order, over which micro-batches: :mod:`execution.engine.phases.schedule`
  (one or more passes over the step's micro-batches, one stage of a pipeline);
- *where* state lives and how it moves (loads, stores, gathers): :mod:`execution.engine.storage.state`,
  placed by the plan the engine is given (:class:`~execution.engine.plan.EnginePlan`);
- *what* each phase computes: :mod:`execution.engine.phases.bodies` and :mod:`execution.engine.phases.head`,
  functions of the step (:class:`~execution.engine.phases.step.Step`) and the phase, which see the
  rank through the :class:`~execution.engine.phases.phase_context.PhaseContext` the engine builds once;
- the update: :class:`~execution.engine.update.optimizer.AdamWDriver`.

What lives as long as the rank does (buffers, templates, the pipeline link, its stage and
shapes) has one home: the engine builds it into the rank's ``PhaseContext`` and keeps that; it
holds itself only what no body uses (the layout, the attention kernel, the update). It drives a
step: it runs the schedule's phases (:mod:`execution.engine.phases.runner`), reduces the norm,
clips and updates.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from execution.engine.phases import pipeline, schedule
from execution.engine.phases.attention_kernels import AttentionKernel, engine_attention
from execution.engine.phases.binding import WeightSlots
from execution.engine.phases.compiled import CompileWatch, compile_parts, compile_unavailable
from execution.engine.phases.phase_context import PhaseContext, sinks_in_head
from execution.engine.phases.recompute import KeptLayers
from execution.engine.phases.runner import run_phases
from execution.engine.phases.schedule import Phase, Stage
from execution.engine.phases.selective import attention_for
from execution.engine.phases.step import Batch, Step
from execution.engine.plan import PLACED_STATES, EnginePlan, MemoryPlan
from execution.engine.storage.buffers import DTYPES, ActivationLayout, Place, flat_specs
from execution.engine.storage.state import StateStore
from execution.engine.update.optimizer import AdamWDriver, clip_coefficient
from execution.engine.update.rigl import RigL
from execution.parallel.launch import usable_cores
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import init_part_shard, rts_axes
from modelling.components import Components
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, PARTS, GPTShapes
from utils.torch_private import storage_id


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    skipped: bool  # the gradients were not finite, so no weight changed
    rigl: dict[str, float] | None = None  # a connectivity update's statistics, if one ran
    compiled_graphs: int = 0  # graphs torch.compile made during the step (--compile)


@dataclass
class StepHooks:
    """What a caller runs inside a step, passed to :meth:`PhasedEngine.train_step`.

    Attributes:
        on_phase: Called with each phase just before it starts (and its next phase's
            prefetch), and with None after the last (the dry run measures per phase).
        before_update: Called before the optimizer changes the buffers (a checkpoint writing
            from host buffers waits there until it has read them).
    """

    on_phase: Callable[[Phase | None], None] | None = None
    before_update: list[Callable[[], None]] = field(default_factory=list)


def _in_context(name: str) -> property:
    """An engine attribute that reads a field of its :class:`PhaseContext`, the one place a
    fact of the rank lives (a checkpoint, the planner and the loop read it by the engine)."""
    return property(lambda engine: getattr(engine.context, name))


class PhasedEngine:
    """Owns the buffers of one rank and runs training and evaluation steps phase by phase.

    Args:
        plan: How this rank executes
            (:meth:`~execution.planning.run_shape.RunShape.engine_plan`); the
            engine reads nothing else.
        layout: This rank's parallel geometry (``ParallelLayout.single`` for one process).
        attention: The kernel attention runs (None: chosen here, :func:`engine_attention`;
            planning gives a meta engine its device's, :meth:`AttentionKernel.on_meta`).

    Attributes:
        context: What the rank's phase bodies use, built once (its plan, shapes, buffers,
            templates, stage, ...): the engine's attributes of the same names read it there.
        attention: The kernel the layers' attention runs.
        optimizer: The update (its steps, its host update behind the next step).
        rigl: The sparse connectivity's updates, or None for a dense run.
    """

    plan = _in_context("plan")
    shapes = _in_context("shapes")
    state = _in_context("state")
    templates = _in_context("templates")
    kept = _in_context("kept")
    stage = _in_context("stage")
    dtype = _in_context("dtype")
    device = _in_context("device")
    specs = _in_context("specs")
    rts = _in_context("rts")
    compiled = _in_context("compiled")

    def __init__(
        self, plan: EnginePlan, layout: ParallelLayout, attention: AttentionKernel | None = None
    ):
        self.layout = layout
        shapes = dataclasses.replace(plan.model, tp1=layout.tp1.size, tp2=layout.tp2.size)
        dtype = DTYPES[plan.precision]
        compiled = _compiles(plan, layout)
        # The fastest attention kernel timed that passes its check here, pinned (compiled: its
        # dropout one op of the graph): the blocks are built with it, and with --recompute's.
        self.attention = attention or engine_attention(plan, shapes, layout, dtype, compiled)
        recomputed = attention_for(plan.memory.recompute)
        templates = _templates(shapes, layout, Components.of(shapes, self.attention, recomputed))
        rts = rts_axes(layout)
        specs = flat_specs(shapes, {kind: axis.size for kind, axis in rts.items()})
        # This rank's pipeline stage: its layers, and the passes it holds at once.
        model = plan.model
        stage = Stage.of(
            plan.stage_layers, layout.pp.rank, model.task_head is not None, model.tied_head
        )
        # How long the set-up's two large costs took (the first GPU run prints them): the
        # buffers (on a GPU, registering every host page) and drawing the weights into them.
        started = time.perf_counter()
        state = _buffers(plan, layout, shapes, specs, rts, stage, dtype)
        self.setup_seconds = {"buffers": time.perf_counter() - started, "weights": 0.0}
        link = pipeline.Link(layout.pp, stage, state.activations.layout, layout.device)
        # What the layers keep for their backward (None: they recompute it in full).
        kept = None
        if plan.memory.recompute != "full":
            acts = state.activations
            kept = KeptLayers(
                templates[LAYERS],
                specs[LAYERS],
                acts.kept,
                acts.store_kept,
                acts.load_kept,
                exact_strides=compiled,
                in_place=acts.keeps_in_place,
                buffers=frozenset({storage_id(acts.x)}),
            )
        if compiled:
            compile_parts(templates)
        self.context = PhaseContext(
            plan=plan,
            shapes=shapes,
            state=state,
            templates=MappingProxyType(templates),
            slots=MappingProxyType({part: WeightSlots(t) for part, t in templates.items()}),
            kept=kept,
            link=link,
            stage=stage,
            dtype=dtype,
            device=layout.device,
            specs=MappingProxyType(specs),
            rts=MappingProxyType(rts),
            dp=layout.dp,
            cp=layout.cp,
            dp_cp=layout.dp_cp,
            tied_across_stages=layout.embedding.size > 1 and model.ties_word_embedding,
            compiled=compiled,
            head_sinks=sinks_in_head(compiled, dtype),
        )
        self.compile_watch = CompileWatch()
        host_threads = usable_cores() // max(layout.local_world_size, 1)
        # A host update behind a step writes the rows in the order that step first loads them.
        order = stage.load_order(plan.gradient_accumulation, plan.memory.passes)
        overlap = self.overlaps_update
        self.optimizer = AdamWDriver(state, plan.optimizer, host_threads, overlap, order)
        self.rigl: RigL | None = None
        if plan.sparsity is not None:
            self.rigl = RigL(plan.sparsity, state, shapes, layout, stage.first_layer)
        if layout.device.type != "meta":  # a dry run draws no weights
            started = time.perf_counter()
            _initialise_weights(state, shapes, plan, layout, max(1, host_threads))
            if layout.device.type == "cuda":  # the last copies to the device landed
                torch.cuda.synchronize(layout.device)
            self.setup_seconds["weights"] = time.perf_counter() - started
            if self.rigl is not None:
                self.rigl.initialise(plan.seed)

    @property
    def memory(self) -> MemoryPlan:
        """Where the rank's state lives and what its layers recompute (the plan's)."""
        return self.context.plan.memory

    @property
    def overlaps_update(self) -> bool:
        """Whether the host update of a step runs behind the next (``--overlap_update``; auto:
        on a GPU, whose host cores are idle while it computes, not on a CPU, where they are the
        device's)."""
        choice = self.context.plan.overlap_update
        return choice == "true" or (choice == "auto" and self.context.device.type == "cuda")

    def finish_update(self) -> None:
        """Waits for the host update running behind the step, if any: before anything reads
        every row (a checkpoint, an evaluation, RigL, the end of the run)."""
        self.optimizer.finish()

    @property
    def optimizer_steps(self) -> int:
        """Updates applied so far (a checkpoint saves and restores it)."""
        return self.optimizer.steps

    @optimizer_steps.setter
    def optimizer_steps(self, steps: int) -> None:
        self.optimizer.steps = steps

    # ----------------------------------------------------------------- steps

    def train_step(
        self, tokens: torch.Tensor, step: int, lr: float, hooks: StepHooks | None = None
    ) -> StepResult:
        """One optimizer step on this rank's micro-batches.

        Args:
            tokens: int64 ``[gradient_accumulation, micro_batch, sequence_length + 1]``; a
                task's rows carry its two targets instead (``sequence_length + 2``).
            step: 0-based step index (seeds dropout).
            lr: Learning rate for this step.
            hooks: What the caller runs inside the step (:class:`StepHooks`).
        """
        hooks = hooks or StepHooks()
        ctx = self.context
        plan, stage = ctx.plan, ctx.stage
        row = plan.sequence_length + plan.model.label_columns
        expected = (plan.gradient_accumulation, plan.micro_batch_size, row)
        assert tuple(tokens.shape) == expected, f"batch {tuple(tokens.shape)} != {expected}"
        if ctx.kept is not None:
            ctx.kept.drop()  # none left by a step that raised half-way
        tokens = tokens.to(ctx.device, non_blocking=True)
        run = Step(ctx, Batch.of(tokens, step, self.layout.cp, plan.model.task_head))
        phases = schedule.training_phases(stage, plan.gradient_accumulation, plan.memory.passes)
        self._run_phases(phases, run, hooks.on_phase)
        ctx.state.grads.settle()  # every gradient is where it lives before anything reads it
        if ctx.tied_across_stages:
            tied = pipeline.sum_tied_gradient(ctx.state, self.layout.embedding)
            if stage.is_first:  # counted once, by the first stage
                run.count_in_norm(tied)

        scale = plan.loss_scaling
        grad_norm = math.sqrt(_read(self.layout.world.all_reduce_(run.grad_sumsq))) / scale
        losses = run.batch.losses  # the last stage's (the head's)
        total = torch.stack(losses).float().sum() if losses else torch.zeros((), device=ctx.device)
        loss = self._mean_over_replicas(total, len(losses))
        compiled = self.compile_watch.since_last()  # the update compiles nothing
        if not math.isfinite(grad_norm):
            return StepResult(loss, grad_norm, skipped=True, compiled_graphs=compiled)
        clip = clip_coefficient(grad_norm, plan.optimizer.gradient_clipping)
        for wait in hooks.before_update:
            wait()
        self.optimizer.update(lr, grad_scale=clip / scale)
        rigl = None
        if self.rigl is not None and ctx.device.type != "meta":
            if self.rigl.schedule.updates_at(self.optimizer.steps):
                self.finish_update()  # a connectivity update reads and writes every row
            rigl = self.rigl.update(self.optimizer.steps, scale)
        return StepResult(loss, grad_norm, skipped=False, rigl=rigl, compiled_graphs=compiled)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss (no dropout, no update) over batches of ``[micro_batch, seq + 1]``.

        Runs the forward phases and the head over as many micro-batches at a time as one pass
        holds. Collective: every rank must call it. Replicas use as many batches as the one
        with the fewest, since each phase's weight all-gather needs every replica.
        """
        self.finish_update()
        device = self.context.device
        batches = list(batches)
        count_tensor = torch.tensor(len(batches), device=device)
        batches = batches[: int(self.layout.dp.all_reduce_(count_tensor, op="min"))]
        losses = [loss for batch in self._forward_chunks(batches) for loss in batch.losses]
        total = torch.stack(losses).double().sum() if losses else torch.zeros((), device=device)
        return self._mean_over_replicas(total, len(losses))

    @torch.no_grad()
    def predict(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """A task head's float32 logits for each micro-batch of ``[micro_batch, seq + 2]``
        rows (no dropout, no update): ``[micro_batch, seq, 2]`` or ``[micro_batch, 3]``.

        Collective: every rank calls it, each replica with as many batches. Every rank gets
        its replica's logits: the last pipeline stage computes them, and a sum over the
        pipeline group, to which the other stages add zeros, hands them on.
        """
        self.finish_update()
        plan = self.context.plan
        head = plan.model.task_head
        assert head, "predict needs a task's head"
        outputs = [out for batch in self._forward_chunks(batches, True) for out in batch.outputs]
        if self.layout.pp.size == 1 or not batches:
            return outputs
        if not outputs:  # a stage before the last
            shape = head.output_shape(batches[0].shape[0], plan.sequence_length)
            outputs = [torch.zeros(shape, device=self.context.device) for _ in batches]
        return list(self.layout.pp.all_reduce_(torch.stack(outputs)))

    def _forward_chunks(self, batches: list[torch.Tensor], keep_outputs: bool = False):
        """Runs the forward phases and the head over as many micro-batches at a time as one
        pass holds; returns each chunk's :class:`Batch` with what its head emitted."""
        ctx = self.context
        per_pass = ctx.plan.memory.micro_batches_per_pass
        done = []
        for index, start in enumerate(range(0, len(batches), per_pass)):
            tokens = torch.stack(batches[start : start + per_pass]).to(ctx.device)
            batch = Batch.of(tokens, None, self.layout.cp, ctx.plan.model.task_head)
            batch.keep_outputs = keep_outputs
            phases = schedule.evaluation_phases(ctx.stage, range(len(tokens)), index)
            self._run_phases(phases, Step(ctx, batch))
            done.append(batch)
        self.compile_watch.since_last()  # an evaluation's own graphs are no step's
        return done

    def _run_phases(
        self,
        phases: list[Phase],
        run: Step,
        on_phase: Callable[[Phase | None], None] | None = None,
    ) -> None:
        """Runs the phases (:func:`~execution.engine.phases.runner.run_phases`); where graphs
        of the compiled parts could not compile, says so and goes on."""
        failed = run_phases(run, phases, self.compile_watch, on_phase)
        if failed:  # a rank's own parts (a pipeline stage's): each rank says so
            rank = f"rank {self.layout.rank}: " if self.layout.world.size > 1 else ""
            reason = "Dynamo's warning says why"
            print(f"--compile: {rank}{failed} graph(s) could not compile ({reason}); going on")

    def _mean_over_replicas(self, total: torch.Tensor, count: int) -> float:
        """Mean of per-micro-batch losses over data replicas and sequence pieces (all pieces
        have the same number of tokens, so the mean of their means is the whole mean)."""
        count_tensor = torch.tensor(float(count), device=self.context.device)
        both = torch.stack([total.double(), count_tensor.double()])
        both = self.layout.dp_cp.all_reduce_(both)
        both = self.layout.pp.all_reduce_(both)  # from the last stage (others add zeros)
        total_all, count_all = _read(both[0]), _read(both[1])
        return total_all / count_all if count_all else float("nan")

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of host or device buffers held by this rank: weights, optimizer, grads,
        activations."""
        return self.context.state.nbytes()


def _templates(
    shapes: GPTShapes, layout: ParallelLayout, components: Components
) -> dict[str, torch.nn.Module]:
    """Stateless templates of the parts, on meta, built from ``components``: each phase binds
    its weights to them (phases/binding.py), and one block serves every layer."""
    with torch.device("meta"):
        one_layer = dataclasses.replace(shapes, layers=1)
        model = GPT(one_layer, layout.tp1, layout.tp2, layout.cp, components)
    return {EMBEDDING: model.embedding, LAYERS: model.layers[0], HEAD: model.head}


def _buffers(plan, layout, shapes, specs, rts, stage: Stage, dtype) -> StateStore:
    """This rank's buffers, placed by the plan, sized for its stage."""
    memory = plan.memory
    places = {s: Place.of(getattr(memory.placement, s), layout.device) for s in PLACED_STATES}
    activations = ActivationLayout.of(
        dataclasses.replace(shapes, layers=stage.layers),
        memory.micro_batches_per_pass,
        plan.micro_batch_size,
        plan.sequence_length // layout.cp.size,  # this rank's piece
        dtype,
        kept=memory.kept,
        in_flight=stage.in_flight(memory.passes),
    )
    return StateStore(
        specs=specs,
        layers=stage.layers,
        rts=rts,
        layout=layout,
        places=places,
        activations=activations,
        rows={part: stage.rows(part) for part in PARTS},
        first_layer=stage.first_layer,
        sparse=plan.sparsity is not None,
        fixed_layer_buffers=plan.fixed_weight_buffers,
    )


def _compiles(plan: EnginePlan, layout: ParallelLayout) -> bool:
    """Whether the parts run compiled (``--compile``; auto: on a GPU). Where inductor
    cannot run, the main rank says why in one line and the parts run eager. A dry run's
    meta engine runs eager: the planner prices the compiled graphs apart."""
    device = layout.device.type
    if not plan.compiles_on(device) or device == "meta":
        return False
    reason = compile_unavailable(device)
    if reason is not None and layout.is_main:
        print(f"--compile: torch.compile cannot run here ({reason}); running eager", flush=True)
    return reason is None


def _initialise_weights(state, shapes, plan, layout, workers: int) -> None:
    """Draws only this rank's tensor-parallel shard of each part, keeps its RTS slice.

    The shard holds the same numbers as a slice of the full part (per-tile seeds), so every
    layout starts identically while no rank draws or holds a whole part. ``workers``
    threads draw the tiles (the same numbers as one thread would).
    """
    i, j = layout.tp1.rank, layout.tp2.rank
    for part, row in state.part_rows():
        layer = state.logical_row(part, row)
        local = init_part_shard(shapes, part, layer, plan.seed, plan.init_std, i, j, workers)
        state.write_shard(part, row, "weights", local)


def _read(scalar: torch.Tensor) -> float:
    """A scalar's value; a meta tensor (dry run) has none and reads as 0, so a dry-run step
    runs its optimizer phases as a real one would."""
    return 0.0 if scalar.is_meta else scalar.item()

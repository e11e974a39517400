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

The engine holds what lives as long as the rank does (buffers, templates, the pipeline link)
and drives a step: it runs the schedule's phases, reduces the norm, clips and updates.
"""

from __future__ import annotations

import contextlib
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
from execution.engine.phases.bodies import BODIES
from execution.engine.phases.compiled import CompileWatch, compile_parts, compile_unavailable
from execution.engine.phases.phase_context import PhaseContext
from execution.engine.phases.recompute import KeptLayers
from execution.engine.phases.schedule import LAYER_BACKWARD, LAYER_FORWARD, Phase, Stage
from execution.engine.phases.selective import attention_for
from execution.engine.phases.step import Batch, Step
from execution.engine.plan import PLACED_STATES, EnginePlan
from execution.engine.storage.buffers import DTYPES, ActivationLayout, Place, flat_specs
from execution.engine.storage.state import StateStore
from execution.engine.update.optimizer import AdamWDriver, clip_coefficient
from execution.engine.update.rigl import RigL
from execution.parallel.collective_errors import CollectiveError
from execution.parallel.launch import usable_cores
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import init_part_shard, rts_axes
from modelling.components import Components
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, PARTS
from utils.torch_private import eager_where_compiling_fails


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


class PhasedEngine:
    """Owns the buffers of one rank and runs training and evaluation steps phase by phase.

    Args:
        plan: How this rank executes
            (:meth:`~execution.planning.run_shape.RunShape.engine_plan`); the
            engine reads nothing else.
        layout: This rank's parallel geometry (``ParallelLayout.single`` for one process).
        attention: The kernel attention runs (None: chosen here, :func:`engine_attention`;
            planning gives a meta engine its device's, :meth:`AttentionKernel.on_meta`).
    """

    def __init__(
        self, plan: EnginePlan, layout: ParallelLayout, attention: AttentionKernel | None = None
    ):
        self.plan = plan
        self.memory = plan.memory
        self.layout = layout
        self.device = layout.device
        self.shapes = dataclasses.replace(plan.model, tp1=layout.tp1.size, tp2=layout.tp2.size)
        self.dtype = DTYPES[plan.precision]
        self.compiled = self._compiles()
        # The fastest attention kernel timed that passes its check here, pinned (compiled: its
        # dropout one op of the graph): the blocks are built with it, and with --recompute's.
        chosen = attention or engine_attention(plan, self.shapes, layout, self.dtype, self.compiled)
        self.attention = chosen
        components = Components.of(
            self.shapes, self.attention, attention_for(self.memory.recompute)
        )
        with torch.device("meta"):  # one block serves every layer
            model = dataclasses.replace(self.shapes, layers=1)
            template = GPT(model, layout.tp1, layout.tp2, layout.cp, components)
        # Stateless templates: each phase binds its weights to them (phases/binding.py).
        self.templates = {
            EMBEDDING: template.embedding,
            LAYERS: template.layers[0],
            HEAD: template.head,
        }
        self.rts = rts_axes(layout)
        self.specs = flat_specs(self.shapes, {kind: axis.size for kind, axis in self.rts.items()})
        # This rank's pipeline stage: its layers, and the passes it holds at once.
        self.stage = Stage.of(
            plan.stage_layers,
            layout.pp.rank,
            plan.model.task_head is not None,
            plan.model.tied_head,
        )
        # How long the set-up's two large costs took (the first GPU run prints them): the
        # buffers (on a GPU, registering every host page) and drawing the weights into them.
        started = time.perf_counter()
        self.state = self._buffers()
        self.setup_seconds = {"buffers": time.perf_counter() - started, "weights": 0.0}
        self.link = pipeline.Link(layout.pp, self.stage, self.state.activations.layout, self.device)
        # What the layers keep for their backward (None: they recompute it in full).
        self.kept: KeptLayers | None = None
        if self.memory.recompute != "full":
            acts = self.state.activations
            self.kept = KeptLayers(
                self.templates[LAYERS],
                self.specs[LAYERS],
                acts.kept,
                acts.store_kept,
                acts.load_kept,
                exact_strides=self.compiled,
                in_place=acts.keeps_in_place,
                buffers=frozenset({acts.x.untyped_storage()._cdata}),
            )
        if self.compiled:
            compile_parts(self.templates)
        self.compile_watch = CompileWatch()
        host_threads = usable_cores() // max(layout.local_world_size, 1)
        # A host update behind a step writes the rows in the order that step first loads them.
        order = self.stage.load_order(plan.gradient_accumulation, self.memory.passes)
        overlap = self.overlaps_update
        self.optimizer = AdamWDriver(self.state, plan.optimizer, host_threads, overlap, order)
        self.rigl: RigL | None = None
        if plan.sparsity is not None:
            first = self.stage.first_layer
            self.rigl = RigL(plan.sparsity, self.state, self.shapes, layout, first)
        self.context = PhaseContext(
            plan=plan,
            shapes=self.shapes,
            state=self.state,
            templates=MappingProxyType(self.templates),
            slots=MappingProxyType({part: WeightSlots(t) for part, t in self.templates.items()}),
            kept=self.kept,
            link=self.link,
            stage=self.stage,
            dtype=self.dtype,
            device=self.device,
            specs=MappingProxyType(self.specs),
            rts=MappingProxyType(self.rts),
            dp=layout.dp,
            cp=layout.cp,
            dp_cp=layout.dp_cp,
            tied_across_stages=self.tied_across_stages,
            compiled=self.compiled,
        )
        if self.device.type != "meta":  # a dry run draws no weights
            started = time.perf_counter()
            self._initialise_weights(max(1, host_threads))
            if self.device.type == "cuda":  # the last copies to the device landed
                torch.cuda.synchronize(self.device)
            self.setup_seconds["weights"] = time.perf_counter() - started
            if self.rigl is not None:
                self.rigl.initialise(plan.seed)

    def _buffers(self) -> StateStore:
        """This rank's buffers, placed by the plan, sized for its stage."""
        plan, memory = self.plan, self.memory
        places = {s: Place.of(getattr(memory.placement, s), self.device) for s in PLACED_STATES}
        activations = ActivationLayout.of(
            dataclasses.replace(self.shapes, layers=self.stage.layers),
            memory.micro_batches_per_pass,
            plan.micro_batch_size,
            plan.sequence_length // self.layout.cp.size,  # this rank's piece
            self.dtype,
            kept=memory.kept,
            in_flight=self.stage.in_flight(memory.passes),
        )
        return StateStore(
            specs=self.specs,
            layers=self.stage.layers,
            rts=self.rts,
            layout=self.layout,
            places=places,
            activations=activations,
            rows={part: self.stage.rows(part) for part in PARTS},
            first_layer=self.stage.first_layer,
            sparse=plan.sparsity is not None,
        )

    def _initialise_weights(self, workers: int) -> None:
        """Draws only this rank's tensor-parallel shard of each part, keeps its RTS slice.

        The shard holds the same numbers as a slice of the full part (per-tile seeds), so every
        layout starts identically while no rank draws or holds a whole part. ``workers``
        threads draw the tiles (the same numbers as one thread would).
        """
        i, j = self.layout.tp1.rank, self.layout.tp2.rank
        seed, std = self.plan.seed, self.plan.init_std
        for part, row in self.state.part_rows():
            layer = self.state.logical_row(part, row)
            local = init_part_shard(self.shapes, part, layer, seed, std, i, j, workers)
            self.state.write_shard(part, row, "weights", local)

    @property
    def tied_across_stages(self) -> bool:
        """The word embedding's gradient is summed over the first and last pipeline stage
        (the language model's head is tied to it, unless untied; a task's head ties nothing)."""
        return self.layout.embedding.size > 1 and self.plan.model.ties_word_embedding

    def _compiles(self) -> bool:
        """Whether the parts run compiled (``--compile``; auto: on a GPU). Where inductor
        cannot run, the main rank says why in one line and the parts run eager. A dry run's
        meta engine runs eager: the planner prices the compiled graphs apart."""
        if not self.plan.compiles_on(self.device.type) or self.device.type == "meta":
            return False
        reason = compile_unavailable(self.device.type)
        if reason is not None and self.layout.is_main:
            print(f"--compile: torch.compile cannot run here ({reason}); running eager", flush=True)
        return reason is None

    @property
    def overlaps_update(self) -> bool:
        """Whether the host update of a step runs behind the next (``--overlap_update``; auto:
        on a GPU, whose host cores are idle while it computes, not on a CPU, where they are the
        device's)."""
        choice = self.plan.overlap_update
        return choice == "true" or (choice == "auto" and self.device.type == "cuda")

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
        plan = self.plan
        row = plan.sequence_length + plan.model.label_columns
        expected = (plan.gradient_accumulation, plan.micro_batch_size, row)
        assert tuple(tokens.shape) == expected, f"batch {tuple(tokens.shape)} != {expected}"
        if self.kept is not None:
            self.kept.drop()  # none left by a step that raised half-way
        tokens = tokens.to(self.device, non_blocking=True)
        run = Step(self.context, Batch.of(tokens, step, self.layout.cp, plan.model.task_head))
        phases = schedule.training_phases(
            self.stage, plan.gradient_accumulation, self.memory.passes
        )
        self._run_phases(phases, run, hooks.on_phase)
        self.state.grads.settle()  # every gradient is where it lives before anything reads it
        if self.tied_across_stages:
            tied = pipeline.sum_tied_gradient(self.state, self.layout.embedding)
            if self.stage.is_first:  # counted once, by the first stage
                run.count_in_norm(tied)

        scale = plan.loss_scaling
        grad_norm = math.sqrt(_read(self.layout.world.all_reduce_(run.grad_sumsq))) / scale
        losses = run.batch.losses  # the last stage's (the head's)
        total = torch.stack(losses).float().sum() if losses else torch.zeros((), device=self.device)
        loss = self._mean_over_replicas(total, len(losses))
        compiled = self.compile_watch.since_last()  # the update compiles nothing
        if not math.isfinite(grad_norm):
            return StepResult(loss, grad_norm, skipped=True, compiled_graphs=compiled)
        clip = clip_coefficient(grad_norm, plan.optimizer.gradient_clipping)
        for wait in hooks.before_update:
            wait()
        self.optimizer.update(lr, grad_scale=clip / scale)
        rigl = None
        if self.rigl is not None and self.device.type != "meta":
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
        batches = list(batches)
        count_tensor = torch.tensor(len(batches), device=self.device)
        batches = batches[: int(self.layout.dp.all_reduce_(count_tensor, op="min"))]
        losses = [loss for batch in self._forward_chunks(batches) for loss in batch.losses]
        total = (
            torch.stack(losses).double().sum() if losses else torch.zeros((), device=self.device)
        )
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
        head = self.plan.model.task_head
        assert head, "predict needs a task's head"
        outputs = [out for batch in self._forward_chunks(batches, True) for out in batch.outputs]
        if self.layout.pp.size == 1 or not batches:
            return outputs
        if not outputs:  # a stage before the last
            micro = batches[0].shape[0]
            shape = head.output_shape(micro, self.plan.sequence_length)
            outputs = [torch.zeros(shape, device=self.device) for _ in batches]
        return list(self.layout.pp.all_reduce_(torch.stack(outputs)))

    def _forward_chunks(self, batches: list[torch.Tensor], keep_outputs: bool = False):
        """Runs the forward phases and the head over as many micro-batches at a time as one
        pass holds; returns each chunk's :class:`Batch` with what its head emitted."""
        per_pass = self.memory.micro_batches_per_pass
        done = []
        for index, start in enumerate(range(0, len(batches), per_pass)):
            tokens = torch.stack(batches[start : start + per_pass]).to(self.device)
            batch = Batch.of(tokens, None, self.layout.cp, self.plan.model.task_head)
            batch.keep_outputs = keep_outputs
            phases = schedule.evaluation_phases(self.stage, range(len(tokens)), index)
            self._run_phases(phases, Step(self.context, batch))
            done.append(batch)
        self.compile_watch.since_last()  # an evaluation's own graphs are no step's
        return done

    def _run_phases(
        self,
        phases: list[Phase],
        run: Step,
        on_phase: Callable[[Phase | None], None] | None = None,
    ) -> None:
        """Runs each phase's body; with ``--prefetch`` or ``--overlap_communication``, first
        starts loading the next phase's weights, so that their copy (and with overlap, their
        all-gather) runs behind this phase's compute."""
        plan = self.plan
        overlap = plan.overlap_communication
        self.state.drop_prefetched()  # none left by a step that raised half-way
        self.link.start(phases)
        # The next phase that loads weights (a pipeline's moves load none).
        loading = [n for n, phase in enumerate(phases) if schedule.weights_loaded(phase)]
        following = dict(zip(loading, [*loading[1:], None], strict=True))
        current = "the phases"
        # A compiled part whose graph fails to compile runs eagerly, and the run goes on.
        compiling = eager_where_compiling_fails() if self.compiled else contextlib.nullcontext()
        self.compile_watch.failed_since_last()  # none left by a step that raised half-way
        try:
            with compiling:
                for n, phase in enumerate(phases):
                    current = _phase_name(phase)
                    if on_phase is not None:
                        on_phase(phase)
                    ahead = following.get(n, loading[0] if n < loading[0] else None)
                    later = []  # prefetches that would wait for the update: after this phase
                    if (plan.prefetch or overlap) and ahead is not None and n < ahead:
                        loads = schedule.weights_loaded(phases[ahead])
                        later = self.state.prefetch_unless_waiting(loads, self.dtype, overlap)
                    BODIES[phase.kind](run, phase)
                    for part, row in later:
                        self.state.prefetch_weights(part, row, self.dtype, gather=overlap)
            current = "the last transfers of the phases"
            run.in_flight.finish()  # the norm and the optimizer read every gradient
            self.link.finish()  # every boundary activation sent has arrived
        except CollectiveError as err:
            err.during(current)
            raise
        if on_phase is not None:
            on_phase(None)
        failed = self.compile_watch.failed_since_last() if self.compiled else 0
        if failed:  # a rank's own parts (a pipeline stage's): each rank says so
            rank = f"rank {self.layout.rank}: " if self.layout.world.size > 1 else ""
            reason = "Dynamo's warning says why"
            print(f"--compile: {rank}{failed} graph(s) could not compile ({reason}); going on")
        # Every prefetch is used by the phase it was issued for; none may outlive the schedule
        # (the optimizer is about to change the weights it copied).
        unused = self.state.drop_prefetched()
        assert unused == 0, f"{unused} prefetched part(s) never loaded"

    def _mean_over_replicas(self, total: torch.Tensor, count: int) -> float:
        """Mean of per-micro-batch losses over data replicas and sequence pieces (all pieces
        have the same number of tokens, so the mean of their means is the whole mean)."""
        both = torch.stack(
            [total.double(), torch.tensor(float(count), device=self.device).double()]
        )
        both = self.layout.dp_cp.all_reduce_(both)
        both = self.layout.pp.all_reduce_(both)  # from the last stage (others add zeros)
        total_all, count_all = _read(both[0]), _read(both[1])
        return total_all / count_all if count_all else float("nan")

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of host or device buffers held by this rank: weights, optimizer, grads,
        activations."""
        return self.state.nbytes()


def _phase_name(phase: Phase) -> str:
    """How a one-line error names a phase: "layer_forward phase of layer 2"."""
    layer = f" of layer {phase.layer}" if phase.kind in (LAYER_FORWARD, LAYER_BACKWARD) else ""
    return f"{phase.kind} phase{layer}"


def _read(scalar: torch.Tensor) -> float:
    """A scalar's value; a meta tensor (dry run) has none and reads as 0, so a dry-run step
    runs its optimizer phases as a real one would."""
    return 0.0 if scalar.is_meta else scalar.item()

"""The phased training step (DESIGN.md section 6): the engine and the body of every phase.

Three concerns, three places:

- *which* phases run, in which order, over which micro-batches: :mod:`execution.engine.schedule`
  (one or more passes over the step's micro-batches);
- *where* state lives and how it moves (loads, stores, gathers): :mod:`execution.engine.state`,
  placed by the plan the engine is given (:class:`~execution.engine.plan.MemoryPlan`);
- *what* each phase computes: the ``_phase_*`` methods below, which only call the model's
  stateless part templates on device tensors.

A phase loads one part's weights once and runs it for every micro-batch of its pass; the layers
never know they are phased (one template block is bound to each layer's weights in turn).
Each micro-batch's temporaries (its input copy, output, gradients) are dropped before the next
micro-batch runs: a loop variable would hold them through the next one's compute (a whole
layer's weight gradients in the backward), and the working set, which the planner measures
at one micro-batch per pass, would grow once a pass holds two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.func import functional_call

from config.schema import PretrainingConfig
from execution.engine import pipeline, schedule
from execution.engine.buffers import DTYPES, ActivationLayout, Place, flat_specs
from execution.engine.optimizer import adamw_, adamw_threaded_, clip_coefficient
from execution.engine.plan import PLACED_STATES, MemoryPlan
from execution.engine.recompute import KeptLayers, prepare_block
from execution.engine.schedule import Phase
from execution.engine.state import StateStore
from execution.parallel.launch import usable_cores
from execution.parallel.mesh import ParallelLayout, Pending
from execution.parallel.sharding import DECAYED_KINDS, init_part_shard, rts_axes
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, PARTS, GPTShapes
from modelling.layers import BlockSeeds, mix_seed

# Elements per chunk of a host AdamW update: 64 Ki float32 (256 KiB per tensor) stay in cache.
HOST_CHUNK_ELEMENTS = 1 << 16


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    skipped: bool  # the gradients were not finite, so no weight changed


class PhasedEngine:
    """Owns the buffers of one rank and runs training and evaluation steps phase by phase.

    Args:
        config: Validated run configuration.
        layout: This rank's parallel geometry (``ParallelLayout.single`` for one process).
        plan: Passes and placements (:mod:`execution.planning` chooses them).
        late_streams: On a CPU, copies on the side streams complete only when waited for
            (:class:`~execution.engine.streams.LateStream`: tests of the GPU's ordering).
    """

    def __init__(
        self,
        config: PretrainingConfig,
        layout: ParallelLayout,
        plan: MemoryPlan,
        late_streams: bool = False,
    ):
        self.config = config
        self.layout = layout
        self.device = layout.device
        self.shapes = GPTShapes.from_config(config.model, layout.tp1.size, layout.tp2.size)
        self.dtype = DTYPES[config.training.precision]
        self.gradient_accumulation = config.gradient_accumulation
        self.plan = plan
        with torch.device("meta"):  # one block serves every layer
            template = GPT(
                dataclasses.replace(self.shapes, layers=1), layout.tp1, layout.tp2, layout.cp
            )
        # Stateless templates: weights are bound per call with functional_call.
        self.templates = {
            EMBEDDING: template.embedding,
            LAYERS: template.layers[0],
            HEAD: template.head,
        }
        self.rts = rts_axes(layout)
        self.specs = flat_specs(self.shapes, {kind: axis.size for kind, axis in self.rts.items()})
        places = {s: Place.of(getattr(plan.placement, s), self.device) for s in PLACED_STATES}
        ex = config.execution
        # This rank's pipeline stage: its layers, and the passes it holds at once.
        self.stage = pipeline.Stage.of(config.stage_layers, layout.pp.rank)
        activations = ActivationLayout.of(
            dataclasses.replace(self.shapes, layers=self.stage.layers),
            plan.micro_batches_per_pass,
            ex.micro_batch_size,
            config.model.sequence_length // layout.cp.size,  # this rank's piece
            self.dtype,
            kept=plan.kept,
            in_flight=self.stage.in_flight(plan.passes),
        )
        rows = {part: self.stage.rows(part) for part in PARTS}
        self.state = StateStore(
            self.specs,
            self.stage.layers,
            self.rts,
            layout,
            places,
            activations,
            rows,
            self.stage.first_layer,
            late_streams=late_streams,
        )
        self.link = pipeline.Link(layout.pp, self.stage, activations, self.device)
        # What the layers keep for their backward (None: they recompute it in full).
        self.kept: KeptLayers | None = None
        if plan.recompute != "full":
            prepare_block(self.templates[LAYERS], plan.recompute)
            store = self.state
            kept = store.activations.kept
            block = self.templates[LAYERS]
            self.kept = KeptLayers(
                block, self.specs[LAYERS], kept, store.store_kept, store.load_kept
            )
        self.optimizer_steps = 0
        # Called before an optimizer update changes the buffers (a checkpoint writing from
        # host buffers waits there until it has read them).
        self.before_update: list[Callable[[], None]] = []
        if self.device.type != "meta":  # a dry run draws no weights
            self._initialise_weights(config.training.seed, config.model.init_std)
        # Called with each phase just before it starts (and its next phase's prefetch), and
        # with None after the last; the dry run measures per phase through it.
        self.on_phase: Callable[[Phase | None], None] | None = None
        self._bodies = {
            schedule.EMBEDDING_FORWARD: self._phase_embedding_forward,
            schedule.LAYER_FORWARD: self._phase_layer_forward,
            schedule.HEAD: self._phase_head,
            schedule.LAYER_BACKWARD: self._phase_layer_backward,
            schedule.EMBEDDING_BACKWARD: self._phase_embedding_backward,
            **dict.fromkeys(pipeline.MOVES, self._phase_move),
        }

    # ----------------------------------------------------------------- weights in and out

    def _initialise_weights(self, seed: int, init_std: float) -> None:
        """Draws only this rank's tensor-parallel shard of each part, keeps its RTS slice.

        The shard holds the same numbers as a slice of the full part (per-tile seeds), so every
        layout starts identically while no rank draws or holds a whole part.
        """
        i, j = self.layout.tp1.rank, self.layout.tp2.rank
        for part, row in self.state.part_rows():
            layer = self.state.logical_row(part, row)
            local = init_part_shard(self.shapes, part, layer, seed, init_std, i, j)
            self.state.write_shard(part, row, "weights", local)

    # ----------------------------------------------------------------- gradients

    def _accumulators(self, part: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Zeroed float32 gradient accumulators per kind, and named views into them."""
        flats, views = {}, {}
        for kind, spec in self.specs[part].items():
            flats[kind] = torch.zeros(spec.padded, dtype=torch.float32, device=self.device)
            views.update(spec.views(flats[kind]))
        return flats, views

    def _start_reduction(self, acc: dict[str, torch.Tensor]) -> dict[str, Callable]:
        """Starts the mean over data-parallel replicas of each kind's accumulator; each
        returned function waits for it and gives this rank's RTS slice.

        Each context rank's gradient is its sequence piece's share of the sum (the loss is
        pre-divided by cp), so the sum runs over dp x cp and the mean divides by dp only.
        """
        dp, replicas = self.layout.dp, self.layout.dp_cp
        overlap = self.config.execution.overlap_communication
        out = {}
        for kind, flat in acc.items():
            rts = self.rts[kind]
            if rts.size == replicas.size:  # the same replicas (tp1 or tp2 is 1): one collective
                pending = replicas.start_reduce_scatter(flat) if overlap else None
                pending = pending or Pending(replicas.reduce_scatter(flat))
                out[kind] = functools.partial(_mean_of, pending, dp.size)
            else:  # RTS group larger: all-reduce over the replicas, then keep our slice.
                pending = (
                    replicas.start_all_reduce_(flat)
                    if overlap
                    else Pending(replicas.all_reduce_(flat))
                )
                out[kind] = functools.partial(_mean_of, pending, dp.size, rts.size, rts.rank)
        return out

    def _finish_grads(
        self, part: str, row: int, acc: dict[str, torch.Tensor], phase: Phase, norm: bool = True
    ) -> None:
        """Reduces a phase's gradients and adds them to the step's; the last pass counts the
        norm (``norm``). The reduction is started now and completed by :class:`_InFlight`."""
        reductions = self._start_reduction(acc)

        def complete() -> None:
            shards = {kind: wait() for kind, wait in reductions.items()}
            total = self.state.accumulate_grads(part, row, shards, first=phase.first_pass)
            if norm and phase.last_pass:
                for shard in total.values():
                    self._grad_sumsq += shard.double().square().sum()

        self._in_flight.add(phase, complete)

    # ----------------------------------------------------------------- phase bodies

    def _seeds(self, step: int | None, layer: int, micro: int) -> BlockSeeds | None:
        """Dropout seeds of (step, layer, global micro-batch); None disables dropout.

        The same on every rank that runs the micro-batch: each draws its part of the whole
        tensor's masks (:mod:`modelling.layers`). The micro-batch index is global, so the masks
        depend on neither the data-parallel rank nor the number of passes.
        """
        if step is None or self.config.model.dropout_prob == 0.0:
            return None
        base = (
            self.config.training.seed,
            step,
            layer,
            self.layout.dp.rank * self.gradient_accumulation + micro,
        )
        return BlockSeeds(*(mix_seed(*base, kind) for kind in range(3)))

    def _embedding_seed(self, step: int | None, micro: int) -> int | None:
        seeds = self._seeds(step, -1, micro)
        return seeds and seeds.attention_residual

    def _entries(self, phase: Phase):
        """(micro-batch index in the step, activation buffer entry) for each of the phase's:
        a pipeline stage keeps each pass it holds at once in a slot of its own."""
        layout = self.state.activations.layout
        slot = phase.pass_index % layout.in_flight * layout.entries
        return ((m, slot + m - phase.micro_batches.start) for m in phase.micro_batches)

    def _layer_seeds(self, step: int | None, n: int, micro: int) -> BlockSeeds | None:
        """Dropout seeds of this stage's decoder layer ``n`` (seeded by its global index)."""
        return self._seeds(step, self.stage.first_layer + n, micro)

    @torch.no_grad()
    def _phase_embedding_forward(self, phase: Phase, batch: _Batch) -> None:
        weights = self.state.load_weights(EMBEDDING, 0, self.dtype)
        for m, e in self._entries(phase):
            y = functional_call(
                self.templates[EMBEDDING],
                weights,
                (batch.ids[m], self._embedding_seed(batch.step, m)),
            )
            self.state.store_x(0, e, y)
            del y  # not held through the next micro-batch (module docstring)

    @torch.no_grad()
    def _phase_layer_forward(self, phase: Phase, batch: _Batch) -> None:
        n = phase.layer
        if batch.training and self.kept is not None:  # keep the graph for the backward
            vectors = self.state.load_weight_vectors(LAYERS, n, self.dtype)
            for m, e in self._entries(phase):
                x, seeds = self.state.fetch_x(n, e), self._layer_seeds(batch.step, n, m)
                self.state.store_x(n + 1, e, self.kept.forward(n, e, vectors, x, seeds))
                del x
            return
        weights = self.state.load_weights(LAYERS, n, self.dtype)
        for m, e in self._entries(phase):
            x = self.state.fetch_x(n, e)
            seeds = self._layer_seeds(batch.step, n, m)
            y = functional_call(self.templates[LAYERS], weights, (x, seeds))
            self.state.store_x(n + 1, e, y)
            del x, y

    def _phase_head(self, phase: Phase, batch: _Batch) -> None:
        """Loss per micro-batch; when training, dx at the last boundary and the head's grads.

        The tied word embedding's gradient is added to the embedding's accumulators here and
        completed by the embedding backward phase.
        """
        L, backward = self.stage.layers, batch.training
        head = self.state.load_weights(HEAD, 0, self.dtype)
        word = self.state.load_weights(EMBEDDING, 0, self.dtype)["word.weight"]  # tied
        if backward:
            head = {k: v.detach().requires_grad_() for k, v in head.items()}
            word = word.detach().requires_grad_()
            head_acc, head_views = self._accumulators(HEAD)
            tied_acc, tied_views = self._accumulators(EMBEDDING)
            # Every micro-batch's loss is 1/GA of the step's (whatever the passes), and each
            # sequence piece's mean loss 1/cp of its micro-batch's.
            pieces = batch.micro_batches * self.layout.cp.size
            # Filled on the device: a tensor of host data would be a blocking copy (a sync).
            scale = torch.full((), self.config.training.loss_scaling / pieces, device=self.device)
        for m, e in self._entries(phase):
            x = self.state.fetch_x(L, e)
            with torch.set_grad_enabled(backward):
                x.requires_grad_(backward)
                loss = functional_call(
                    self.templates[HEAD], head, (x, word, batch.labels[m], self.shapes.vocab)
                )
            batch.losses.append(loss.detach())
            if backward:
                dx, dword, *grads = torch.autograd.grad(loss, [x, word, *head.values()], scale)
                self.state.store_dx(L, e, dx)
                tied_views["word.weight"].add_(dword)
                _add_grads(head_views, head, grads)
                del dx, dword, grads
            del x, loss
        if backward:
            self._finish_grads(HEAD, 0, head_acc, phase)
            # Not the last word on the embedding's grads (its backward phase adds its own), so
            # not counted in the norm yet.
            self._finish_grads(EMBEDDING, 0, tied_acc, phase, norm=False)

    def _phase_layer_backward(self, phase: Phase, batch: _Batch) -> None:
        """Recompute layer n for each micro-batch (what ``--recompute`` did not keep),
        backpropagate, reduce its grads."""
        n = phase.layer
        if self.kept is not None:
            vectors = self.state.load_weight_vectors(LAYERS, n, self.dtype)
            acc, views = self._accumulators(LAYERS)
            for _, e in self._entries(phase):
                dx = self.kept.backward(n, e, vectors, self.state.fetch_dx(n + 1, e), views)
                self.state.store_dx(n, e, dx)
                del dx
            self._finish_grads(LAYERS, n, acc, phase)
            return
        weights = self.state.load_weights(LAYERS, n, self.dtype)
        weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
        acc, views = self._accumulators(LAYERS)
        for m, e in self._entries(phase):
            x = self.state.fetch_x(n, e).requires_grad_()
            with torch.enable_grad():
                y = functional_call(
                    self.templates[LAYERS], weights, (x, self._layer_seeds(batch.step, n, m))
                )
            dx, *grads = torch.autograd.grad(
                y, [x, *weights.values()], self.state.fetch_dx(n + 1, e)
            )
            self.state.store_dx(n, e, dx)
            _add_grads(views, weights, grads)
            del x, y, dx, grads
        self._finish_grads(LAYERS, n, acc, phase)

    def _phase_embedding_backward(self, phase: Phase, batch: _Batch) -> None:
        """Embedding grads, added to the tied grad the head phase left in the accumulators."""
        weights = self.state.load_weights(EMBEDDING, 0, self.dtype)
        weights = {k: v.detach().requires_grad_() for k, v in weights.items()}
        acc, views = self._accumulators(EMBEDDING)
        for m, e in self._entries(phase):
            with torch.enable_grad():
                y = functional_call(
                    self.templates[EMBEDDING],
                    weights,
                    (batch.ids[m], self._embedding_seed(batch.step, m)),
                )
            grads = torch.autograd.grad(y, list(weights.values()), self.state.fetch_dx(0, e))
            _add_grads(views, weights, grads)
            del y, grads
        # With a pipeline the last stage holds the head's tied part: the sum is complete, and
        # counted in the norm, only after the two are added (pipeline.sum_tied_gradient).
        self._finish_grads(EMBEDDING, 0, acc, phase, norm=self.layout.embedding.size == 1)

    def _phase_move(self, phase: Phase, batch: _Batch) -> None:
        """A pipeline stage's boundary activations (or their gradients) in or out."""
        entries = [e for _, e in self._entries(phase)]
        pipeline.move(self.link, self.state, phase, range(entries[0], entries[-1] + 1))

    def _optimizer_phases(self, lr: float, grad_scale: float) -> None:
        """AdamW on every part's shards, one row of one kind at a time.

        Device-placed weights are updated on the device. Host-placed ones are updated where
        they live, by the host's cores (:func:`adamw_threaded_`, bitwise :func:`adamw_`):
        weights and moments never cross the host link, only gradients kept on the device do.
        """
        hyper = {
            "step": self.optimizer_steps,
            "lr": lr,
            "optim": self.config.training.optimizer,
            "grad_scale": grad_scale,
        }
        on_host = self.state.places["weights"].remote
        threads = _host_threads(self.layout.local_world_size)
        with ThreadPoolExecutor(threads) if on_host else contextlib.nullcontext() as pool:
            for part, row in self.state.part_rows():
                for kind in self.specs[part]:
                    decay = kind in DECAYED_KINDS
                    if not on_host:
                        w, g, m, v = self.state.load_optimizer_row(part, kind, row)
                        adamw_(w, g, m, v, weight_decay=decay, **hyper)
                        continue
                    tensors = self.state.host_optimizer_row(part, kind, row)
                    # Meta tensors (a dry run) hold nothing to compute: one chunk stands for all.
                    chunk = tensors[0].numel() if tensors[0].is_meta else HOST_CHUNK_ELEMENTS
                    adamw_threaded_(
                        *tensors,
                        pool=pool,
                        chunk_elements=max(chunk, 1),
                        weight_decay=decay,
                        **hyper,
                    )
                    self.state.refresh_weight_copy(part, kind, row)

    # ----------------------------------------------------------------- steps

    def train_step(self, tokens: torch.Tensor, step: int, lr: float) -> StepResult:
        """One optimizer step on this rank's micro-batches.

        Args:
            tokens: int64 ``[gradient_accumulation, micro_batch, sequence_length + 1]``.
            step: 0-based step index (seeds dropout).
            lr: Learning rate for this step.
        """
        expected = (
            self.gradient_accumulation,
            self.config.execution.micro_batch_size,
            self.config.model.sequence_length + 1,
        )
        assert tuple(tokens.shape) == expected, f"batch {tuple(tokens.shape)} != {expected}"
        batch = _Batch.of(tokens.to(self.device, non_blocking=True), step, self.layout.cp)
        if self.kept is not None:
            self.kept.drop()  # none left by a step that raised half-way
        self._grad_sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        phases = pipeline.training_phases(self.stage, self.gradient_accumulation, self.plan.passes)
        self._run_phases(phases, batch)
        if self.layout.embedding.size > 1:
            tied = pipeline.sum_tied_gradient(self.state, self.layout.embedding)
            if self.stage.is_first:  # counted once, by the first stage
                for shard in tied:
                    self._grad_sumsq += shard.double().square().sum()

        world = self.layout.world
        scale = self.config.training.loss_scaling
        grad_norm = math.sqrt(_read(world.all_reduce_(self._grad_sumsq))) / scale
        losses = batch.losses  # the last stage's (the head's)
        total = torch.stack(losses).float().sum() if losses else torch.zeros((), device=self.device)
        loss = self._mean_over_replicas(total, len(losses))
        if not math.isfinite(grad_norm):
            return StepResult(loss, grad_norm, skipped=True)
        self.optimizer_steps += 1
        clip = clip_coefficient(grad_norm, self.config.training.optimizer.gradient_clipping)
        for wait in self.before_update:
            wait()
        self._optimizer_phases(lr, grad_scale=clip / scale)
        return StepResult(loss, grad_norm, skipped=False)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss (no dropout, no update) over batches of ``[micro_batch, seq + 1]``.

        Runs the forward phases and the head over as many micro-batches at a time as one pass
        holds. Collective: every rank must call it. Replicas use as many batches as the one
        with the fewest, since each phase's weight all-gather needs every replica.
        """
        batches = list(batches)
        count_tensor = torch.tensor(len(batches), device=self.device)
        batches = batches[: int(self.layout.dp.all_reduce_(count_tensor, op="min"))]
        per_pass = self.plan.micro_batches_per_pass
        losses: list[torch.Tensor] = []
        for index, start in enumerate(range(0, len(batches), per_pass)):
            tokens = torch.stack(batches[start : start + per_pass]).to(self.device)
            batch = _Batch.of(tokens, None, self.layout.cp)
            group = range(len(tokens))
            self._run_phases(pipeline.evaluation_phases(self.stage, group, index), batch)
            losses.extend(batch.losses)
        total = (
            torch.stack(losses).double().sum() if losses else torch.zeros((), device=self.device)
        )
        return self._mean_over_replicas(total, len(losses))

    def _run_phases(self, phases: list[Phase], batch: _Batch) -> None:
        """Runs each phase's body; with ``--prefetch`` or ``--overlap_communication``, first
        starts loading the next phase's weights, so that their copy (and with overlap, their
        all-gather) runs behind this phase's compute."""
        ex = self.config.execution
        overlap = ex.overlap_communication
        self.state.drop_prefetched()  # none left by a step that raised half-way
        self._in_flight = _InFlight(overlap)
        # The next phase that loads weights (a pipeline's moves load none).
        self.link.start(phases)
        loading = [n for n, phase in enumerate(phases) if schedule.weights_loaded(phase)]
        following = dict(zip(loading, [*loading[1:], None], strict=True))
        for n, phase in enumerate(phases):
            if self.on_phase is not None:
                self.on_phase(phase)
            ahead = following.get(n, loading[0] if n < loading[0] else None)
            if (ex.prefetch or overlap) and ahead is not None and n < ahead:
                for part, row in schedule.weights_loaded(phases[ahead]):
                    self.state.prefetch_weights(part, row, self.dtype, gather=overlap)
            self._bodies[phase.kind](phase, batch)
        self._in_flight.finish()  # the norm and the optimizer read every gradient
        self.link.finish()  # every boundary activation sent has arrived
        if self.on_phase is not None:
            self.on_phase(None)
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


def _add_grads(views: dict[str, torch.Tensor], names, grads) -> None:
    """Adds one micro-batch's gradients to the accumulators (in a function: no loop variable
    holds the last of them through the next micro-batch)."""
    for name, g in zip(names, grads, strict=True):
        views[name].add_(g)


def _host_threads(processes_per_node: int) -> int:
    """This process's share of the cores it may run on, for host-side updates."""
    return max(1, usable_cores() // max(processes_per_node, 1))


def _read(scalar: torch.Tensor) -> float:
    """A scalar's value; a meta tensor (dry run) has none and reads as 0, so a dry-run step
    runs its optimizer phases as a real one would."""
    return 0.0 if scalar.is_meta else scalar.item()


def _mean_of(pending: Pending, dp: int, rts: int = 1, rank: int = 0) -> torch.Tensor:
    """A finished reduction's mean over ``dp`` replicas; after an all-reduce (the RTS group
    is larger than dp), only this rank's 1/``rts`` slice of it."""
    total = pending.wait()
    if rts > 1:
        total = total.view(rts, -1)[rank]
    return total / dp if dp > 1 else total


class _InFlight:
    """Gradient reductions started and not yet added to the step's gradients.

    With overlap, a phase's reductions are completed (waited for, accumulated, counted in the
    norm) when a later phase starts its own, so each runs behind the next phase's compute, and
    at most two phases' accumulators are alive. Completion follows issue order, so the norm
    and the accumulators add up in the same order as without overlap (bitwise the same).
    Without overlap each is completed at once.
    """

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._queue: list[tuple[Phase, Callable[[], None]]] = []

    def add(self, phase: Phase, complete: Callable[[], None]) -> None:
        if not self.overlap:
            complete()
            return
        while self._queue and self._queue[0][0] is not phase:
            self._queue.pop(0)[1]()
        self._queue.append((phase, complete))

    def finish(self) -> None:
        while self._queue:
            self._queue.pop(0)[1]()


@dataclass
class _Batch:
    """The tokens a step (or an evaluation chunk) works on, and the losses its head emits."""

    ids: torch.Tensor  # [micro_batches, micro_batch, seq]
    labels: torch.Tensor
    step: int | None  # None: evaluation (no dropout, no backward)
    losses: list[torch.Tensor]

    @classmethod
    def of(cls, tokens: torch.Tensor, step: int | None, cp) -> _Batch:
        """Inputs and labels of ``tokens`` (``[..., seq + 1]``), cut to sequence piece
        ``cp.rank`` of ``cp.size``: the tokens this rank holds outside attention."""
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

"""What ``--compile`` changes in a step's costs: each part's compiled graphs, priced against the
eager ops they replace.

A dry run meters the engine's step op by op on meta tensors, as eager runs it
(:mod:`execution.planning.step_meter`). A compiled part (:mod:`execution.engine.phases.compiled`)
runs the same matmuls and attention kernels, and in place of the ops between them the kernels
inductor fuses them into. So for each kind of call a phase body makes of a part (a forward
without autograd, a forward under it, its backward), this module captures the graphs
``torch.compile`` makes of the part (:func:`~execution.planning.fused_bytes.capture_regions`:
each region between two graph breaks, with the graphs inductor would compile of it), and
prices each region twice:

- eager: Dynamo's graph of the region run op by op on meta tensors under a
  :class:`~execution.planning.step_meter.StepMeter`, as the eager step runs it: attention as
  the device's fused kernel (on meta tensors torch would take the math path, whose bytes grow
  with the square of the sequence, and compiling would seem to save them);
- compiled: inductor's schedule of the region's graph
  (:func:`~execution.planning.fused_bytes.fused_cost`): its fused kernels' bytes, plus the
  extern kernels it calls (matmuls and attention, priced as before, and any fallback op by
  the bytes the scheduler gives it). Each attention call of the region must be one fused
  kernel here too.

The difference, in kernels and memory-bound bytes, is what one call changes; the dry run
replaces each phase's eager ops by it once per micro-batch (:func:`apply_changes`), after
checking that the phase ran them: compiling removes no more than the eager ops cost. What runs
between the regions (collectives, attention's seeded dropout, selective recompute's
checkpointed core) runs eagerly either way and is metered as it is. A run keeps attention's dropout in the block's graph as one
op (:mod:`~execution.engine.phases.seeded_attention`), which the capture breaks at instead:
the device runs the same kernels either way (inductor fuses nothing across an attention
kernel), and only the host's time differs, which the estimate leaves out. Not priced: a
task's head (it runs compiled, priced eager). What a kept forward saves is the plan's: where
the block is one graph, what its forward graph hands the backward
(:func:`compiled_kept_in_place`: inductor's partitioner recomputes cheap ops rather than save
them); elsewhere what eager saves.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from execution.engine.phases import schedule
from execution.engine.phases.compiled import COMPILED_PARTS
from execution.engine.phases.recompute import kernel_attention, meta_block
from execution.planning.estimate_checks import EstimateError
from execution.planning.fused_bytes import Region, capture_regions, fused_cost, graph_on_device
from execution.planning.op_costs import OpCosts
from execution.planning.step_meter import ATTENTION_KERNELS, StepMeter
from modelling.dropout import BlockSeeds
from modelling.gpt import EMBEDDING, HEAD, LAYERS, GPTShapes
from utils.torch_private import fake_tensors, storage_id

META = torch.device("meta")
_MATMUL_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")
_ATTENTION_OPS = tuple(str(op) for op in ATTENTION_KERNELS)


@dataclass(frozen=True)
class CostChange:
    """What compiling changes in one call of a part: the kernels and memory-bound bytes of
    the eager ops its compiled regions replace (``eager_*``), and of the kernels inductor
    makes of them (``compiled_*``). Each is a count of work, so >= 0: compiling removes no
    more than the eager ops cost (:func:`apply_changes` checks that a phase ran them)."""

    eager_kernels: int = 0
    eager_bytes: int = 0
    compiled_kernels: int = 0
    compiled_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise EstimateError(f"a compiled part's {name} is {value}, below 0")

    @property
    def kernels(self) -> int:
        return self.compiled_kernels - self.eager_kernels

    @property
    def memory_bytes(self) -> int:
        return self.compiled_bytes - self.eager_bytes

    def __add__(self, other: CostChange) -> CostChange:
        return CostChange(*(a + b for a, b in zip(_counts(self), _counts(other), strict=True)))


def _counts(change: CostChange) -> tuple[int, ...]:
    return tuple(getattr(change, f.name) for f in dataclasses.fields(change))


@dataclass(frozen=True)
class PartChanges:
    """One part's changes by kind of call (see the module docstring); ``inference`` only
    where it was asked for (a call without autograd is a capture of its own)."""

    forward: CostChange
    backward: CostChange
    inference: CostChange | None = None


def phase_changes(
    engine, kernel: str, device_type: str, memo: dict | None = None
) -> dict[str, CostChange]:
    """What compiling changes in one micro-batch of each kind of phase the engine's step runs,
    on ``device_type`` (whose inductor backend fuses), with attention as ``kernel``.

    ``memo``: a planning's, where each call of a part is priced once for everything that
    decides it (the shard's shapes and micro-batch, not the number of layers or passes).
    """
    plan, shapes = engine.plan, engine.shapes
    micro_batch, cp = plan.micro_batch_size, engine.layout.cp.size
    sequence = plan.sequence_length // cp
    dtype, dropout = engine.dtype, plan.model.dropout_prob > 0
    hidden = shapes.hidden // shapes.tp2
    x = torch.empty(micro_batch, sequence, hidden, dtype=dtype, device=META)
    selective = plan.memory.recompute == "selective"  # its block breaks at the core
    key = (dataclasses.replace(shapes, layers=1), micro_batch, sequence, cp, dtype)
    axes = engine.layout.axes()
    price = _PartPricer(kernel, device_type, dtype, axes, memo, (*key, selective))
    seeds = BlockSeeds(1, 2, 3).as_tensors() if dropout else None
    changes = {}  # of the parts that run compiled: not the embedding (compiled.py)
    if LAYERS in COMPILED_PARTS:
        kept = plan.memory.recompute != "full"
        layer = price(engine.templates[LAYERS], x, seeds, inference=not kept)
        changes[schedule.LAYER_FORWARD] = layer.forward if kept else layer.inference
        full = layer.forward + layer.backward
        changes[schedule.LAYER_BACKWARD] = layer.backward if kept else full
    if HEAD in COMPILED_PARTS and plan.model.task_head is None:
        labels = torch.zeros(micro_batch, sequence, dtype=torch.long, device=META)
        tied = plan.model.ties_word_embedding
        word = engine.templates[EMBEDDING].word.weight
        words = (torch.empty(word.shape, dtype=dtype, device=META),) if tied else ()
        # The head has no dropout, and runs whole whatever the blocks recompute.
        unrelated = {"dropout_prob": 0.0, "dropout_parity": False}
        key = (dataclasses.replace(key[0], **unrelated), *key[1:])
        price = _PartPricer(kernel, device_type, dtype, axes, memo, key)
        head = price(engine.templates[HEAD], x, *words, labels, shapes.vocab)
        kind = schedule.HEAD_PHASE if tied else schedule.UNTIED_HEAD
        changes[kind] = head.forward + head.backward
    return changes


def compiled_kept_in_place(
    shapes: GPTShapes, sequence: int, dtype: torch.dtype, kernel: str
) -> int | None:
    """Bytes a compiled decoder layer keeps in place for its backward per sequence of a
    micro-batch (``recompute none``, activations on the device): the storages of what the
    forward graph hands its backward (inductor's partitioner recomputes the cheap ops
    instead of saving them), but for the layer's inputs (its weights, and its input, a view
    of the x buffer). Linear in the micro-batch: each saved tensor has it as a dimension.

    None where the capture makes the block more than one graph (it breaks at dropout's seeded
    attention, which a run keeps as one op; at a collective of a tensor-parallel axis larger
    than one; the caller knows the context-parallel one): the eager measurement stands, what
    eager saves, at least what such a block keeps.
    """
    if shapes.dropout_prob or shapes.tp1 > 1 or shapes.tp2 > 1:  # known to break: no capture
        return None
    block = meta_block(dataclasses.replace(shapes, layers=1), kernel)
    x = torch.empty(1, sequence, shapes.hidden, dtype=dtype, device=META)
    module = _bound_copy(block, dtype, True)
    try:
        with torch.enable_grad():
            regions, _ = capture_regions(_call, module, _wanting_grad(x, True), None)
    except Exception:  # a capture that fails plans what eager keeps (more), never stops a run
        return None
    if len(regions) != 1:
        return None
    graphs = {graph.kind: graph.gm.graph for graph in regions[0].graphs}
    if set(graphs) != {"forward", "backward"}:
        return None
    # The backward's inputs: what the forward saved for it (named as in the forward), then
    # the gradients of the outputs.
    saved = {n.name for n in graphs["backward"].nodes if n.op == "placeholder"}
    saved = {name for name in saved if not name.startswith("tangents")}
    nodes = {n.name: n for n in graphs["forward"].nodes}
    if not saved <= nodes.keys():
        return None
    storages, held = set(), 0
    for name in sorted(saved):
        value = nodes[name].meta.get("val")
        if nodes[name].op == "placeholder" or not isinstance(value, torch.Tensor):
            continue
        if storage_id(value) not in storages:  # views of one storage keep it once
            storages.add(storage_id(value))
            held += value.untyped_storage().nbytes()
    return held


class _PartPricer:
    """Prices a part's calls (:func:`phase_changes`)."""

    def __init__(self, kernel: str, device_type: str, dtype: torch.dtype, axes, memo=None, key=()):
        self.kernel, self.device_type, self.dtype = kernel, device_type, dtype
        self.memo = memo if memo is not None else {}
        self.key = ("compiled part", kernel, device_type, *key)
        # The parts' mesh axes, each replaced in a copy by one on the same process group
        # (which cannot be copied) whose counts of collectives are its own: pricing is no
        # part of the step whose traffic the axes count.
        self.axes = {
            id(a): dataclasses.replace(a, calls=Counter(), sized_calls=Counter()) for a in axes
        }

    def __call__(self, template: torch.nn.Module, *inputs, inference=False) -> PartChanges:
        forward, backward = self._changes(template, inputs, grad=True)
        without_grad = self._changes(template, inputs, grad=False)[0] if inference else None
        return PartChanges(forward, backward, without_grad)

    def _changes(self, template, inputs, grad: bool) -> tuple[CostChange, CostChange]:
        """(forward or inference, backward) changes of one call, priced once per memo."""
        key = (*self.key, type(template).__name__, grad)
        if key not in self.memo:
            self.memo[key] = self._priced(template, inputs, grad)
        return self.memo[key]

    def _priced(self, template, inputs, grad: bool) -> tuple[CostChange, CostChange]:
        module = _bound_copy(template, self.dtype, grad, self.axes)
        # The capture makes each meta input a fake CPU tensor with its requires_grad.
        args = [_wanting_grad(value, grad) for value in inputs]
        with torch.set_grad_enabled(grad):
            regions, _ = capture_regions(_call, module, *args)
        before, after = CostChange(), CostChange()
        for region in regions:
            eager, attentions = self._eager(region, grad)
            for graph in region.graphs:
                compiled = self._compiled(graph, attentions)
                if graph.kind == "backward":
                    after += _change(compiled, eager[1])
                else:
                    before += _change(compiled, eager[0])
        return before, after

    def _compiled(self, graph, attentions: int) -> OpCosts:
        """Inductor's kernels of one of a region's graphs; ``attentions``: the attention
        calls the region makes, each of which the graph must run as one fused kernel."""
        try:
            cost = fused_cost(graph.gm, graph.example_inputs, self.device_type)
        except RuntimeError:
            if self.device_type == "cpu":
                raise
            # Without a GPU, inductor's CUDA lowering of a few ops (a scatter-add, as an
            # embedding's backward does) makes a real CUDA tensor: that graph takes the
            # CPU's fusion rules.
            cost = fused_cost(graph.gm, graph.example_inputs, "cpu")
        fused = sum(op.startswith(_ATTENTION_OPS) for op in cost.extern_ops)
        if fused != attentions:  # else one side prices attention as its unfused composite
            raise EstimateError(
                f"a compiled {graph.kind} graph runs {fused} fused attention kernels for the "
                f"{attentions} attention calls of its region"
            )
        costs = OpCosts(kernels=cost.kernels + len(cost.extern_ops), memory_bytes=cost.memory_bytes)
        for op, nbytes in zip(cost.extern_ops, cost.extern_bytes, strict=True):
            if not op.startswith(_MATMUL_OPS + _ATTENTION_OPS):
                costs.memory_bytes += nbytes  # a fallback op: memory-bound, as eager prices it
        return costs

    def _eager(self, region: Region, grad: bool) -> tuple[tuple[OpCosts, OpCosts], int]:
        """Dynamo's graph of the region run eagerly on meta tensors: (forward, backward), with
        its attention as the device's kernel, as the eager step runs it
        (:func:`~execution.engine.phases.recompute.kernel_attention`: on meta tensors torch
        would take the math path, whose bytes grow with the square of the sequence); and the
        number of attention calls."""
        inputs = [_meta_like(t) for t in region.example_inputs]
        gm = graph_on_device(region.gm, META)  # it makes its positions, say, on the CPU
        attentions = _as_kernel(gm, kernel_attention(self.kernel))
        with torch.set_grad_enabled(grad), StepMeter() as meter:
            outputs = gm(*inputs)
            forward = meter.costs.copy()
            outputs = [o for o in _tensors(outputs) if o.requires_grad]
            wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if grad and outputs and wanted:
                tangents = [torch.empty_like(o) for o in outputs]
                torch.autograd.grad(outputs, wanted, tangents, allow_unused=True)
        return (forward, meter.costs - forward), attentions


def _as_kernel(gm: torch.fx.GraphModule, attention) -> int:
    """Makes ``gm``'s calls of ``scaled_dot_product_attention`` call ``attention`` (the
    device's kernel on meta tensors; None: left as they are); returns how many it has."""
    calls = [
        node
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention
    ]
    if attention is not None and calls:
        for node in calls:
            node.target = attention
        gm.recompile()
    return len(calls)


def _call(module: torch.nn.Module, *args):
    return module(*args)


def _change(compiled: OpCosts, eager: OpCosts) -> CostChange:
    return CostChange(eager.kernels, eager.memory_bytes, compiled.kernels, compiled.memory_bytes)


def _bound_copy(
    template: torch.nn.Module, dtype: torch.dtype, grad: bool, axes: dict | None = None
) -> torch.nn.Module:
    """A copy of the (meta) template holding fake CPU parameters of ``dtype``: the part as one
    layer's weights bind it, called directly (``functional_call``'s context would move the
    graph breaks of the real run, which calls the compiled module inside it)."""
    module = copy.deepcopy(template, memo=dict(axes or {}))
    with fake_tensors(real_inputs=True):
        for name, parameter in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            fake = torch.empty(parameter.shape, dtype=dtype, device="cpu")
            module.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(fake, grad)
    return module


def _tensors(values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (tuple, list)):
        return [t for v in values for t in _tensors(v)]
    return []


def _wanting_grad(value, grad: bool):
    """A meta floating-point input that requires grad in a call under autograd."""
    if isinstance(value, torch.Tensor) and value.is_meta and value.is_floating_point():
        return value.detach().requires_grad_(grad)
    return value


def _meta_like(value):
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=META)
    return meta.requires_grad_(value.requires_grad)


def apply_changes(windows, changes: dict[str, CostChange]) -> None:
    """Replaces, in each phase window, the eager ops of each compiled call by its kernels,
    once per micro-batch its body ran.

    Raises:
        EstimateError: a window metered fewer kernels or memory-bound bytes than the eager
            ops its compiled calls replace: the change would remove work the phase never did.
    """
    for window in windows:
        change = changes.get(window.kind)
        if change is None or not window.micro_batches:
            continue
        costs, calls = window.costs, window.micro_batches
        for name, ran, replaced in (
            ("kernels", costs.kernels, change.eager_kernels),
            ("memory-bound bytes", costs.memory_bytes, change.eager_bytes),
        ):
            if ran < calls * replaced:
                raise EstimateError(
                    f"phase {window.kind!r}: compiling replaces {calls} x {replaced:,} eager "
                    f"{name}, but the phase ran {ran:,}"
                )
        window.costs = dataclasses.replace(
            costs,
            kernels=costs.kernels + calls * change.kernels,
            memory_bytes=costs.memory_bytes + calls * change.memory_bytes,
        )

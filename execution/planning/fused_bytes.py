"""What a ``torch.compile``d decoder block's memory-bound work costs: the bytes of the kernels
inductor fuses it into, read from inductor's own schedule of the block's graphs.

Run eagerly, every aten op is a kernel that reads its inputs from memory and writes its result
back (execution/planning/op_costs.py prices each so). Compiled, inductor fuses chains of
pointwise ops and reductions (a layer norm with the residual add before it, GELU with the bias
add) into one kernel that reads each input once and writes only what leaves it: an output, an
activation saved for the backward, the input of a matmul. So a compiled block is priced from
its compiled graphs, never by a discount on the eager bytes:

1. :func:`capture_regions` runs a function under ``torch.compile`` with a backend that
   builds its graphs as inductor does (dynamo, pre-grad passes, AOT autograd with inductor's
   decompositions, joint-graph passes and min-cut rematerialisation partitioner) and records
   each forward and backward graph with its example inputs; the graphs run op by op.
2. :func:`fused_cost` lowers one such graph with inductor and runs inductor's scheduler, which
   fuses, stopping before code generation (nothing is compiled, no kernel runs). Each kernel
   it would generate costs the bytes of the buffers it reads and writes, by the scheduler's
   own estimate (``get_read_write_buffers_sizes``: each buffer once, at most its size;
   buffers that live only inside a fused kernel not at all). Extern kernels (matmuls, SDPA,
   any op inductor falls back to) are left out, and named: the caller prices them as it
   prices eager ops.

The example inputs give only layouts: each becomes a fake tensor of its shape, strides and
dtype, so meta tensors at a full model's shapes serve, and a graph schedules in a fraction of
a second. ``device_type="cuda"`` applies the CUDA backend's (Triton's) lowering and fusion
rules, with neither a GPU nor Triton installed, on an H100's properties (split reductions
size themselves by its 132 SMs; utils/torch_private.py ``inductor_schedule`` says how);
``"cpu"`` the C++ backend's, whose fusions differ (it fuses loops of unlike shapes into one
kernel, splits no reductions).

Limits: shapes must be static (no symbolic sizes); a graph's device arguments (``aten.full``'s,
say) are all moved to the device priced, so a graph that mixes devices on purpose is priced
as if it did not; with ``max_autotune`` (off here) inductor could fuse pointwise work into a
matmul template's epilogue, which these bytes would still count as separate kernels.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate

from utils.torch_private import (
    EXTERN,
    GENERATED,
    eager_backward_compile,
    fake_tensors,
    inductor_capture_backend,
    inductor_schedule,
)

# The device each ``device_type`` is priced on (inductor wants a GPU's index).
_DEVICES = {"cpu": torch.device("cpu"), "cuda": torch.device("cuda", 0)}


@dataclass(frozen=True)
class FusedCost:
    """The kernels inductor generates for one graph, and their memory traffic.

    Attributes:
        kernels: Generated (fused) kernels; extern kernels not counted.
        memory_bytes: Bytes those kernels read and write.
        extern_ops: The aten op of each extern kernel, in schedule order: what the caller
            prices as eager ops (matmuls, attention, fallbacks).
        extern_bytes: The scheduler's estimate of the bytes each of them reads and writes.
    """

    kernels: int
    memory_bytes: int
    extern_ops: tuple[str, ...] = ()
    extern_bytes: tuple[int, ...] = ()


def fused_cost(gm: torch.fx.GraphModule, example_inputs: list, device_type: str) -> FusedCost:
    """The kernels inductor's scheduler fuses ``gm`` into on ``device_type`` ("cuda" or
    "cpu"), and the bytes they read and write (see the module docstring).

    ``gm`` is a graph as inductor's inner compiler receives it (a :class:`CapturedGraph`'s):
    an AOT-autograd forward or backward graph of aten ops after inductor's decompositions; a
    backward one is known by its ``tangents`` inputs, as AOT autograd names them. It is not
    changed. ``example_inputs``: its inputs, as meta, fake or real tensors (layouts only).
    """
    if device_type not in _DEVICES:
        raise ValueError(f"device_type must be one of {sorted(_DEVICES)}, not {device_type!r}")
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and not all(isinstance(n, int) for n in value.shape):
            raise ValueError(
                f"an input of symbolic shape {tuple(value.shape)}: shapes must be static"
            )
    device = _DEVICES[device_type]
    scheduled = inductor_schedule(
        graph_on_device(gm, device), list(example_inputs), device, is_backward=_is_backward(gm)
    )
    generated = [node for node in scheduled if node.kind == GENERATED]
    return FusedCost(
        kernels=len(generated),
        memory_bytes=sum(node.nbytes for node in generated),
        extern_ops=tuple(node.op for node in scheduled if node.kind == EXTERN),
        extern_bytes=tuple(node.nbytes for node in scheduled if node.kind == EXTERN),
    )


def graph_on_device(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of ``gm`` (inductor's passes rewrite the graph they get) whose ops' device
    arguments name ``device``: a graph captured on the meta device or a CPU creates its
    tensors (``aten.full``, ``aten.arange``) there."""
    copied = copy.deepcopy(gm)
    for node in copied.graph.nodes:
        node.args = map_aggregate(node.args, lambda v: device if isinstance(v, torch.device) else v)
        node.kwargs = map_aggregate(
            node.kwargs, lambda v: device if isinstance(v, torch.device) else v
        )
    copied.recompile()
    return copied


def _is_backward(gm: torch.fx.GraphModule) -> bool:
    return any(
        node.op == "placeholder" and node.name.startswith("tangents") for node in gm.graph.nodes
    )


FORWARD, BACKWARD, INFERENCE = "forward", "backward", "inference"


@dataclass(frozen=True)
class CapturedGraph:
    """One graph inductor's inner compiler would receive for a compiled function.

    Attributes:
        kind: ``forward`` and ``backward`` (when some input requires grad), else
            ``inference``.
        gm: The graph: aten ops after inductor's decompositions and joint-graph passes.
        example_inputs: Its inputs, as fake tensors (the layouts :func:`fused_cost` needs).
    """

    kind: str
    gm: torch.fx.GraphModule
    example_inputs: list


def capture_compiled_graphs(fn: Callable, *args: Any) -> tuple[list[CapturedGraph], Any]:
    """The graphs ``torch.compile(fn)`` with inductor would compile, and ``fn(*args)``'s
    result, computed by running those graphs op by op (a backward through it runs the
    recorded backward graph): :func:`capture_regions` of a function that must be one graph
    (``fullgraph``).

    The backward graph is built with the forward (AOT autograd would otherwise wait for the
    first backward), so the list is complete on return: the forward, then the backward where
    some input requires grad; else the one inference graph.
    """
    regions, result = capture_regions(fn, *args, fullgraph=True)
    return [graph for region in regions for graph in region.graphs], result


@dataclass(frozen=True)
class Region:
    """One graph Dynamo made of a function that breaks into several, and what inductor would
    compile of it.

    Attributes:
        gm: Dynamo's graph (torch-level calls, before decomposition): what runs eagerly
            without ``--compile``, its inputs the lifted parameters and the region's inputs.
        example_inputs: Its inputs, as fake tensors.
        graphs: The AOT graphs inductor would compile for it (:class:`CapturedGraph`).
    """

    gm: torch.fx.GraphModule
    example_inputs: list
    graphs: list[CapturedGraph]


def capture_regions(fn: Callable, *args: Any, fullgraph: bool = False) -> tuple[list[Region], Any]:
    """Each graph Dynamo makes of ``fn`` (``fullgraph``: one, or an error), with the graphs
    inductor would compile of it, and ``fn(*args)``'s result, computed by running those graphs
    op by op. What runs between the graphs (a collective, a seeded attention kernel: a graph
    break) runs eagerly.

    Each meta tensor among the arguments (in tuples, lists, named tuples and dicts too)
    becomes a fake CPU tensor of its layout: inductor's joint-graph passes take any meta value
    for one nobody needs and drop the ops that compute it. So the tensors ``fn`` reads must
    come in through its arguments (a module's weights as its parameters, or through
    ``torch.func.functional_call``), and the graphs are the CPU's (its SDPA kernel's op, say):
    autograd cannot record fake CUDA tensors without CUDA. Other tensors stay as they are (a
    seed whose value an eager part reads)."""
    regions: list[Region] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> None:
        regions[-1].graphs.append(CapturedGraph(kind, gm, example_inputs))

    capture = inductor_capture_backend(record)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        regions.append(Region(gm, list(example_inputs), []))
        return capture(gm, example_inputs)

    compiled = torch.compile(
        _fresh_function(fn), backend=backend, fullgraph=fullgraph, dynamic=False
    )
    with fake_tensors(real_inputs=True):
        args = _fake_cpu(args)
    # Each frame a graph break leaves (the callee's, a resumption's) has its own cache of
    # compiled graphs, which outlives the call: cleared before, so that no frame runs a graph
    # an earlier capture (or run) made instead of recording its own, and after, so that a
    # compiled run later in the process meets none of this capture's (nor its limit of them).
    torch.compiler.reset()
    try:
        # Outside the fake mode, which would make the seeds' values unreadable by the eager
        # parts (a fake tensor's ops go to its own mode in any case).
        with eager_backward_compile():
            result = compiled(*args)
    finally:
        torch.compiler.reset()
    return regions, result


def _fake_cpu(value: Any) -> Any:
    """``value`` with each meta tensor replaced by a CPU one of its layout and
    ``requires_grad`` (made under :func:`fake_tensors`: fake)."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            return value
        made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
        return made.requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_fake_cpu(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_cpu(v) for v in value)
    if isinstance(value, dict):
        return {key: _fake_cpu(v) for key, v in value.items()}
    return value


def _fresh_function(fn: Callable) -> Callable:
    """A function calling ``fn`` whose code object is new: dynamo keeps its compiled graphs
    on the code object, so a capture of a function captured before would otherwise find the
    earlier backend's entry, or pile one more onto it (and past dynamo's limit of them, run
    eagerly, recording nothing). The new code object, and its entries, go with the call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return types.FunctionType(
        call.__code__.replace(), call.__globals__, call.__name__, None, call.__closure__
    )

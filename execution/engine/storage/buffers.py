"""Buffers: where weights, gradients, AdamW state and activations live between phases.

Each part (embedding, the stack of decoder layers, head) stores, per parameter *kind* (see
:mod:`execution.parallel.sharding`), one flat float32 tensor with a row per layer: its tensor-parallel
shard packed and padded to a multiple of the kind's RTS group, of which this rank keeps its
1/group slice. Flat rows make a phase's load one copy and one all-gather, its gradient reduction
one reduce-scatter, and the optimizer update a handful of vectorised ops.

Each state lives in one :class:`Place`: host memory (pinned when computing on a GPU, by a
:class:`~execution.engine.storage.host_memory.HostMemory` that pins no more than it is asked for; a
phase copies what it needs) or the compute device (used in place). The byte counts the planner
works with come from the ``planned_nbytes`` functions here, which the constructors allocate by,
so a plan can never disagree with what is allocated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from execution.engine.storage.host_memory import HostMemory, host_memory_for
from execution.parallel.sharding import SHARD_KINDS, part_rules, shard_shapes
from modelling.gpt import LAYERS, PARTS, GPTShapes

# The compute dtype of each --precision.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The states of a part's parameters, each a [rows, shard] float32 tensor per kind. The weights
# travel with their AdamW moments (placed together; what a checkpoint saves), the gradient
# accumulators are placed on their own.
PART_STATES = ("weights", "grads", "exp_avg", "exp_avg_sq")
WEIGHT_STATES = ("weights", "exp_avg", "exp_avg_sq")
GRAD_STATES = ("grads",)


@dataclass(frozen=True)
class FlatSpec:
    """How the tensors of one (part, kind) pack into a flat vector and shard over RTS."""

    kind: str
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    rts_size: int

    @functools.cached_property  # read for every plan the planner weighs
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @functools.cached_property
    def padded(self) -> int:
        """Length of the packed vector, a multiple of the RTS group size."""
        return math.ceil(self.numel / self.rts_size) * self.rts_size

    @property
    def shard(self) -> int:
        """Elements this rank stores."""
        return self.padded // self.rts_size

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into a packed (gathered) vector."""
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            out[name] = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out

    def pack(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The packed, padded float32 vector of ``tensors`` (inverse of :meth:`views`)."""
        flat = torch.zeros(self.padded, dtype=torch.float32)
        for name, view in self.views(flat).items():
            view.copy_(tensors[name])
        return flat


def flat_specs(shapes: GPTShapes, rts: dict[str, int]) -> dict[str, dict[str, FlatSpec]]:
    """Per part, per kind present, the :class:`FlatSpec` of one rank's tensor-parallel shards.

    Args:
        shapes: Model sizes with the layout's tp1 and tp2.
        rts: RTS group size per kind (:func:`execution.parallel.sharding.rts_sizes`).
    """
    local_shapes = shard_shapes(shapes)
    specs: dict[str, dict[str, FlatSpec]] = {}
    for part in PARTS:
        specs[part] = {}
        rules = part_rules(part, shapes)
        for kind in SHARD_KINDS:
            names = tuple(n for n, rule in rules.items() if rule.kind == kind)
            if names:
                part_shapes = tuple(local_shapes[part][n] for n in names)
                specs[part][kind] = FlatSpec(kind, names, part_shapes, rts[kind])
    return specs


@dataclass(frozen=True)
class Place:
    """Where one state lives.

    Attributes:
        device: The compute device, or the CPU for host memory.
        remote: Host memory that phases copy from and store back to, even when the compute
            device is the CPU itself (so a CPU run measures and tests the same movement).
        memory: How host memory is allocated: page-locked when computing on a GPU, for
            asynchronous copies, and with no more bytes than asked for
            (:mod:`execution.engine.storage.host_memory`).
    """

    device: torch.device
    remote: bool = False
    memory: HostMemory = field(default_factory=HostMemory)

    @property
    def pin(self) -> bool:
        """Whether host memory here is page-locked."""
        return self.device.type == "cpu" and self.memory.pinned

    @classmethod
    def of(cls, where: str, compute: torch.device, memory: HostMemory | None = None) -> Place:
        """``device`` or ``host`` for a run computing on ``compute``; ``memory``: how host
        memory is allocated (default: :func:`~execution.engine.storage.host_memory.host_memory_for`).

        On the meta device (a dry run) host state is meta too: nothing is allocated anywhere.
        """
        if compute.type == "meta":
            return cls(compute, remote=where == "host")
        if where == "device":
            return cls(compute)
        return cls(torch.device("cpu"), True, memory or host_memory_for(compute))

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.memory.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)


def rows_of(part: str, layers: int) -> int:
    """Rows a part's buffers hold: one per decoder layer for the stack, else one."""
    return layers if part == LAYERS else 1


def weight_copy_dtype(weights_on_host: bool, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the weight copies kept beside host-placed masters; None when none are kept.

    Host weights cross the host link at every phase that loads them; a 16-bit copy, cast once
    per step after the update, halves those bytes for 2 bytes per parameter of host memory.
    Weights on the device are cast where they are, and a float32 run loads the masters.
    """
    return dtype if weights_on_host and dtype.itemsize < 4 else None


class PartBuffers:
    """Weights, gradients and AdamW moments of one part: ``[rows, shard]`` float32 per kind.

    With ``copy_dtype`` (see :func:`weight_copy_dtype`), ``weight_copies`` holds the weights
    cast to it, beside the masters and in the same place, for loads to copy instead.
    """

    @classmethod
    def planned_nbytes(cls, specs: dict[str, FlatSpec], rows: int, states=PART_STATES) -> int:
        """Bytes the given states of a part will take, known before allocating them."""
        return len(states) * rows * sum(spec.shard for spec in specs.values()) * 4

    @classmethod
    def planned_copy_nbytes(
        cls, specs: dict[str, FlatSpec], rows: int, copy_dtype: torch.dtype | None
    ) -> int:
        """Bytes of the weight copies of a part (0 when none are kept)."""
        if copy_dtype is None:
            return 0
        return rows * sum(spec.shard for spec in specs.values()) * copy_dtype.itemsize

    def __init__(
        self,
        specs: dict[str, FlatSpec],
        rows: int,
        places: dict[str, Place],
        copy_dtype: torch.dtype | None = None,
    ):
        self.specs = specs
        self.rows = rows
        self.places = places
        self.copy_dtype = copy_dtype
        # Each tensor is allocated at its final size in its place (on a GPU machine, pinned
        # without rounding): pinning afterwards would copy, doubling the peak.
        for state in PART_STATES:
            shape = {kind: (rows, spec.shard) for kind, spec in specs.items()}
            zeros = {kind: places[state].zeros(s, torch.float32) for kind, s in shape.items()}
            setattr(self, state, zeros)
        self.weight_copies: dict[str, torch.Tensor] = {}
        if copy_dtype is not None:
            for kind, spec in specs.items():
                copies = places["weights"].zeros((rows, spec.shard), copy_dtype)
                self.weight_copies[kind] = copies

    def nbytes(self) -> dict[str, int]:
        """Bytes held, per kind of state (for memory accounting), ``weight_copies`` included."""
        return {
            state: sum(t.numel() * t.element_size() for t in getattr(self, state).values())
            for state in (*PART_STATES, "weight_copies")
        }


@dataclass(frozen=True)
class ActivationLayout:
    """Sizes of the activation buffers of one rank.

    Attributes:
        layers: Decoder layers (x has ``layers + 1`` rows: the embedding's output and each
            layer's).
        entries: Micro-batches held at once (those of one pass).
        tokens: ``(micro_batch, sequence)`` of one micro-batch.
        hidden: Local width of the residual stream (``hidden / tp2``).
        tp1: x is identical across tp1, so each tp1 rank stores a 1/tp1 slice of every entry.
        dtype: Compute dtype.
        kept: Bytes each decoder layer keeps per entry for its backward (0: it recomputes
            everything from x; see :mod:`execution.engine.phases.recompute`).
        in_flight: Passes a pipeline stage holds at once (x and the kept activations have
            ``entries`` per pass in flight; dx only one pass's, as one backward runs at a time).
    """

    layers: int
    entries: int
    tokens: tuple[int, int]
    hidden: int
    tp1: int
    dtype: torch.dtype
    kept: int = 0
    in_flight: int = 1

    @classmethod
    def of(
        cls,
        shapes: GPTShapes,
        entries: int,
        micro_batch: int,
        sequence: int,
        dtype: torch.dtype,
        kept: int = 0,
        in_flight: int = 1,
    ) -> ActivationLayout:
        """The buffers of ``entries`` micro-batches of ``[micro_batch, sequence]`` tokens per
        pass, for ``in_flight`` passes."""
        hidden = shapes.hidden // shapes.tp2
        tokens = (micro_batch, sequence)
        return cls(
            layers=shapes.layers,
            entries=entries,
            tokens=tokens,
            hidden=hidden,
            tp1=shapes.tp1,
            dtype=dtype,
            kept=kept,
            in_flight=in_flight,
        )

    @property
    def held(self) -> int:
        """Entries of x and of the kept activations: ``entries`` per pass in flight."""
        return self.entries * self.in_flight

    @property
    def entry_numel(self) -> int:
        return math.prod(self.tokens) * self.hidden

    @property
    def x_shard(self) -> int:
        """Elements of one x entry this rank stores (the entry padded to a multiple of tp1)."""
        return math.ceil(self.entry_numel / self.tp1)

    def planned_nbytes(self) -> int:
        """Bytes x, dx and the kept activations will take, known before allocating them."""
        x = (self.layers + 1) * self.held * self.x_shard
        dx = 2 * self.entries * self.entry_numel
        return (x + dx) * self.dtype.itemsize + self.layers * self.held * self.kept


class ActivationBuffers:
    """x: (layers + 1) rows of this rank's tp1 slice of each entry; dx: two rows of entries;
    kept: per layer and entry, the bytes its forward keeps for its backward.

    Row 0 of x is the embedding's output, row n + 1 the output of decoder layer n. Backward
    only ever holds the gradient entering a layer and the one leaving it, so dx alternates
    between two rows: the gradient at layer boundary n lives in row ``n % 2``.
    """

    def __init__(self, layout: ActivationLayout, place: Place):
        self.layout = layout
        a = layout
        self.x = place.empty((a.layers + 1, a.held, a.x_shard), a.dtype)
        self.dx = place.empty((2, a.entries, *a.tokens, a.hidden), a.dtype)
        # On the device a layer keeps the very tensors its forward saved: copying them into a
        # buffer there would move as many bytes again as the block's own elementwise ops.
        self.keeps_in_place = not place.remote
        self.kept = place.empty(
            (a.layers, a.held, 0 if self.keeps_in_place else a.kept), torch.uint8
        )

    def nbytes(self) -> int:
        """Bytes of the buffers, with what the layers keep in place counted as planned."""
        held = sum(t.numel() * t.element_size() for t in (self.x, self.dx, self.kept))
        if self.keeps_in_place:
            held += self.layout.layers * self.layout.held * self.layout.kept
        return held

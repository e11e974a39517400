"""Remote buffers: where weights, gradients, AdamW state and activations live between phases.

Each part (embedding, the stack of decoder layers, head) stores, per parameter *kind* (see
:mod:`execution.sharding`), one flat float32 tensor with a row per layer: its tensor-parallel
shard packed and padded to a multiple of the kind's RTS group, of which this rank keeps its
1/group slice. Flat rows make a phase's load one copy and one all-gather, its gradient reduction
one reduce-scatter, and the optimizer update a handful of vectorised ops.

``remote`` placement keeps all of it in host memory (pinned when computing on a GPU) and every
phase copies what it needs; ``resident`` keeps the same buffers on the compute device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from execution.sharding import KINDS, MATRIX, PLAN, TP1_VECTOR, TP2_VECTOR
from modelling.gpt import LAYERS, PARTS
from modelling.parallel import Axis


@dataclass(frozen=True)
class FlatSpec:
    """How the tensors of one (part, kind) pack into a flat vector and shard over RTS."""

    kind: str
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    rts_size: int

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
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


def rts_axes(layout) -> dict[str, Axis]:
    """The RTS group of each kind: the replicas that hold identical copies of it."""
    return {MATRIX: layout.dp, TP2_VECTOR: layout.dp_tp1, TP1_VECTOR: layout.dp_tp2}


def flat_specs(local_shapes: dict[str, dict[str, torch.Size]], layout) -> dict[str, dict]:
    """Per part, per kind present, the :class:`FlatSpec` of this rank's tensor-parallel shards."""
    rts = rts_axes(layout)
    specs: dict[str, dict[str, FlatSpec]] = {}
    for part in PARTS:
        specs[part] = {}
        for kind in KINDS:
            names = tuple(n for n, rule in PLAN[part].items() if rule.kind == kind)
            if names:
                shapes = tuple(local_shapes[part][n] for n in names)
                specs[part][kind] = FlatSpec(kind, names, shapes, rts[kind].size)
    return specs


class PartBuffers:
    """Weights, gradients and AdamW moments of one part: ``[rows, shard]`` float32 per kind."""

    STATES = ("weights", "grads", "exp_avg", "exp_avg_sq")

    @classmethod
    def planned_nbytes(cls, specs: dict[str, FlatSpec], rows: int) -> int:
        """Bytes the buffers of a part will take, known before allocating them."""
        return len(cls.STATES) * rows * sum(spec.shard for spec in specs.values()) * 4

    def __init__(self, specs: dict[str, FlatSpec], rows: int, device: torch.device, pin: bool):
        self.specs = specs
        self.rows = rows

        def alloc() -> dict[str, torch.Tensor]:
            out = {}
            for kind, spec in specs.items():
                # Allocated pinned, not pinned afterwards: .pin_memory() would copy, doubling the peak.
                out[kind] = torch.zeros(rows, spec.shard, dtype=torch.float32, device=device,
                                        pin_memory=pin)  # fmt: skip
            return out

        self.weights = alloc()
        self.grads = alloc()
        self.exp_avg = alloc()
        self.exp_avg_sq = alloc()

    def nbytes(self) -> dict[str, int]:
        """Bytes held, per kind of state (for memory accounting)."""
        return {
            state: sum(t.numel() * t.element_size() for t in getattr(self, state).values())
            for state in self.STATES
        }


def part_rows(part: str, layers: int) -> int:
    return layers if part == LAYERS else 1


class ActivationBuffers:
    """x and dx: (layers + 1) rows x gradient-accumulation entries of ``[mbs, seq, h/tp2]``.

    Row 0 is the embedding's output, row n + 1 the output of decoder layer n; dx mirrors it
    with gradients, filled from the head (row ``layers``) down to the embedding (row 0).
    """

    @staticmethod
    def planned_nbytes(layers: int, entries: int, entry_shape: tuple[int, ...],
                       dtype: torch.dtype) -> int:  # fmt: skip
        """Bytes x and dx will take together, known before allocating them."""
        return 2 * math.prod((layers + 1, entries, *entry_shape)) * dtype.itemsize

    def __init__(self, layers: int, entries: int, entry_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, pin: bool):  # fmt: skip
        shape = (layers + 1, entries, *entry_shape)
        self.x = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        self.dx = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

    def nbytes(self) -> int:
        return 2 * self.x.numel() * self.x.element_size()

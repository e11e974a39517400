"""Which boxes of the logical tensors one rank holds, and where in its buffers they lie.

A rank's buffer row of one (part, kind) is its RTS slice of the packed tensor-parallel shards
(:mod:`execution.engine.storage.buffers`). Mapped back to a logical tensor, a flat slice of a row-major
shard is at most three rectangles (a partial first row, whole rows, a partial last row), and a
shard's rows and columns are runs of contiguous logical indices (the qkv heads are three runs,
a padded vocabulary ends in padding). So what a rank holds is a short list of rectangular
*chunks* of logical tensors, each a strided view of a buffer row: a checkpoint writes exactly
those, and a load reads into exactly those, with no tensor data crossing ranks and no logical
tensor assembled anywhere.

Every byte of a logical tensor is held by exactly one rank (RTS splits each tensor-parallel
shard over the replicas that would otherwise hold it twice), so the chunks of all ranks tile
each tensor once; the padding that packing and vocabulary rounding add is in no chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from execution.engine.storage.buffers import FlatSpec
from execution.parallel.index_runs import IndexRuns
from execution.parallel.sharding import shard_runs
from modelling.gpt import GPTShapes

# Chunks are split along their first dim to at most this many bytes, so that a write copies
# and a load reads at most this much at a time, whatever the layout that wrote them. Small
# enough for the allocator to reuse one chunk's memory for the next (larger copies are fresh
# mappings, and their page faults halved the write speed on CPU), large enough that 175B on
# 256 ranks has about a thousand chunks per rank.
MAX_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Chunk:
    """A box of one logical parameter held in one (part, kind) buffer row.

    Attributes:
        kind: The buffer (parameter kind) holding it.
        name: The parameter, named within its part.
        offsets, sizes: The box in the logical tensor.
        base: Element offset of its first element in the buffer row.
        stride: Elements between consecutive first-dim rows in the buffer row (2-D only).
    """

    kind: str
    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    base: int
    stride: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view(self, row: torch.Tensor) -> torch.Tensor:
        """The chunk as a (strided) view of a buffer row ``[shard]``."""
        strides = (self.stride, 1) if len(self.sizes) == 2 else (1,)
        return row.as_strided(self.sizes, strides, row.storage_offset() + self.base)


def _rectangles(lo: int, hi: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Elements [lo, hi) of a row-major [*, cols] tensor as (row0, row1, col0, col1) boxes."""
    boxes = []
    row, col = divmod(lo, cols)
    if col:  # a partial first row
        end = min(cols, col + hi - lo)
        boxes.append((row, row + 1, col, end))
        lo += end - col
        row += 1
    whole = (hi - lo) // cols
    if whole:
        boxes.append((row, row + whole, 0, cols))
        lo += whole * cols
        row += whole
    if lo < hi:  # a partial last row
        boxes.append((row, row + 1, 0, hi - lo))
    return boxes


def _split(chunk: Chunk, max_numel: int) -> list[Chunk]:
    """``chunk`` cut along its first dim into pieces of at most ``max_numel`` (one row at least)."""
    per_row = math.prod(chunk.sizes[1:])
    rows = max(1, max_numel // per_row)
    if chunk.sizes[0] <= rows:
        return [chunk]
    step = chunk.stride if len(chunk.sizes) == 2 else 1
    pieces = []
    for first in range(0, chunk.sizes[0], rows):
        n = min(rows, chunk.sizes[0] - first)
        pieces.append(
            Chunk(
                chunk.kind,
                chunk.name,
                (chunk.offsets[0] + first, *chunk.offsets[1:]),
                (n, *chunk.sizes[1:]),
                chunk.base + first * step,
                chunk.stride,
            )
        )
    return pieces


def held_chunks(
    part: str,
    specs: dict[str, FlatSpec],
    shapes: GPTShapes,
    tp_ranks: tuple[int, int],
    rts_ranks: dict[str, int],
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> list[Chunk]:
    """The chunks of a part's logical tensors that one rank's buffer rows hold (any row).

    Args:
        part: ``embedding``, ``layers`` or ``head`` (every decoder layer's row is alike).
        specs: The part's flat specs per kind (their RTS sizes give the slices).
        shapes: Model sizes with the layout's tp1 and tp2.
        tp_ranks: The rank's (tp1, tp2) coordinates.
        rts_ranks: The rank's coordinate in the RTS group of each kind.
        max_chunk_bytes: Chunks are cut to at most this many float32 bytes.
    """
    index = shard_runs(part, shapes, *tp_ranks)
    chunks: list[Chunk] = []
    for kind, spec in specs.items():
        start = rts_ranks[kind] * spec.shard
        end = start + spec.shard
        offset = 0  # of the tensor in the packed vector
        for name, shape in zip(spec.names, spec.shapes, strict=True):
            lo, hi = max(start, offset), min(end, offset + shape.numel())
            if lo < hi:
                local = (lo - offset, hi - offset, offset - start)
                chunks += _tensor_chunks(kind, name, shape, index[name], *local)
            offset += shape.numel()
    max_numel = max(1, max_chunk_bytes // 4)
    return [piece for chunk in chunks for piece in _split(chunk, max_numel)]


def _tensor_chunks(
    kind: str,
    name: str,
    shape: torch.Size,
    index: tuple[IndexRuns, ...],
    lo: int,
    hi: int,
    base: int,
) -> list[Chunk]:
    """The chunks of elements [lo, hi) of one local shard at ``base`` in the buffer row."""
    out = []
    if len(shape) == 1:
        for local, length, logical in index[0][lo:hi].located():
            out.append(Chunk(kind, name, (logical,), (length,), base + lo + local, 1))
        return out
    cols = shape[1]
    for row0, row1, col0, col1 in _rectangles(lo, hi, cols):
        for r, rn, r_logical in index[0][row0:row1].located():
            for c, cn, c_logical in index[1][col0:col1].located():
                first = base + (row0 + r) * cols + col0 + c
                out.append(Chunk(kind, name, (r_logical, c_logical), (rn, cn), first, cols))
    return out

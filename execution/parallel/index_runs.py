"""A shard's per-dim indices as runs of consecutive full-tensor indices.

Every sharding rule (:mod:`execution.parallel.sharding`) cuts ranges into blocks and joins a
few of them, so the indices a shard holds along a dim are a handful of runs whatever the
model's size. Kept as runs, a shard's shape, and what a checkpoint chunk of it covers, cost a
few numbers: a dry run or a plan never builds an index tensor as long as a weight (68 GB of
them for a 2^32-wide MLP). :meth:`IndexRuns.tensor` gives the index tensor itself, for the
code that gathers, scatters or draws a real shard's values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# The index of a padding position: a zero row that belongs to no full-tensor row.
PADDING = -1


@dataclass(frozen=True)
class IndexRuns:
    """A 1-D index, as (first, length) runs: ``first``, ``first + 1``, ... ``length`` times,
    or ``length`` padding positions where ``first`` is :data:`PADDING`. Built through
    :meth:`of`, so runs are never empty and adjacent runs that continue each other are one."""

    runs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, runs: Iterable[tuple[int, int]]) -> IndexRuns:
        merged: list[tuple[int, int]] = []
        for first, length in runs:
            if length <= 0:
                continue
            if merged:
                last, last_length = merged[-1]
                padding = first == PADDING and last == PADDING
                if padding or (PADDING not in (first, last) and last + last_length == first):
                    merged[-1] = (last, last_length + length)
                    continue
            merged.append((first, length))
        return cls(tuple(merged))

    @classmethod
    def arange(cls, n: int) -> IndexRuns:
        """``torch.arange(n)``."""
        return cls.of([(0, n)])

    @classmethod
    def padding(cls, n: int) -> IndexRuns:
        """``torch.full((n,), -1)``."""
        return cls.of([(PADDING, n)])

    @classmethod
    def cat(cls, pieces: Iterable[IndexRuns]) -> IndexRuns:
        """``torch.cat`` of the pieces."""
        return cls.of(run for piece in pieces for run in piece.runs)

    @property
    def size(self) -> int:
        """Positions in the index (``len``, which Python caps at 2^63 - 1)."""
        return sum(length for _, length in self.runs)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> IndexRuns:
        """Positions ``[start, stop)`` (a slice without a step), as a tensor slices them."""
        start, stop, step = key.indices(self.size)
        assert step == 1, "index runs take slices without a step"
        out, offset = [], 0
        for first, length in self.runs:
            lo, hi = max(start, offset), min(stop, offset + length)
            if lo < hi:
                out.append((first if first == PADDING else first + lo - offset, hi - lo))
            offset += length
        return IndexRuns.of(out)

    def chunk(self, parts: int, unit: int = 1) -> list[IndexRuns]:
        """``tensor.chunk(parts)``, of groups of ``unit`` positions (``unit``: the width of a
        row, for ``tensor.view(-1, unit).chunk(parts)``): each chunk but the last has
        ceil(groups / parts) groups, so there may be fewer than ``parts`` chunks; none is
        missing only where there are no positions (then ``parts`` empty ones)."""
        groups = self.size // unit
        if groups == 0:
            return [self[0:0]] * parts
        per_chunk = -(-groups // parts) * unit
        return [self[k : k + per_chunk] for k in range(0, groups * unit, per_chunk)]

    def split(self, sizes: Sequence[int]) -> list[IndexRuns]:
        """``tensor.split(sizes)`` (the sizes sum to its length)."""
        assert sum(sizes) == self.size, f"split sizes {list(sizes)} of {self.size} positions"
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [self[s : s + n] for s, n in zip(starts, sizes, strict=True)]

    def padded_from(self, position: int) -> IndexRuns:
        """The index with positions ``position`` and after as padding (``t[position:] = -1``)."""
        return IndexRuns.cat(
            [self[:position], IndexRuns.padding(self.size - min(position, self.size))]
        )

    def located(self) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive full-tensor indices as (position, length, first index);
        padding is in none."""
        out, offset = [], 0
        for first, length in self.runs:
            if first != PADDING:
                out.append((offset, length, first))
            offset += length
        return out

    def real(self) -> int:
        """Positions that are not padding."""
        return sum(length for first, length in self.runs if first != PADDING)

    def tensor(self) -> torch.Tensor:
        """The int64 index tensor."""
        pieces = [
            torch.full((length,), PADDING)
            if first == PADDING
            else torch.arange(first, first + length)
            for first, length in self.runs
        ]
        return torch.cat(pieces) if pieces else torch.arange(0)

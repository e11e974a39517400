"""The mesh's arithmetic: ranks, coordinates and the members of every group.

Rank ``r = (((d * pp + p) * cp + c) * tp1 + i) * tp2 + j`` where ``j`` indexes
tensor_parallel_2 (innermost), ``i`` tensor_parallel_1, ``c`` context_parallel, ``p`` the
pipeline stage and ``d`` data_parallel. The tensor axes stay innermost because they communicate
on every matmul; the context axis comes next because its all-to-alls run twice per layer and
micro-batch (so it should stay inside a node after the tensor axes, where bandwidth allows);
the pipeline axis sends one activation per micro-batch between neighbouring stages, so it may
cross nodes; data parallelism, which communicates once per phase, is outermost. With
``pp = cp = 1`` this is ``d * tp1 * tp2 + i * tp2 + j``.
:class:`MeshShape` is the one place that formula and the membership of every group live; a new
parallel axis joins there (its process groups: :mod:`execution.parallel.mesh`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config.schema import ExecutionConfig

# Mesh coordinates, outermost first: the order of the rank formula.
COORDS = "dpcij"
# Each group of the mesh, by the coordinates (d, p, c, i, j) that vary within it: a rank's
# group along an axis is every rank that shares its other coordinates. Weights are replicated
# over data and context parallelism alike, so both belong to every RTS group; pipeline stages
# hold different layers, so no replica group spans stages.
AXES: dict[str, tuple[str, ...]] = {
    "dp": ("d",),
    "pp": ("p",),  # the stages of one pipeline, in stage order
    # The first and the last stage, which both hold the tied word embedding and sum its
    # gradient (only stages 0 and pp - 1 of the pipeline axis; see MeshShape.members).
    "embedding": ("p",),
    "cp": ("c",),  # the pieces of one sequence
    "tp1": ("i",),
    "tp2": ("j",),
    "dp_cp": ("d", "c"),  # replicas of matrices: their RTS group and gradient sum
    # Replicas of tp2-sharded vectors (RTS group); dp x tp1 without a context axis.
    "dp_tp1": ("d", "c", "i"),
    # Replicas of tp1-sharded vectors (RTS group); dp x tp2 without a context axis.
    "dp_tp2": ("d", "c", "j"),
    "world": ("d", "p", "c", "i", "j"),
}


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the (dp, pp, cp, tp1, tp2) mesh: the rank formula and every group's members."""

    dp: int
    tp1: int
    tp2: int
    cp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, execution: ExecutionConfig) -> MeshShape:
        """The mesh the execution section of a config asks for."""
        ex = execution
        return cls(
            ex.data_parallel,
            ex.tensor_parallel_1,
            ex.tensor_parallel_2,
            ex.context_parallel,
            ex.pipeline_parallel,
        )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp1 * self.tp2

    def describe(self, split_only: bool = False) -> str:
        """The layout sentence: ``dp 2 x pp 1 x cp 1 x tp1 2 x tp2 1``, in the rank formula's
        order; ``split_only``: only the axes of more than one rank (``dp 2 x tp1 2``; empty
        for one process), where a short label tells layouts apart."""
        sizes = (("dp", self.dp), ("pp", self.pp), ("cp", self.cp))
        sizes += (("tp1", self.tp1), ("tp2", self.tp2))
        return " x ".join(f"{axis} {size}" for axis, size in sizes if size > 1 or not split_only)

    def rank(self, d: int, p: int, c: int, i: int, j: int) -> int:
        return (((d * self.pp + p) * self.cp + c) * self.tp1 + i) * self.tp2 + j

    def coords(self, rank: int) -> dict[str, int]:
        """``{"d": ..., "p": ..., "c": ..., "i": ..., "j": ...}`` of a global rank."""
        out = {}
        for c in reversed(COORDS):
            rank, out[c] = divmod(rank, self._extent()[c])
        return {c: out[c] for c in COORDS}

    def _extent(self) -> dict[str, int]:
        return {"d": self.dp, "p": self.pp, "c": self.cp, "i": self.tp1, "j": self.tp2}

    def size(self, axis: str) -> int:
        if axis == "embedding":
            return min(self.pp, 2)
        return math.prod(self._extent()[c] for c in AXES[axis])

    def _ranks(
        self, fixed: dict[str, int], varying: tuple[str, ...], stages=None
    ) -> tuple[int, ...]:
        """Ranks whose ``fixed`` coordinates are as given, over every value of ``varying``
        (ascending: the rank formula grows with d, then p, c, i, j); ``stages`` limits the
        values of p."""
        extent = self._extent()
        ranges = [range(extent[c]) if c in varying else [fixed[c]] for c in COORDS]
        if stages is not None and "p" in varying:
            ranges[COORDS.index("p")] = stages
        return tuple(self.rank(*coords) for coords in itertools.product(*ranges))

    def _embedding_stages(self) -> tuple[int, ...]:
        return tuple(sorted({0, self.pp - 1}))

    def members(self, axis: str, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s group along ``axis``, in group-rank order (ascending).

        A middle stage holds no embedding: its ``embedding`` group is itself alone."""
        coords = self.coords(rank)
        if axis == "embedding":
            if coords["p"] not in self._embedding_stages():
                return (rank,)
            return self._ranks(coords, AXES[axis], self._embedding_stages())
        return self._ranks(coords, AXES[axis])

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (of more than one rank for ``embedding``), each once, in
        the same order on every rank."""
        fixed = tuple(c for c in COORDS if c not in AXES[axis])
        firsts = self._ranks(dict.fromkeys(COORDS, 0), fixed)  # one rank of each group
        return sorted(self.members(axis, r) for r in firsts)

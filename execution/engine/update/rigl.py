"""RigL on the phased engine: the initial masks and every connectivity update, per logical
matrix across the shards that hold it.

A rank holds, of each decoder layer's sparse matrices, its tensor-parallel shards packed into
one row and of that row its RTS slice (:mod:`execution.engine.storage.masks`); every element of a
matrix is held by exactly one rank of the pipeline stage's tp1 x tp2 x (dp x cp) ranks. Each
element's logical position (which matrix, which index in it) is computed once, so a selection
ranks elements by their logical index, and :func:`~execution.parallel.selection.select_largest`
chooses over those ranks exactly what one process would choose: the masks do not depend on
the layout.

- Initial masks: each matrix keeps its highest random scores (drawn per position, the same in
  every layout, :func:`modelling.sparsity.mask_scores`), as many as its density says.
- An update (after the optimizer step of every ``every``-th step, until ``end``): of each
  matrix's ``n`` active weights, the ``n - k`` largest |w| stay (k = drop fraction x n), and of
  all the others (those just dropped included) the ``k`` with the largest |dense gradient| are
  grown. The dense gradient is the step's own, still in the gradient buffers (the optimizer
  applies it masked, and leaves it there). Grown weights start at zero with zero AdamW moments.
"""

from __future__ import annotations

import math

import torch

from execution.engine.storage.masks import SPARSE_KIND, SPARSE_PART, SparseMasks
from execution.engine.storage.state import StateStore
from execution.parallel.mesh import ParallelLayout
from execution.parallel.selection import select_largest, sort_keys
from execution.parallel.sharding import shard_index
from modelling.gpt import LAYERS, GPTShapes, part_inits, qualified_name
from modelling.sparsity import SparsitySchedule, active_counts, mask_scores

# Per matrix of a layer, what the statistics count: active weights, dropped, grown, and the
# sum of the grown weights' |dense gradient|.
ACTIVE, DROPPED, GROWN, GROWN_GRAD = range(4)


class RigL:
    """The masks of one rank's decoder layers and their updates.

    Args:
        schedule: Sparsity, distribution and when the connectivity changes.
        state: The rank's buffers (with masks).
        shapes: Model shapes with the layout's tp1 and tp2.
        layout: This rank's parallel geometry.
        first_layer: Global index of this rank's first decoder layer.
    """

    def __init__(
        self,
        schedule: SparsitySchedule,
        state: StateStore,
        shapes: GPTShapes,
        layout: ParallelLayout,
        first_layer: int,
    ):
        assert state.masks is not None, "a sparse run keeps masks in its store"
        self.schedule, self.state, self.shapes = schedule, state, shapes
        self.masks: SparseMasks = state.masks
        self.layout, self.first_layer = layout, first_layer
        self.device = layout.device
        self.spec = state.specs[SPARSE_PART][SPARSE_KIND]
        # The product of these holds each element of a stage's matrices exactly once.
        self.axes = (layout.tp1, layout.tp2, layout.dp_cp)
        wanted = active_counts(shapes, schedule.sparsity, schedule.distribution)
        self.counts = torch.tensor([wanted[n] for n in self.spec.names], device=self.device)
        inits = part_inits(shapes, LAYERS)
        numel = [math.prod(inits[n].shape) for n in self.spec.names]
        self.numel = torch.tensor(numel, dtype=torch.float64, device=self.device)
        self.matrix, self.index = self._logical_positions()
        # The same, where the masks live (host memory for host-placed weights): measured there.
        self.matrix_at_masks = self.matrix.to(self.masks.rows.device)

    def _logical_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each element of this rank's mask row: its matrix (position in the spec's names,
        -1 for padding) and its row-major index in that logical matrix."""
        index = shard_index(LAYERS, self.shapes, self.layout.tp1.rank, self.layout.tp2.rank)
        inits = part_inits(self.shapes, LAYERS)
        matrix = torch.full((self.spec.padded,), -1, dtype=torch.int64)
        logical = torch.zeros(self.spec.padded, dtype=torch.int64)
        offset = 0
        for m, name in enumerate(self.spec.names):
            rows, cols = index[name]
            flat = (rows[:, None] * inits[name].shape[1] + cols[None, :]).reshape(-1)
            real = ((rows[:, None] >= 0) & (cols[None, :] >= 0)).reshape(-1)
            matrix[offset : offset + len(flat)] = torch.where(real, m, -1)
            logical[offset : offset + len(flat)] = flat
            offset += len(flat)
        rts = self.state.rts[SPARSE_KIND]
        mine = slice(rts.rank * self.spec.shard, (rts.rank + 1) * self.spec.shard)
        return matrix[mine].to(self.device), logical[mine].to(self.device)

    # ---------------------------------------------------------------- masks from outside a step

    def initialise(self, seed: int) -> None:
        """Draws every layer's initial masks and zeroes the weights outside them."""
        i, j = self.layout.tp1.rank, self.layout.tp2.rank
        positions = shard_index(LAYERS, self.shapes, i, j)
        rts = self.state.rts[SPARSE_KIND]
        for row in range(self.masks.rows.shape[0]):
            scores = mask_scores(self.shapes, self.first_layer + row, seed, positions)
            mine = self.spec.pack(scores).view(rts.size, -1)[rts.rank].to(self.device)
            keep = select_largest(sort_keys(mine, self.index), self.matrix, self.counts, self.axes)
            self.masks.rows[row].copy_(keep)
        self.apply()

    def apply(self) -> None:
        """Zeroes the weights outside the masks (after the masks or the weights were written
        from outside a step: initialisation, a checkpoint, imported weights)."""
        buffers = self.state.parts[SPARSE_PART]
        for row in range(self.masks.rows.shape[0]):
            mask = self.masks.row(row)
            buffers.weights[SPARSE_KIND][row].masked_fill_(~mask, 0.0)
            self.state.refresh_weight_copy(SPARSE_PART, SPARSE_KIND, row, slice(None))
        self.state.drop_prefetched()

    # ---------------------------------------------------------------- the update

    def update(self, step: int, loss_scaling: float) -> dict[str, float] | None:
        """After optimizer step ``step`` (1-based): drop and grow where the schedule says so.

        Collective over every rank. Returns the update's statistics (:meth:`summary`), or
        None when the connectivity does not change at this step.
        """
        if not self.schedule.updates_at(step):
            return None
        fraction = self.schedule.drop_fraction_at(step)
        stats = self._stats_tensor()
        for row in range(self.masks.rows.shape[0]):
            counts = self._update_row(row, fraction)
            counts[:, GROWN_GRAD] /= loss_scaling
            stats[self.first_layer + row] = counts
        summary = self.summary(self._sum_over_model(stats))
        summary["rigl/drop_fraction"] = fraction
        return summary

    def _update_row(self, row: int, fraction: float) -> torch.Tensor:
        """Drops and grows in one layer; returns its statistics per matrix (this rank's)."""
        state, place = self.state, self.state.places["weights"]
        weights, grads, exp_avg, exp_avg_sq = state.load_optimizer_row(LAYERS, SPARSE_KIND, row)
        old = self.masks.device_row(row)
        active = self._count(old)
        for axis in self.axes:
            if axis.size > 1:
                axis.all_reduce_(active)
        drop = torch.floor(active.double() * fraction).long()
        candidates = torch.where(old, self.matrix, -1)
        keys = sort_keys(weights.abs(), self.index)
        keep = select_largest(keys, candidates, active - drop, self.axes)
        keys = sort_keys(grads.abs(), self.index)
        new = keep | select_largest(keys, torch.where(keep, -1, self.matrix), drop, self.axes)
        grown, dropped = new & ~old, old & ~new
        weights.masked_fill_(~new, 0.0)  # the dropped; the grown are already zero
        exp_avg.masked_fill_(grown, 0.0)
        exp_avg_sq.masked_fill_(grown, 0.0)
        buffers = state.parts[LAYERS]
        for name, value in (("weights", weights), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            state.mover.store(getattr(buffers, name)[SPARSE_KIND][row], value, place)
        state.mover.store(self.masks.rows[row], new, place)
        state.refresh_weight_copy(LAYERS, SPARSE_KIND, row, slice(None))
        counts = torch.zeros(len(self.spec.names), 4, dtype=torch.float64, device=self.device)
        counts[:, ACTIVE] = self._count(new).double()
        counts[:, DROPPED] = self._count(dropped).double()
        counts[:, GROWN] = self._count(grown).double()
        counts[:, GROWN_GRAD] = self._count(grown, grads.abs().double())
        return counts

    def _count(self, where: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per matrix, how many elements ``where`` marks (or the sum of ``weights`` there)."""
        return _count_per_matrix(self.matrix, where, len(self.spec.names), weights)

    def logical_masks(self) -> dict[str, torch.Tensor]:
        """Every mask this stage holds as a whole logical bool tensor, named as in
        :class:`~modelling.gpt.GPT` (``layers.3.attn.qkv.weight``). Collective over the
        stage's ranks; for tests and inspection (it holds whole matrices)."""
        inits = part_inits(self.shapes, LAYERS)
        out = {}
        for row in range(self.masks.rows.shape[0]):
            mask = self.masks.device_row(row)
            for m, name in enumerate(self.spec.names):
                mine = self.matrix == m
                whole = torch.zeros(math.prod(inits[name].shape), device=self.device)
                whole[self.index[mine]] = mask[mine].float()
                for axis in self.axes:
                    if axis.size > 1:
                        axis.all_reduce_(whole)
                layer = self.first_layer + row
                out[qualified_name(LAYERS, layer, name)] = whole.view(inits[name].shape) > 0
        return out

    # ---------------------------------------------------------------- what is logged

    def measure(self) -> dict[str, float]:
        """The masks' density per layer and over the model, and how many weights outside
        them are not zero (0 unless something wrote them). Collective over every rank."""
        stats = self._stats_tensor()
        buffers = self.state.parts[SPARSE_PART]
        outside = torch.zeros(len(self.spec.names), dtype=torch.float64, device=self.device)
        # Counted where the buffers live (host weights are not copied to the device for it);
        # only the counts move.
        matrix = self.matrix_at_masks
        for row in range(self.masks.rows.shape[0]):
            mask, weights = self.masks.row(row), buffers.weights[SPARSE_KIND][row]
            counts = _count_per_matrix(matrix, mask, len(self.spec.names))
            stats[self.first_layer + row, :, ACTIVE] = counts.to(self.device).double()
            stray = _count_per_matrix(matrix, ~mask & (weights != 0), len(self.spec.names))
            outside += stray.to(self.device).double()
        stats[0, :, DROPPED] += outside  # not a drop: a slot to sum it in with the rest
        stats = self._sum_over_model(stats)
        out = {k: v for k, v in self.summary(stats).items() if "density" in k or k == "rigl/active"}
        out["rigl/outside_mask_nonzero"] = stats[0, :, DROPPED].sum().item()
        return out

    def _stats_tensor(self) -> torch.Tensor:
        layers = self.shapes.layers
        return torch.zeros(layers, len(self.spec.names), 4, dtype=torch.float64, device=self.device)

    def _sum_over_model(self, stats: torch.Tensor) -> torch.Tensor:
        """Sums statistics over the ranks of a stage, then over the stages."""
        for axis in (*self.axes, self.layout.pp):
            if axis.size > 1:
                axis.all_reduce_(stats)
        return stats

    def summary(self, stats: torch.Tensor) -> dict[str, float]:
        """Metrics from ``[layers, matrices, 4]`` statistics summed over the model."""
        per_layer = stats.sum(1)
        out = {
            "rigl/density": (per_layer[:, ACTIVE].sum() / (self.numel.sum() * len(stats))).item(),
            "rigl/active": per_layer[:, ACTIVE].sum().item(),
            "rigl/dropped": per_layer[:, DROPPED].sum().item(),
            "rigl/grown": per_layer[:, GROWN].sum().item(),
        }
        grown = per_layer[:, GROWN].sum()
        out["rigl/grown_grad_mean"] = (per_layer[:, GROWN_GRAD].sum() / grown.clamp(min=1)).item()
        for n in range(len(stats)):
            out[f"rigl/density_layer{n}"] = (per_layer[n, ACTIVE] / self.numel.sum()).item()
            out[f"rigl/dropped_layer{n}"] = per_layer[n, DROPPED].item()
            out[f"rigl/grown_layer{n}"] = per_layer[n, GROWN].item()
        return out


def _count_per_matrix(
    matrix: torch.Tensor, where: torch.Tensor, matrices: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per matrix (``matrix``: each element's, -1 for padding), how many elements ``where``
    marks, or the sum of ``weights`` there."""
    chosen = where & (matrix >= 0)
    values = None if weights is None else weights[chosen]
    return torch.bincount(matrix[chosen], values, minlength=matrices)

"""The model math of RigL (Evci et al. 2020, "Rigging the Lottery"): which weights are sparse,
how dense each of them is, how much of it changes at each update, and the random scores the
initial masks are drawn from. Communication and buffers are :mod:`execution.engine.update.rigl`'s.

Only the decoder layers' matrices are sparse (qkv, out, fc, proj; with SwiGLU qkv, out, gate_up,
down); embeddings, biases and norms stay dense, as in the paper's transformer experiments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelling.gpt import LAYERS, GPTShapes, init_part_region, part_inits
from modelling.tiles import tile_seed

SPARSE_WEIGHTS = ("attn.qkv.weight", "attn.out.weight", "mlp.fc.weight", "mlp.proj.weight")
# Every matrix a decoder layer of either architecture may hold (GPT-3's, then SwiGLU's).
LAYER_MATRICES = (*SPARSE_WEIGHTS, "mlp.gate_up.weight", "mlp.down.weight")
# Ours that stack several matrices by rows, each a matrix of its own to ERK: SwiGLU's gate and
# up projections (the MLP's three matrices with down).
STACKED_MATRICES = {"mlp.gate_up.weight": 2}


def sparse_weights(shapes: GPTShapes) -> tuple[str, ...]:
    """The sparse matrices of a decoder layer of ``shapes``, in the model's order:
    :data:`SPARSE_WEIGHTS` for GPT-3."""
    return tuple(name for name, init in part_inits(shapes, LAYERS).items() if len(init.shape) == 2)


def densities(shapes: GPTShapes, sparsity: float, distribution: str) -> dict[str, float]:
    """Fraction of each sparse matrix kept, so that over all sparse weights it is 1 - sparsity.

    ``uniform`` keeps 1 - sparsity of every matrix. ``erk`` (Erdos-Renyi-Kernel) keeps a
    fraction proportional to (rows + columns) / (rows x columns): a matrix's share of the
    connections grows with its sides, not its area. Where that fraction would exceed 1 the
    matrix is made dense and the others share what is left, until none exceeds 1 (as the
    google-research/rigl implementation does). Every decoder layer has the same shapes, so one
    layer's densities are every layer's. SwiGLU's gate and up, stacked in one of ours, are two
    matrices to ERK (:data:`STACKED_MATRICES`), of one density since they have one shape.
    """
    names = sparse_weights(shapes)
    sizes = {name: part_inits(shapes, LAYERS)[name].shape for name in names}
    if distribution == "uniform" or sparsity == 0.0:
        return dict.fromkeys(names, 1.0 - sparsity)
    assert distribution == "erk", distribution
    numel = {name: math.prod(shape) for name, shape in sizes.items()}
    raw = {}
    for name, (rows, columns) in sizes.items():
        rows //= STACKED_MATRICES.get(name, 1)  # one of the stacked matrices
        raw[name] = (rows + columns) / (rows * columns)
    dense: set[str] = set()
    while True:
        sparse = [n for n in names if n not in dense]
        # Weights the sparse matrices share: the budget less what the dense ones take.
        budget = (1.0 - sparsity) * sum(numel.values()) - sum(numel[n] for n in dense)
        scale = budget / sum(raw[n] * numel[n] for n in sparse)
        highest = max(raw[n] for n in sparse)
        if highest * scale <= 1.0:
            break
        dense.update(n for n in sparse if raw[n] == highest)
    return {n: 1.0 if n in dense else raw[n] * scale for n in names}


def active_counts(shapes: GPTShapes, sparsity: float, distribution: str) -> dict[str, int]:
    """Weights each sparse matrix of a layer keeps: its density times its size, rounded."""
    inits = part_inits(shapes, LAYERS)
    return {
        name: round(density * math.prod(inits[name].shape))
        for name, density in densities(shapes, sparsity, distribution).items()
    }


def highest_sparsity_keeping_every_matrix(shapes: GPTShapes, distribution: str) -> float:
    """The highest sparsity (to float precision) at which :func:`active_counts` keeps at least
    one weight of every sparse matrix; a higher one leaves some matrix without any."""
    keeps, empties = 0.0, 1.0
    while True:
        middle = (keeps + empties) / 2
        if middle in (keeps, empties):
            return keeps
        if min(active_counts(shapes, middle, distribution).values()) >= 1:
            keeps = middle
        else:
            empties = middle


def update_end(total_steps: int, end_fraction: float) -> int:
    """The step from which the connectivity no longer changes."""
    return math.floor(end_fraction * total_steps)


def drop_fraction(step: int, initial: float, end: int) -> float:
    """RigL's cosine-decayed drop fraction at optimizer step ``step`` (1-based): ``initial``
    at the start, 0 at ``end`` and after."""
    if step >= end:
        return 0.0
    return initial * 0.5 * (1.0 + math.cos(math.pi * step / end))


def is_update_step(step: int, every: int, end: int) -> bool:
    """Whether the connectivity changes after optimizer step ``step`` (1-based)."""
    return step % every == 0 and step < end


def mask_scores(
    shapes: GPTShapes, layer: int, seed: int, positions: dict[str, tuple[torch.Tensor, ...]]
) -> dict[str, torch.Tensor]:
    """Random scores of the sparse matrices of decoder layer ``layer`` at ``positions`` (per-dim
    full-tensor indices, -1: padding): a matrix's initial mask keeps its highest scores.

    Drawn per fixed tile from seeds of their own (:func:`modelling.gpt.init_part_region`), so
    a score depends on the run's seed, the layer, the matrix and the position only: every
    layout's shards hold the scores of the single process.
    """
    mask_seed = tile_seed("rigl-mask", seed)
    wanted = {name: positions[name] for name in sparse_weights(shapes)}
    return init_part_region(shapes, LAYERS, layer, mask_seed, 1.0, wanted)


@dataclass(frozen=True)
class SparsitySchedule:
    """What RigL keeps and when it changes it, for one run.

    Attributes:
        sparsity: Fraction of the sparse weights that are zero.
        distribution: ``erk`` or ``uniform`` (:func:`densities`).
        every: Optimizer steps between connectivity updates (delta T).
        drop_fraction: Fraction of each matrix's active weights replaced at the first update.
        end: The step from which the connectivity no longer changes.
    """

    sparsity: float
    distribution: str
    every: int
    drop_fraction: float
    end: int

    @classmethod
    def of(cls, rigl, total_steps: int) -> SparsitySchedule | None:
        """The schedule of a run's ``--sparsity`` flags (a ``RigLConfig``); None when dense."""
        if not rigl.sparsity > 0.0:
            return None
        return cls(
            rigl.sparsity,
            rigl.sparsity_distribution,
            rigl.rigl_every,
            rigl.rigl_drop_fraction,
            update_end(total_steps, rigl.rigl_end_fraction),
        )

    def updates_at(self, step: int) -> bool:
        """Whether the connectivity changes after optimizer step ``step`` (1-based)."""
        return is_update_step(step, self.every, self.end)

    def drop_fraction_at(self, step: int) -> float:
        return drop_fraction(step, self.drop_fraction, self.end)

"""How each parameter is split over the 2D tensor-parallel mesh (docs/design.md, "Sharding rules").

One table maps a parameter name (within its part) to its *kind* and its slicing rule. The kind
decides which replicas hold identical copies and therefore the replicated-tensor-sharding group
(docs/design.md, "Replicated tensor sharding") and whether weight decay applies:

- ``matrix``: split over tp1 and tp2, identical across dp -> RTS over dp; decayed.
- ``tp2_vector``: split over tp2 only (layer norms, output biases) -> RTS over dp x tp1.
- ``tp1_vector``: split over tp1 only (qkv and fc biases) -> RTS over dp x tp2.
- ``tp2_matrix``: a matrix with too few rows to split over tp1 (a fine-tuning task's
  projection, :mod:`modelling.task_heads`), split over tp2 only -> RTS over dp x tp1; decayed.

No weight is split over the context axis (cp): its ranks run the same weights on different
pieces of the sequence, so every kind is also replicated, and RTS-sharded, over cp (dp x cp
wherever dp is named above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from execution.parallel.index_runs import IndexRuns
from modelling.gpt import (
    EMBEDDING,
    HEAD,
    LAYERS,
    PARTS,
    GPTShapes,
    init_part_region,
    part_inits,
    qualified_name,
)
from modelling.parallel import Axis
from modelling.task_heads import INPUT_OVER_TP2, ON_FIRST_TP2

MATRIX, TP2_VECTOR, TP1_VECTOR = "matrix", "tp2_vector", "tp1_vector"
TP2_MATRIX = "tp2_matrix"
SHARD_KINDS = (MATRIX, TP2_VECTOR, TP1_VECTOR, TP2_MATRIX)
DECAYED_KINDS = frozenset({MATRIX, TP2_MATRIX})

# A rule gives, for each dim of the unsharded tensor, the full-tensor indices that shard (i, j)
# holds along that dim (-1 for a zero padding row). Every rule is such a product of per-dim
# indices, so sharding, unsharding and shard-local initialisation all read the same indices
# and cannot disagree, and none of them needs a full-size index tensor. The rules give them as
# runs (IndexRuns): a shard's shape, or what a checkpoint chunk of it covers, is then a few
# numbers whatever the model's size (a dry run holds no index tensor at all).
ShardIndex = tuple[torch.Tensor, ...]
ShardRuns = tuple[IndexRuns, ...]
IndexRule = Callable[[tuple[int, ...], GPTShapes, int, int], ShardRuns]


def _block(n: int, parts: int, index: int) -> IndexRuns:
    return IndexRuns.arange(n).chunk(parts)[index]


def _rows_padded(rows: Callable[[GPTShapes], int]) -> IndexRule:
    """A table split by rows over tp1 (after zero-padding them) and columns over tp2."""

    def index(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
        padded = IndexRuns.arange(rows(s)).padded_from(shape[0])
        return padded.chunk(s.tp1)[i], _block(shape[1], s.tp2, j)

    return index


def _head_rows(n: int, s: GPTShapes, i: int) -> IndexRuns:
    """Rows [h + 2 kv] of the qkv heads of tp1 shard i: its q rows, then its k rows, then its
    v rows (with grouped-query attention, 1/tp1 of the KV heads beside 1/tp1 of the q heads)."""
    heads = (s.heads, s.key_value_heads, s.key_value_heads)
    blocks = IndexRuns.arange(n).split([count * s.head_dim for count in heads])
    return IndexRuns.cat(b.chunk(s.tp1, unit=s.head_dim)[i] for b in blocks)


def _paired_rows(n: int, s: GPTShapes, i: int) -> IndexRuns:
    """Rows [2 f] of SwiGLU's gate and up projections of tp1 shard i: its gate rows, then its
    up rows, so the shard's two halves pair elementwise."""
    return IndexRuns.cat(half.chunk(s.tp1)[i] for half in IndexRuns.arange(n).chunk(2))


def _paired(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    """gate_up weight [2 f, h] (rows: :func:`_paired_rows`, columns over tp2) or bias [2 f]."""
    rows = _paired_rows(shape[0], s, i)
    return (rows, _block(shape[1], s.tp2, j)) if len(shape) == 2 else (rows,)


def _heads_rows(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    """qkv weight [3h, h]: keep q, k and v of the heads of shard i together, columns over tp2."""
    return _head_rows(shape[0], s, i), _block(shape[1], s.tp2, j)


def _heads_vector(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    """qkv bias [3h]: split with the heads over tp1 (not over tp2, the reference's bug)."""
    return (_head_rows(shape[0], s, i),)


def _out_in(out_axis_tp1: bool) -> IndexRule:
    """A [out, in] weight with one dim over tp1 and the other over tp2."""

    def index(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
        if out_axis_tp1:
            return _block(shape[0], s.tp1, i), _block(shape[1], s.tp2, j)
        return _block(shape[0], s.tp2, j), _block(shape[1], s.tp1, i)

    return index


def _over_tp1(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    return (_block(shape[0], s.tp1, i),)


def _over_tp2(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    return (_block(shape[0], s.tp2, j),)


def _columns_over_tp2(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    """A [out, in] weight whole along ``out``, its input features over tp2."""
    return IndexRuns.arange(shape[0]), _block(shape[1], s.tp2, j)


def _on_first_tp2(shape: tuple[int, ...], s: GPTShapes, i: int, j: int) -> ShardRuns:
    """A vector too short to split, added before a tp2 all-reduce: held whole by tp2 rank 0,
    padding on the others (which the model masks, so it stays zero)."""
    return (IndexRuns.arange(shape[0]) if j == 0 else IndexRuns.padding(shape[0]),)


@dataclass(frozen=True)
class ParamRule:
    kind: str
    index: IndexRule


PLAN: dict[str, dict[str, ParamRule]] = {
    EMBEDDING: {
        "word.weight": ParamRule(MATRIX, _rows_padded(lambda s: s.vocab_padded)),
        "position.weight": ParamRule(MATRIX, _rows_padded(lambda s: s.positions_padded)),
    },
    LAYERS: {
        "ln_1.weight": ParamRule(TP2_VECTOR, _over_tp2),
        "ln_1.bias": ParamRule(TP2_VECTOR, _over_tp2),
        "attn.qkv.weight": ParamRule(MATRIX, _heads_rows),
        "attn.qkv.bias": ParamRule(TP1_VECTOR, _heads_vector),
        "attn.out.weight": ParamRule(MATRIX, _out_in(out_axis_tp1=False)),
        "attn.out.bias": ParamRule(TP2_VECTOR, _over_tp2),
        "ln_2.weight": ParamRule(TP2_VECTOR, _over_tp2),
        "ln_2.bias": ParamRule(TP2_VECTOR, _over_tp2),
        "mlp.fc.weight": ParamRule(MATRIX, _out_in(out_axis_tp1=True)),
        "mlp.fc.bias": ParamRule(TP1_VECTOR, _over_tp1),
        "mlp.proj.weight": ParamRule(MATRIX, _out_in(out_axis_tp1=False)),
        "mlp.proj.bias": ParamRule(TP2_VECTOR, _over_tp2),
        "mlp.gate_up.weight": ParamRule(MATRIX, _paired),
        "mlp.gate_up.bias": ParamRule(TP1_VECTOR, _paired),
        "mlp.down.weight": ParamRule(MATRIX, _out_in(out_axis_tp1=False)),
        "mlp.down.bias": ParamRule(TP2_VECTOR, _over_tp2),
    },
    HEAD: {
        "ln_f.weight": ParamRule(TP2_VECTOR, _over_tp2),
        "ln_f.bias": ParamRule(TP2_VECTOR, _over_tp2),
        # An untied head's projection, split as the word embedding it is not tied to.
        "output.weight": ParamRule(MATRIX, _rows_padded(lambda s: s.vocab_padded)),
    },
}
# The rule of each split a fine-tuning head declares for its projection (TaskHead.SPLITS).
HEAD_SPLITS = {
    INPUT_OVER_TP2: ParamRule(TP2_MATRIX, _columns_over_tp2),
    ON_FIRST_TP2: ParamRule(TP2_VECTOR, _on_first_tp2),
}


def part_rules(part: str, shapes: GPTShapes) -> dict[str, ParamRule]:
    """The rule of every parameter of a part, named as in :class:`~modelling.gpt.GPT`: a task
    head's projection (GPTShapes.task_head) after the final layer norm; of the variants'
    parameters in :data:`PLAN`, those the shapes' architecture has."""
    rules = PLAN[part]
    if part == HEAD and shapes.task_head is not None:
        splits = shapes.task_head.SPLITS.items()
        rules = {**rules, **{name: HEAD_SPLITS[split] for name, split in splits}}
    # The parameters this architecture has (modelling.gpt.part_inits), in the model's order.
    return {name: rules[name] for name in part_inits(shapes, part)}


def shard_runs(part: str, shapes: GPTShapes, tp1_rank: int, tp2_rank: int) -> dict[str, ShardRuns]:
    """Per-dim full-tensor indices (-1: padding) of this (tp1, tp2) rank's shard of a part, as
    runs (:class:`~execution.parallel.index_runs.IndexRuns`)."""
    rules = part_rules(part, shapes)
    return {
        name: rules[name].index(init.shape, shapes, tp1_rank, tp2_rank)
        for name, init in part_inits(shapes, part).items()
    }


def shard_index(
    part: str, shapes: GPTShapes, tp1_rank: int, tp2_rank: int
) -> dict[str, ShardIndex]:
    """:func:`shard_runs` as index tensors, for gathering, scattering or drawing a shard."""
    return {
        name: tuple(dim.tensor() for dim in runs)
        for name, runs in shard_runs(part, shapes, tp1_rank, tp2_rank).items()
    }


def shard_sizes(
    part: str, shapes: GPTShapes, tp1_rank: int, tp2_rank: int
) -> dict[str, torch.Size]:
    """The shapes of this (tp1, tp2) rank's shard of a part's parameters (padding included)."""
    return {
        name: torch.Size(dim.size for dim in runs)
        for name, runs in shard_runs(part, shapes, tp1_rank, tp2_rank).items()
    }


def shard_shapes(shapes: GPTShapes) -> dict[str, dict[str, torch.Size]]:
    """Per part, the shapes of one (tp1, tp2) shard's parameters (padding included).

    Every shard of a layout has the same shapes (padding keeps them equal), so shard (0, 0)
    stands for all of them."""
    return {part: shard_sizes(part, shapes, 0, 0) for part in PARTS}


# The mesh axis (execution.parallel.mesh.AXES) of each kind's RTS group.
# Weights are replicated over dp and cp alike, so RTS shards over both.
RTS_AXES = {MATRIX: "dp_cp", TP2_VECTOR: "dp_tp1", TP1_VECTOR: "dp_tp2", TP2_MATRIX: "dp_tp1"}


def rts_axes(layout) -> dict[str, Axis]:
    """The RTS group of each kind: the replicas that hold identical copies of it (RTS)."""
    return {kind: getattr(layout, axis) for kind, axis in RTS_AXES.items()}


def rts_sizes(dp: int, tp1: int, tp2: int, cp: int = 1) -> dict[str, int]:
    """Sizes of the RTS groups of :func:`rts_axes` for a (dp, cp, tp1, tp2) layout."""
    replicas = dp * cp
    return {
        MATRIX: replicas,
        TP2_VECTOR: replicas * tp1,
        TP1_VECTOR: replicas * tp2,
        TP2_MATRIX: replicas * tp1,
    }


def shard_part(
    part: str, full: dict[str, torch.Tensor], shapes: GPTShapes, tp1_rank: int, tp2_rank: int
) -> dict[str, torch.Tensor]:
    """This (tp1, tp2) rank's shard of every tensor of an unsharded part (contiguous copies)."""
    index = shard_index(part, shapes, tp1_rank, tp2_rank)
    return {name: _take(t, index[name]) for name, t in full.items()}


def unshard_part(
    part: str, shards: dict[tuple[int, int], dict[str, torch.Tensor]], shapes: GPTShapes
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_part`: full unpadded tensors from the shards of every (i, j).

    Each shard is scattered to the indices its rule names; padding (index -1) is dropped.
    """
    any_shard = next(iter(shards.values()))
    inits = part_inits(shapes, part)
    out = {name: torch.zeros(inits[name].shape, dtype=t.dtype) for name, t in any_shard.items()}
    for (i, j), tensors in shards.items():
        index = shard_index(part, shapes, i, j)
        for name, t in tensors.items():
            real = tuple(torch.nonzero(p >= 0).squeeze(1) for p in index[name])
            source = tuple(p[r] for p, r in zip(index[name], real, strict=True))
            out[name][_outer(source)] = t.to(out[name].device)[_outer(real)]
    return out


def init_part_shard(
    shapes: GPTShapes,
    part: str,
    layer: int,
    seed: int,
    init_std: float,
    tp1_rank: int,
    tp2_rank: int,
    workers: int = 1,
) -> dict[str, torch.Tensor]:
    """This rank's shard of a part's initial weights, drawing only the tiles it touches.

    Bit-identical to ``shard_part(part, init_full_part(...), shapes, tp1_rank, tp2_rank)``
    (padding rows zero) without ever holding the whole part: the extra memory is one tile per
    worker.

    Args:
        shapes: Model and layout sizes.
        part, layer: Which part (``layer`` is the decoder layer for ``layers``, else 0).
        seed, init_std: As for :func:`modelling.gpt.init_full_part`.
        tp1_rank, tp2_rank: This rank's tensor-parallel coordinates.
        workers: Threads drawing tiles at once (:func:`modelling.gpt.init_part_region`).

    Returns:
        dict of parameter name -> this rank's float32 shard, as :func:`shard_part` gives it.
    """
    index = shard_index(part, shapes, tp1_rank, tp2_rank)
    return init_part_region(shapes, part, layer, seed, init_std, index, workers)


def init_model_shard(
    shapes: GPTShapes,
    seed: int,
    init_std: float,
    tp1_rank: int = 0,
    tp2_rank: int = 0,
    workers: int = 1,
) -> dict[str, torch.Tensor]:
    """Every part's :func:`init_part_shard`, named as in :class:`~modelling.gpt.GPT`'s
    ``state_dict`` (``layers.3.attn.qkv.weight``): with the default ranks, the whole padded
    model for one device. Load it into a GPT built on the ``meta`` device with
    ``load_state_dict(..., assign=True)``, so that no other random initialisation runs."""
    return {
        qualified_name(part, row, name): tensor
        for part in PARTS
        for row in range(shapes.layers if part == LAYERS else 1)
        for name, tensor in init_part_shard(
            shapes, part, row, seed, init_std, tp1_rank, tp2_rank, workers
        ).items()
    }


def _take(full: torch.Tensor, index: ShardIndex) -> torch.Tensor:
    """``full`` at the product of per-dim indices, zero where an index is -1 (padding)."""
    out = full
    for dim, p in enumerate(index):
        p = p.to(full.device)
        out = out.index_select(dim, p.clamp(min=0))
        padding = torch.nonzero(p < 0).squeeze(1)
        if len(padding):
            out.index_fill_(dim, padding, 0)
    return out


def _outer(index: ShardIndex) -> tuple[torch.Tensor, ...]:
    """Per-dim index tensors reshaped to broadcast into their outer product."""
    n = len(index)
    return tuple(p.view([-1 if d == k else 1 for k in range(n)]) for d, p in enumerate(index))

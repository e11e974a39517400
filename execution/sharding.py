"""How each parameter is split over the 2D tensor-parallel mesh (DESIGN.md section 4).

One table maps a parameter name (within its part) to its *kind* and its slicing rule. The kind
decides which replicas hold identical copies and therefore the replicated-tensor-sharding group
(section 5) and whether weight decay applies:

- ``matrix``: split over tp1 and tp2, identical across dp -> RTS over dp; decayed.
- ``tp2_vector``: split over tp2 only (layer norms, output biases) -> RTS over dp x tp1.
- ``tp1_vector``: split over tp1 only (qkv and fc biases) -> RTS over dp x tp2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modelling.gpt import EMBEDDING, HEAD, LAYERS, GPTShapes, init_full_part

MATRIX, TP2_VECTOR, TP1_VECTOR = "matrix", "tp2_vector", "tp1_vector"
KINDS = (MATRIX, TP2_VECTOR, TP1_VECTOR)
DECAYED_KINDS = frozenset({MATRIX})


def _block(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return t.chunk(parts, dim)[index] if parts > 1 else t


def _rows_padded(rows: Callable[[GPTShapes], int]) -> Callable:
    """A table split by rows over tp1 (after zero-padding them) and columns over tp2."""

    def shard(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
        padded = F.pad(full, (0, 0, 0, rows(s) - full.shape[0]))
        return _block(_block(padded, 0, s.tp1, i), 1, s.tp2, j)

    return shard


def _heads_rows(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
    """qkv weight [3h, h]: keep q, k and v of the heads of shard i together, columns over tp2."""
    per_head = full.view(3, s.heads, s.head_dim, -1)
    local = _block(per_head, 1, s.tp1, i).reshape(-1, full.shape[-1])
    return _block(local, 1, s.tp2, j)


def _heads_vector(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
    """qkv bias [3h]: split with the heads over tp1 (not over tp2, the reference's bug)."""
    return _block(full.view(3, s.heads, s.head_dim), 1, s.tp1, i).reshape(-1)


def _out_in(out_axis_tp1: bool) -> Callable:
    """A [out, in] weight with one dim over tp1 and the other over tp2."""

    def shard(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
        if out_axis_tp1:
            return _block(_block(full, 0, s.tp1, i), 1, s.tp2, j)
        return _block(_block(full, 0, s.tp2, j), 1, s.tp1, i)

    return shard


def _over_tp1(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
    return _block(full, 0, s.tp1, i)


def _over_tp2(full: torch.Tensor, s: GPTShapes, i: int, j: int) -> torch.Tensor:
    return _block(full, 0, s.tp2, j)


@dataclass(frozen=True)
class ParamRule:
    kind: str
    shard: Callable[[torch.Tensor, GPTShapes, int, int], torch.Tensor]


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
    },
    HEAD: {
        "ln_f.weight": ParamRule(TP2_VECTOR, _over_tp2),
        "ln_f.bias": ParamRule(TP2_VECTOR, _over_tp2),
    },
}


def shard_part(
    part: str, full: dict[str, torch.Tensor], shapes: GPTShapes, tp1_rank: int, tp2_rank: int
) -> dict[str, torch.Tensor]:
    """This (tp1, tp2) rank's shard of every tensor of an unsharded part (contiguous copies)."""
    return {
        name: PLAN[part][name].shard(t, shapes, tp1_rank, tp2_rank).contiguous()
        for name, t in full.items()
    }


def unshard_part(
    part: str, shards: dict[tuple[int, int], dict[str, torch.Tensor]], shapes: GPTShapes
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_part`: full unpadded tensors from the shards of every (i, j).

    Works by sharding a tensor of 1-based element positions with the same rule, so the inverse
    can never drift from the forward rule; padding shows up as position 0 and is dropped.
    """
    any_shard = next(iter(shards.values()))
    full_shapes = _full_shapes(part, shapes)
    out = {}
    for name in any_shard:
        numel = full_shapes[name].numel()
        positions = torch.arange(1, numel + 1, dtype=torch.float64).view(full_shapes[name])
        result = torch.zeros(numel, dtype=any_shard[name].dtype)
        for (i, j), tensors in shards.items():
            index = PLAN[part][name].shard(positions, shapes, i, j).reshape(-1)
            real = index > 0
            result[index[real].long() - 1] = tensors[name].reshape(-1)[real]
        out[name] = result.view(full_shapes[name])
    return out


def _full_shapes(part: str, shapes: GPTShapes) -> dict[str, torch.Size]:
    """Unsharded shapes of a part, read off a meta-device initialisation (no memory used)."""
    with torch.device("meta"):
        return {name: t.shape for name, t in init_full_part(shapes, part, 0, 0, 1.0).items()}

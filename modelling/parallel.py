"""The parallel vocabulary of the model: mesh axes, Megatron's conjugate functions and the
all-to-alls of context parallelism (DeepSpeed-Ulysses).

The model calls these functions at the points where a sharded computation needs a collective;
it never sees a process group. An :class:`Axis` of size 1 (:data:`LOCAL`) turns every function
into the identity, so the single-device model and every shard run the same code.

A compiled block (``--compile``) breaks its graph at each collective of an axis larger than
one: the collective runs eagerly, on the process group the axis holds, between two compiled
graphs, so nothing of a process group has to be traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Axis(Protocol):
    """One tensor-parallel mesh axis as seen by this rank (implemented by ``execution``)."""

    size: int
    rank: int

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``) over the axis, outside autograd."""
        ...

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunk k of dim 0 to member k; chunk k of the result from member k."""
        ...


class LocalAxis:
    """An axis of one rank: the single-device case."""

    size = 1
    rank = 0

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks


LOCAL = LocalAxis()


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that an in-place collective may overwrite.

    Autograd hands the same gradient tensor to several consumers (an addition's two inputs),
    so collectives must never reduce a tensor they did not allocate.
    """
    return t.clone(memory_format=torch.contiguous_format)


class _CopyToAxis(torch.autograd.Function):
    """f: identity forward, all-reduce backward. Conjugate of :class:`_ReduceFromAxis`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.axis.all_reduce_(_fresh(grad)), None


class _ReduceFromAxis(torch.autograd.Function):
    """g: all-reduce forward, identity backward. Conjugate of :class:`_CopyToAxis`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        return axis.all_reduce_(_fresh(x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the axis in both directions: every rank's output depends on every input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return axis.all_reduce_(_fresh(x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.axis.all_reduce_(_fresh(grad)), None


class _AllToAll(torch.autograd.Function):
    """Chunks of dim 0 exchanged over the axis (chunk k to member k). Its own conjugate: the
    backward sends each gradient chunk back where its value came from, by the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return axis.all_to_all(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.axis.all_to_all(grad), None


def _eager(function: Callable) -> Callable:
    """``function`` run outside any compiled graph (module docstring)."""
    return torch.compiler.disable(function, reason="a collective on the axis's process group")


_copy_to_axis = _eager(_CopyToAxis.apply)
_reduce_from_axis = _eager(_ReduceFromAxis.apply)
_all_reduce_sum = _eager(_AllReduceSum.apply)
_all_to_all = _eager(_AllToAll.apply)


def sequence_to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """DeepSpeed-Ulysses' first all-to-all: a piece of the sequence with every local head in,
    the whole sequence with 1/size of the heads out.

    Args:
        x: ``(B, s, ..., H, d)``: piece ``axis.rank`` of ``axis.size`` equal pieces of the
            sequence, H heads of width d (any dims between, e.g. q/k/v).

    Returns:
        ``(B, s * size, ..., H / size, d)``: head group ``axis.rank`` over the whole sequence.
    """
    if axis.size == 1:
        return x
    n = axis.size
    B, s, *between, H, d = x.shape
    groups = x.reshape(B, s, *between, n, H // n, d).movedim(-3, 0)  # (n, B, s, ..., H/n, d)
    pieces = _all_to_all(groups, axis)  # chunk k: sequence piece k of my head group
    return pieces.movedim(0, 1).reshape(B, n * s, *between, H // n, d)


def heads_to_sequence(y: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Inverse of :func:`sequence_to_heads`: ``(B, S, H / size, d)`` of the whole sequence in,
    ``(B, S / size, H, d)`` of this rank's piece out, heads in their original order."""
    if axis.size == 1:
        return y
    n = axis.size
    B, S, h, d = y.shape
    pieces = y.reshape(B, n, S // n, h, d).movedim(1, 0)  # (n, B, s, h, d)
    groups = _all_to_all(pieces, axis)  # chunk k: head group k of my sequence piece
    return groups.movedim(0, 2).reshape(B, S // n, n * h, d)


def copy_to(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Marks x as replicated over ``axis`` and consumed by sharded weights (Megatron's f)."""
    if axis.size == 1:
        return x
    return _copy_to_axis(x, axis)


def reduce_from(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sums the partial results of ``axis``'s shards into a replicated tensor (Megatron's g)."""
    if axis.size == 1:
        return x
    return _reduce_from_axis(x, axis)


def all_reduce_sum(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Differentiable sum over ``axis`` (layer-norm statistics of a sharded hidden dim)."""
    if axis.size == 1:
        return x
    return _all_reduce_sum(x, axis)

"""The tensor-parallel vocabulary of the model: mesh axes and Megatron's conjugate functions.

The model calls these functions at the points where a sharded computation needs a collective;
it never sees a process group. An :class:`Axis` of size 1 (:data:`LOCAL`) turns every function
into the identity, so the single-device model and every shard run the same code.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Axis(Protocol):
    """One tensor-parallel mesh axis as seen by this rank (implemented by ``execution``)."""

    size: int
    rank: int

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``) over the axis, outside autograd."""
        ...


class LocalAxis:
    """An axis of one rank: the single-device case."""

    size = 1
    rank = 0

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor


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


def copy_to(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Marks x as replicated over ``axis`` and consumed by sharded weights (Megatron's f)."""
    if axis.size == 1:
        return x
    return _CopyToAxis.apply(x, axis)


def reduce_from(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sums the partial results of ``axis``'s shards into a replicated tensor (Megatron's g)."""
    if axis.size == 1:
        return x
    return _ReduceFromAxis.apply(x, axis)


def all_reduce_sum(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Differentiable sum over ``axis`` (layer-norm statistics of a sharded hidden dim)."""
    if axis.size == 1:
        return x
    return _AllReduceSum.apply(x, axis)

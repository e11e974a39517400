"""Weight gradients summed where they are made: the vocabulary-wide weights' (the word
embedding's lookup, the head's projection), into a float32 buffer, over a phase's micro-batches.

Autograd makes each micro-batch's gradient of a weight as a tensor of the weight's size, which
the caller then adds to its float32 sum. For a vocabulary-wide weight that tensor is the
largest of the step's backward (Llama 3's untied head: 128,256 x 4,096, 1 GB in bfloat16,
beside its chunk's logits), and making it costs more than using it: the embedding's backward
fills a zero table and adds a few rows into it, then the whole table is added again; the
head's writes a table-sized product and adds it again. A :class:`GradSink` takes the
gradient where it is computed instead, as Megatron's gradient accumulation fusion does: the
embedding's rows are added into the sum in place (``index_add_``), the head's product is
multiplied into it (``addmm_``; the first micro-batch's written there directly). The weight's
own gradient is then an expanded zero (one element), which the caller drops.

Each element's sum differs from the unsunk one's by rounding: a token repeated within a
micro-batch is added to the sum one row at a time rather than summed first, and ``addmm_``
adds the sum into the product's accumulation rather than after it. Where the compute dtype
is not the buffer's (16-bit compute), the product is made in the compute dtype and added, as
without a sink (a mixed ``addmm`` is a GPU's alone).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

NO_SINKS: Mapping[str, GradSink] = {}


class GradSink:
    """A weight's gradient summed over a phase's micro-batches into ``buffer`` (the weight's
    shape), which the first micro-batch's gradient overwrites."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.filled = False

    def add_rows(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """A lookup's gradient: row ``ids[i]`` gets ``grad[i]`` (ids (...), grad (..., h))."""
        if not self.filled:
            self.buffer.zero_()
            self.filled = True
        rows = grad.reshape(-1, grad.shape[-1]).to(self.buffer.dtype)
        self.buffer.index_add_(0, ids.reshape(-1), rows)

    def add_product(self, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        """A linear's weight gradient, ``grad_out^T @ inputs`` over every leading dimension."""
        a = grad_out.reshape(-1, grad_out.shape[-1]).t()
        b = inputs.reshape(-1, inputs.shape[-1])
        if a.dtype != self.buffer.dtype:
            product = torch.mm(a, b)
            (self.buffer.add_ if self.filled else self.buffer.copy_)(product)
        elif self.filled:  # addmm_'s kernel, as an op torch's FLOP counter knows
            torch.addmm(self.buffer, a, b, out=self.buffer)
        else:
            torch.mm(a, b, out=self.buffer)
        self.filled = True


def _dropped(weight_shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """What autograd gets as the sunk weight's gradient: zeros of its shape, one element."""
    return like.new_zeros(()).expand(weight_shape)


class _SunkLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, ids: torch.Tensor, sink: GradSink) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.sink, ctx.table_shape = sink, table.shape
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        ctx.sink.add_rows(ids, grad)
        return _dropped(ctx.table_shape, grad), None, None


class _SunkLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sink: GradSink) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.sink.add_product(grad, x)
        return grad.matmul(weight), _dropped(weight.shape, grad), None


def embedding(ids: torch.Tensor, table: torch.Tensor, sink: GradSink | None) -> torch.Tensor:
    """``F.embedding(ids, table)``, its table's gradient into ``sink`` where there is one."""
    return F.embedding(ids, table) if sink is None else _SunkLookup.apply(table, ids, sink)


def linear(x: torch.Tensor, weight: torch.Tensor, sink: GradSink | None) -> torch.Tensor:
    """``F.linear(x, weight)``, its weight's gradient into ``sink`` where there is one."""
    return F.linear(x, weight) if sink is None else _sunk_linear(x, weight, sink)


# Outside a compiled head's graphs (--compile): the sink adds into its buffer in place, which
# a graph would take as an input it mutates; the norm before and the cross-entropy after
# compile as graphs of their own.
@torch.compiler.disable(reason="a gradient sink adds into its buffer in place")
def _sunk_linear(x: torch.Tensor, weight: torch.Tensor, sink: GradSink) -> torch.Tensor:
    return _SunkLinear.apply(x, weight, sink)

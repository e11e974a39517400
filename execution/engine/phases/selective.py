"""Selective recompute (``--recompute selective``): attention's core run without its graph in
the forward, and again in the backward.

What the core saves for its backward grows with the square of the sequence (scores,
probabilities, their dropout), so a layer keeps only the core's inputs, q, k and v, and its
backward runs the core again under autograd on them and backpropagates through that
(Korthikanti et al. 2022). The core seeds its own dropout, so the second run draws the first
run's masks. :class:`_RecomputedCore` does what ``torch.utils.checkpoint`` did here, without
its machinery on the host (a frame, hooks and tree walks for each call: two thirds of a layer
backward's host time at a small width). The block is built with :class:`RecomputedAttention`
(:func:`attention_for`), the same parameters under the same names: nothing is patched after.
"""

from __future__ import annotations

import torch

from modelling.layers import Attention


class _RecomputedCore(torch.autograd.Function):
    """``core(q, k, v, seeds)`` without a graph; its backward runs it again under autograd on
    the q, k and v it saved (which the layer's saved-tensor hooks keep) and backpropagates
    the output's gradient through that."""

    @staticmethod
    def forward(ctx, core, seeds, q, k, v):
        ctx.core, ctx.seeds = core, seeds
        ctx.save_for_backward(q, k, v)
        return core(q, k, v, seeds)

    @staticmethod
    def backward(ctx, grad):
        needed = ctx.needs_input_grad[2:]
        inputs = [
            t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needed, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.core(*inputs, ctx.seeds)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return None, None, *(next(grads) if t.requires_grad else None for t in inputs)


class RecomputedAttention(Attention):
    """Attention whose core recomputes in its backward (``selective``); only where autograd
    records, so a forward without grad runs it plainly. Built as the block's attention
    (:func:`attention_for`), the same parameters under the same names."""

    # Outside a compiled block's graph (--compile): inductor would save and restore the
    # generator's state around the recompute itself, on tensors the kept entry packs.
    @torch.compiler.disable(reason="selective recompute runs attention's core eagerly")
    def core(self, q, k, v, seeds):
        if not torch.is_grad_enabled():
            return super().core(q, k, v, seeds)
        return _RecomputedCore.apply(super().core, seeds, q, k, v)


def attention_for(mode: str) -> type[Attention]:
    """The attention a decoder block is built with under ``--recompute mode``."""
    return RecomputedAttention if mode == "selective" else Attention

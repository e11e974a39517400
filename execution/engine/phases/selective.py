"""Selective recompute (``--recompute selective``): attention's core run without its graph in
the forward, and again in the backward.

What the core saves for its backward grows with the square of the sequence (scores,
probabilities, their dropout), so a layer keeps only the core's inputs, q, k and v, and its
backward runs the core again under autograd on them and backpropagates through that
(Korthikanti et al. 2022). The core seeds its own dropout, so the second run draws the first
run's masks. :class:`_RecomputedCore` does what ``torch.utils.checkpoint`` did here, without
its machinery on the host (a frame, hooks and tree walks for each call: two thirds of a layer
backward's host time at a small width).
"""

from __future__ import annotations

import torch


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


def prepare_block(block: torch.nn.Module, mode: str) -> None:
    """Makes a decoder block's attention core recompute in its backward (``selective``); only
    where autograd records, so a forward without grad runs it plainly."""
    if mode != "selective":
        return
    core = block.attn.core

    # Outside a compiled block's graph (--compile): inductor would save and restore the
    # generator's state around the recompute itself, on tensors the kept entry packs.
    @torch.compiler.disable(reason="selective recompute runs attention's core eagerly")
    def recomputed(q, k, v, seeds):
        if not torch.is_grad_enabled():
            return core(q, k, v, seeds)
        return _RecomputedCore.apply(core, seeds, q, k, v)

    block.attn.core = recomputed

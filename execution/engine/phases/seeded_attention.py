"""Attention with dropout as one op that a compiled graph keeps whole
(``phased::seeded_attention``).

Eager runs attention with dropout as SDPA under the device's default generator, seeded for the
call and restored after it (:func:`modelling.dropout.fused_attention_with_dropout`). Dynamo
cannot trace that seeding, so in a compiled block the call is a graph break: the block runs as
several graphs with attention eager between them, and each graph costs the host its guards,
its wrappers and its launches (with dropout a compiled layer's forward took the host more time
than eager's).

This op is the same call made opaque to the compiler. It seeds the generator from a tensor
seed, runs the kernel eager's SDPA runs (the pinned backend's on CUDA: FlashAttention or the
memory-efficient kernel; on a CPU the math path, SDPA's only kernel with dropout there) and
returns what that kernel's backward needs. Its backward is SDPA's: the fused kernels draw the
mask again from the philox seed and offset their forward returned, so nothing random runs in
the backward; the math path's backward is written out from the dropped probabilities its
forward returned and the probabilities recomputed. So the output is eager's bit for bit, and
the gradients are eager's up to the rounding of the written-out backward.

The engine gives its attention kernel this op (``AttentionKernel.dropout_op``) before it
builds compiled blocks with it, once
:func:`~execution.engine.phases.compiled.attention_op_mismatch` found it gives eager's
numbers on the device: which kernel runs, and whether the op is eager's there, is the
device's business, not the model's. Where SDPA would choose the kernel itself (CUDA without a pin)
there is no op (:func:`dropout_kernel` is None), and the graph breaks as before.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend

from modelling.dropout import mix_seed, seeded_default_generator
from utils.torch_private import sdpa_backward_ops, sdpa_kernel_ops, sdpa_math_op

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def dropout_kernel(device_type: str, backend: SDPBackend | None, head_dim: int) -> str | None:
    """The kernel attention with dropout runs as one op: the pinned ``backend``'s on CUDA
    (FlashAttention only where SDPA would not pad the head dimension), the math path on a
    CPU; None where SDPA would choose for itself (the call stays a graph break)."""
    if backend == SDPBackend.FLASH_ATTENTION and head_dim % 8 == 0:
        return "flash"
    if backend == SDPBackend.EFFICIENT_ATTENTION:
        return "efficient"
    if backend is None and device_type == "cpu":
        return "math"
    return None


def seeded_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    first_head: int,
    kernel: str,
) -> torch.Tensor:
    """Causal attention with dropout ``p`` drawn as
    ``fused_attention_with_dropout(q, k, v, p, mix_seed(seed, first_head))`` draws it, as one
    op of a compiled graph (module docstring); ``kernel`` from :func:`dropout_kernel`."""
    return _SeededAttention.apply(q, k, v, seed, p, first_head, kernel)


# The forward as one op of the dispatcher, on a library of its own, and its gradient as an
# autograd function around it, rather than torch.library.custom_op: a compiled graph calls the
# op with autograd off, where custom_op's Python layers around the call (its autograd wrapper,
# redispatch, output checks) took the host about 40 us a call, half the math path's own time
# at a small width; and eager, an autograd function costs less than custom_op's wrapper.
_OPS = torch.library.Library("phased", "FRAGMENT")
_OPS.define(
    "seeded_attention(Tensor q, Tensor k, Tensor v, Tensor seed, float p, int first_head,"
    " str kernel) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _seeded_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seed: torch.Tensor,
    p: float,
    first_head: int,
    kernel: str,
) -> Outputs:
    with seeded_default_generator(q.device, mix_seed(int(seed), first_head)):
        return _forward(q, k, v, p, kernel)


_OPS.impl("seeded_attention", _seeded_forward, "CompositeExplicitAutograd")


@torch.library.register_fake("phased::seeded_attention", lib=_OPS)
def _(q, k, v, seed, p, first_head, kernel):
    return _forward(q, k, v, p, kernel)  # the kernel's meta function: shapes, no draw


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, kernel: str) -> Outputs:
    """(output, then what the kernel's backward reads): FlashAttention's logsumexp and random
    state; the memory-efficient kernel's logsumexp, philox seed and offset; the math path's
    dropped probabilities."""
    ops = sdpa_kernel_ops()
    if kernel == "flash":
        out, lse, _, _, _, _, rng_state, unused, _ = ops["flash"](q, k, v, p, True)
        return out, lse, rng_state, unused
    if kernel == "efficient":
        # The logsumexp always: without grad SDPA skips it, which changes no output bit.
        out, lse, philox_seed, philox_offset = ops["efficient"](q, k, v, None, True, p, True)
        return out, lse, philox_seed, philox_offset
    out, dropped = sdpa_math_op()(q, k, v, None, p, True)
    return out, dropped, q.new_empty(0), q.new_empty(0)


class _SeededAttention(torch.autograd.Function):
    """The op's output, and SDPA's backward from what its forward kept (no draw in the
    backward)."""

    @staticmethod
    def forward(ctx, q, k, v, seed, p, first_head, kernel):
        output = torch.ops.phased.seeded_attention.default(q, k, v, seed, p, first_head, kernel)
        ctx.p, ctx.kernel = p, kernel
        ctx.save_for_backward(q, k, v, *output)
        return output[0]

    @staticmethod
    def backward(ctx, grad):
        # The fused kernels' logsumexp and random state (FlashAttention's state and its unused
        # second tensor, the memory-efficient kernel's philox seed and offset), or the math
        # path's dropped probabilities and two empty tensors (_forward).
        q, k, v, out, lse_or_dropped, state, state_2 = ctx.saved_tensors
        p, backward = ctx.p, sdpa_backward_ops()
        if ctx.kernel == "flash":
            seq_q, seq_k = q.shape[2], k.shape[2]
            dense = (None, None)  # no cumulative sequence lengths: each sequence whole
            dq, dk, dv = backward["flash"](
                grad, q, k, v, out, lse_or_dropped, *dense, seq_q, seq_k, p, True, state, state_2
            )
        elif ctx.kernel == "efficient":
            wanted = [True, True, True, False]  # q, k, v; no attention bias
            dq, dk, dv, _ = backward["efficient"](
                grad, q, k, v, None, out, lse_or_dropped, state, state_2, p, wanted, True
            )
        else:
            dq, dk, dv = _math_backward(grad, q, k, v, lse_or_dropped, p)
        return dq, dk, dv, None, None, None, None


def _math_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropped: torch.Tensor,
    p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of SDPA's math path with dropout, from its dropped probabilities
    ``dropped`` (probs * keep / (1 - p)): the probabilities are recomputed as the path computes
    them (q and k each scaled by the root of the scale, causal, softmax), in float32 for
    16-bit inputs as the path does (it returns ``dropped`` rounded to their dtype, so ``v``'s
    gradient differs from eager's by that rounding). A kept entry is where ``dropped`` is not
    0; where a probability is 0 itself its gradient is multiplied by it, so it needs no
    mask."""
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    grad, q, k, v, dropped = (t.to(work) for t in (grad, q, k, v, dropped))
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    q, k = q * root, k * root
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    probs = (q @ k.transpose(-2, -1)).masked_fill(~causal, float("-inf")).softmax(-1)
    d_dropped = grad @ v.transpose(-2, -1)
    d_probs = torch.where(dropped != 0, d_dropped / (1 - p), 0.0)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
    dq = (d_scores @ k) * root
    dk = (d_scores.transpose(-2, -1) @ q) * root
    dv = dropped.transpose(-2, -1) @ grad
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)

"""What runs attention's core, ``softmax(q k^T / sqrt(d)) v`` (causal): a kernel object that
:class:`~modelling.layers.Attention` is given when it is built, and never after.

Which fused kernel runs, and how, is the device's business, not the model's: whoever builds
the model chooses it once (the engine: :class:`execution.engine.phases.attention_kernels.
AttentionKernel`, the calibration's fastest that passes its check, pinned; on meta tensors the
op that kernel runs, so that planning measures it). Any object with :class:`SDPAKernel`'s
call will do; without one, attention runs :class:`TorchSDPA`, torch's own choice.
``--dropout_parity`` wraps whichever kernel in :class:`HeadByHeadDropout`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from modelling.dropout import Seed, seeded_attention


class SDPAKernel(Protocol):
    """Causal scaled-dot-product attention over ``(B, heads, S, d)`` q, k and v (k and v with
    as many heads as q): without dropout where ``p`` is 0; else with dropout ``p`` on the
    probabilities of heads ``first, ...`` (their global indices), drawn from the layer's
    attention ``seed``, the same masks wherever these heads are recomputed
    (:func:`modelling.dropout.seeded_attention`). One call for both, so that one code
    object runs attention with dropout and without (Dynamo takes each on once)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: Seed, first: int
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class TorchSDPA:
    """``F.scaled_dot_product_attention`` (or ``sdpa``, a stand-in with its signature) on
    SDPA's ``backend`` alone, or on the backend torch chooses where None. The pin sets
    process-wide flags while it runs: one thread at a time runs a step's attention."""

    backend: SDPBackend | None = None
    sdpa: Callable[..., torch.Tensor] = field(default=F.scaled_dot_product_attention, compare=False)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: Seed, first: int
    ) -> torch.Tensor:
        if p:  # outside any context (see modelling.dropout.seeded_attention)
            return seeded_attention(q, k, v, p, seed, first, False, self.sdpa, self.backend)
        pinned = contextlib.nullcontext() if self.backend is None else sdpa_kernel(self.backend)
        with pinned:
            return self.sdpa(q, k, v, is_causal=True)


@dataclass(frozen=True)
class HeadByHeadDropout:
    """``kernel`` without dropout; with it, each head's mask drawn from its own global index
    (written out, with a ``[B, heads, S, S]`` tensor), so that every layout draws the single
    process's masks (``--dropout_parity``, for the layout-parity tests)."""

    kernel: SDPAKernel

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: Seed, first: int
    ) -> torch.Tensor:
        if not p:
            return self.kernel(q, k, v, p, seed, first)
        return seeded_attention(q, k, v, p, seed, first, True, F.scaled_dot_product_attention)

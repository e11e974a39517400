"""The Llama family's building blocks beside GPT-3's (:mod:`modelling.layers`), for every shard.

Each is a module of its own that :func:`modelling.gpt.GPT` builds instead of GPT-3's once, from
:class:`~modelling.gpt.GPTShapes`; no forward asks which variant it is:

- :class:`RMSNorm` for :class:`~modelling.layers.LayerNorm` (no mean, no bias), its sum of
  squares all-reduced over tp2 like the layer norm's statistics;
- :class:`Rotary` positions applied to q and k inside attention, for the learned position table;
  positions are global, so a sequence split over context ranks rotates like the whole; with
  :class:`Llama3Scaling`, Llama 3.1's stretched frequencies;
- :class:`SwiGLU` for the GELU MLP: ``down(silu(gate x) * up x)``, the gate and up projections
  one matrix whose rows each tp1 shard holds as (its gate rows, its up rows);
- :class:`modelling.layers.WordEmbedding` (no position table); the untied head is
  :class:`modelling.lm_heads.UntiedLMHead`.

Numerics follow HuggingFace's ``LlamaForCausalLM`` (float32 statistics, ``rotate_half``
convention), so its weights load unpermuted (:mod:`modelling.hf_llama`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelling.layers import ParallelLinear
from modelling.parallel import Axis, all_reduce_sum, copy_to
from modelling.tiles import NORMAL, ONES, ZEROS, ParamInit


class RMSNorm(nn.Module):
    """Root-mean-square norm over a hidden dimension sharded across ``tp2``: a gain, no bias.

    The mean of squares is an fp32 sum all-reduced over tp2; with tp2 of size 1 it is
    HuggingFace's ``LlamaRMSNorm`` op for op.
    """

    def __init__(self, local_hidden: int, tp2: Axis, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_hidden))
        self.tp2 = tp2
        self.eps = eps

    @staticmethod
    def inits(hidden: int) -> dict[str, ParamInit]:
        """Its unsharded gain (ones)."""
        return {"weight": ParamInit((hidden,), ONES)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.tp2.size == 1:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        else:
            full_hidden = x.shape[-1] * self.tp2.size
            mean_square = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), self.tp2) / full_hidden
        return self.weight * (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rotary frequencies (HuggingFace's ``rope_type`` llama3): a model pretrained
    at ``original_max_positions`` reads longer contexts with its long wavelengths stretched.

    Wavelengths shorter than ``original_max_positions / high_freq_factor`` keep their
    frequency, those longer than ``original_max_positions / low_freq_factor`` are divided by
    ``factor``, and those between are interpolated smoothly between the two.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    @classmethod
    def of(cls, model) -> Llama3Scaling | None:
        """From a :class:`config.schema_model.ModelConfig`: None for plain rotary positions."""
        if model.rope_type != "llama3":
            return None
        return cls(
            model.rope_factor,
            model.rope_low_freq_factor,
            model.rope_high_freq_factor,
            model.rope_original_max_positions,
        )

    def __call__(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled float32 ``inv_freq``, op for op as ``transformers``' llama3 rope, so that
        an imported model's angles are HuggingFace's to the last bit."""
        original = self.original_max_positions
        low, high = self.low_freq_factor, self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        stretched = torch.where(wavelength > original / low, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * stretched / self.factor + smooth * stretched
        between = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(between, smoothed, stretched)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) with base ``theta``, in HuggingFace's
    ``rotate_half`` layout: dimension i pairs with i + head_dim / 2; ``scaling`` (Llama 3.1's)
    stretches its frequencies.

    Attention applies it after the context all-to-all, to whole sequences, so the positions
    it rotates by are global whatever the cp split; generation's cache rotates each new key at
    its own position through the same angles.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Llama3Scaling | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        # The last positions' angles: every layer and micro-batch of a step rotates by the
        # same ones, which would otherwise take a dozen small ops each time.
        self._last: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def angles(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(len(positions), head_dim)`` in ``dtype``, computed in float32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents.float() / self.head_dim))
        if self.scaling is not None:
            inv_freq = self.scaling(inv_freq)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        both = torch.cat((freqs, freqs), dim=-1)
        return both.cos().to(dtype), both.sin().to(dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ``(B, heads, S, d)`` of positions ``start .. start + S - 1``, rotated."""
        cos, sin = self._angles_for(q, start)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _angles_for(self, q: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`angles` of ``q``'s positions from ``start``: the last call's where it asked
        for the same. A compiled graph computes them anew, in its fused kernels; so does a
        step on meta or fake tensors (planning), whose every call of a part must run the same
        ops, as its pricing of a compiled call counts them."""
        length = q.shape[-2]
        if torch.compiler.is_compiling() or q.is_meta or type(q) is not torch.Tensor:
            positions = torch.arange(start, start + length, device=q.device)
            return self.angles(positions, q.dtype)
        key = (start, length, q.dtype, q.device, torch.is_inference_mode_enabled())
        if self._last is None or self._last[0] != key:
            positions = torch.arange(start, start + length, device=q.device)
            self._last = (key, self.angles(positions, q.dtype))
        return self._last[1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class NoRotation(nn.Module):
    """Attention's position step for learned positions (added in the embedding): none."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; the intermediate layer is sharded over tp1.

    ``gate_up`` holds this shard's gate rows then its up rows (one matmul, one column split);
    ``down`` takes the intermediate features over tp1 and gives the hidden size over tp2.
    """

    ROWS_PER_FEATURE = 2  # a gate's and an up's

    def __init__(self, local_hidden: int, local_ffn: int, tp1: Axis, tp2: Axis, bias: bool):
        super().__init__()
        self.gate_up = ParallelLinear(local_hidden, 2 * local_ffn, reduce_axis=tp2, bias=bias)
        self.down = ParallelLinear(local_ffn, local_hidden, reduce_axis=tp1, bias=bias)
        self.tp1, self.tp2 = tp1, tp2

    @staticmethod
    def inits(hidden: int, ffn: int, std: float, residual_std: float) -> dict[str, ParamInit]:
        """Its unsharded parameters (as :meth:`modelling.layers.FeedForward.inits`)."""
        return {
            "gate_up.weight": ParamInit((2 * ffn, hidden), NORMAL, std),
            "gate_up.bias": ParamInit((2 * ffn,), ZEROS),
            "down.weight": ParamInit((hidden, ffn), NORMAL, residual_std),
            "down.bias": ParamInit((hidden,), ZEROS),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(copy_to(x, self.tp1)).chunk(2, dim=-1)
        return self.down(copy_to(F.silu(gate) * up, self.tp2))

"""Dropout whose masks are pure functions of explicit seeds.

The phased engine recomputes each layer in its backward and must draw the forward's masks
again, so no mask comes from the global random stream: a residual or embedding mask from a
generator of its own (:func:`keep_mask`), attention's from the device's default generator
seeded for the call and restored after it (:func:`fused_attention_with_dropout`).

A compiled block (``--compile``) is given its seeds as 0-d int64 tensors, not integers:
Dynamo would specialise its graph on each integer and compile it again for every layer and
micro-batch. A tensor seed draws its mask through one custom op (``phased::keep_mask``) that
the graph keeps whole, the same draw as :func:`keep_mask`; attention's seeded kernel is one
op of the graph too where the kernel the block was built with has that op
(:mod:`execution.engine.phases.seeded_attention`), and elsewhere runs outside the graph
(:func:`seeded_attention`, a graph break), as eager runs it. So a compiled block draws exactly
eager's masks, without inductor's own random numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from modelling.parallel import LOCAL, Axis

Seed = int | torch.Tensor  # a tensor: a compiled block's (module docstring)


class BlockSeeds(NamedTuple):
    """Dropout seeds of one decoder layer on one micro-batch.

    ``attention`` masks attention probabilities, which are sharded over tp1 and replicated over
    tp2, so it must be equal across tp2. ``attention_residual`` and ``mlp_residual`` mask the
    residual stream, sharded over tp2 and replicated over tp1, so they must be equal across tp1.
    """

    attention: Seed
    attention_residual: Seed
    mlp_residual: Seed

    def as_tensors(self) -> BlockSeeds:
        """The same seeds as 0-d int64 tensors, for a compiled block (module docstring)."""
        return BlockSeeds(*(torch.tensor(seed, dtype=torch.int64) for seed in self))


_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 finaliser over the sequence)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 1


def keep_mask(
    shape: tuple[int, ...], p: float, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Inverted-dropout multipliers of ``shape`` (0, or 1 / (1 - p) with probability 1 - p), a
    pure function of ``seed``: drawn from a generator of their own, so neither the global
    random stream nor another mask moves them. ``F.dropout`` draws the same mask from a
    generator in the same state. On the meta device (planning) the same kernels run, on no
    values: a dry run prices the draw and the scaling like any other op.
    """
    mask = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "meta":  # no generator: a meta draw has nothing to seed
        return mask.bernoulli_(1 - p).div_(1 - p)
    generator = torch.Generator(device).manual_seed(seed)
    return mask.bernoulli_(1 - p, generator=generator).div_(1 - p)


# A tensor seed's draw as one op of the dispatcher, defined on its own library rather than
# with torch.library.custom_op: a compiled graph calls it with autograd off, and custom_op's
# Python layers around the call (its autograd wrapper, redispatch, output checks) took
# the host 18 us a call, more than the draw itself (10 us). Its output has no gradient, so
# the dispatcher's own autograd fallback serves it.
_OPS = torch.library.Library("phased", "FRAGMENT")
_OPS.define(
    "keep_mask(Tensor seed, SymInt[] shape, float p, ScalarType dtype, Device device) -> Tensor"
)


def _keep_mask_of_tensor_seed(
    seed: torch.Tensor, shape: list[int], p: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """:func:`keep_mask` of a tensor seed: one op a compiled graph keeps, drawing eager's mask."""
    return keep_mask(tuple(shape), p, int(seed), dtype, device)


_OPS.impl("keep_mask", _keep_mask_of_tensor_seed, "CompositeExplicitAutograd")


@torch.library.register_fake("phased::keep_mask", lib=_OPS)
def _(seed, shape, p, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


_keep_mask_op = torch.ops.phased.keep_mask.default


def dropout(
    x: torch.Tensor, p: float, seed: Seed | None, cp: Axis = LOCAL, tp2: Axis = LOCAL
) -> torch.Tensor:
    """Inverted dropout whose mask is a pure function of ``seed`` (no-op when seed is None).

    ``x`` (B, s, h/tp2) is piece ``cp.rank`` of the sequence (dim 1) and block ``tp2.rank`` of
    the hidden size. The mask is the whole tensor's, drawn as one process draws it, and this
    rank's piece and block of it are applied: the generator's stream runs over the whole
    tensor, so a part's mask cannot be drawn alone. That costs the mask of the whole (B, S, h)
    for an instant, elementwise work far below the layer's matmuls, and buys masks that do not
    depend on the layout.
    """
    if seed is None or p == 0.0:
        return x
    B, s, h = x.shape
    shape = (B, s * cp.size, h * tp2.size)
    if isinstance(seed, torch.Tensor):
        mask = _keep_mask_op(seed, list(shape), p, x.dtype, x.device)
    else:
        mask = keep_mask(shape, p, seed, x.dtype, x.device)
    if cp.size == tp2.size == 1:  # the whole mask: no piece to cut (two ops fewer)
        return x * mask
    return x * mask[:, cp.rank * s : (cp.rank + 1) * s, tp2.rank * h : (tp2.rank + 1) * h]


@torch.compiler.disable(reason="attention's mask comes from a generator seeded for the call")
def seeded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: float,
    seed: Seed,
    first_head: int,
    parity: bool,
    sdpa: Callable[..., torch.Tensor],
    backend: SDPBackend | None = None,
) -> torch.Tensor:
    """Causal attention with dropout ``p`` on the probabilities of heads ``first_head, ...``
    (their global indices), drawn from the layer's attention ``seed``: by the fused kernel for
    the heads together, or with ``parity`` head by head as one process draws them
    (:func:`_attention_with_head_masks`), on SDPA's ``backend`` alone where one is given.
    Outside any compiled graph (module docstring)."""
    seed = int(seed)
    pinned = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
    with pinned:
        if parity:
            return _attention_with_head_masks(q, k, v, p, seed, first_head)
        return fused_attention_with_dropout(q, k, v, p, mix_seed(seed, first_head), sdpa)


def fused_attention_with_dropout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: float,
    seed: int,
    sdpa: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` (``sdpa``) with dropout ``p`` drawn from ``seed``.

    SDPA draws its mask from the default generator of the tensors' device (the flash and
    memory-efficient kernels on CUDA save the generator's position for their backward; the
    CPU's math path saves the mask). Seeding that generator, and restoring it afterwards,
    makes the mask a pure function of ``seed``: a layer recomputed in its backward phase draws
    the forward's mask, and the global random stream does not move.
    """
    if q.is_meta:  # planning: the kernel's shapes and FLOPs, no generator to seed
        return sdpa(q, k, v, dropout_p=p, is_causal=True)
    with seeded_default_generator(q.device, seed):
        return sdpa(q, k, v, dropout_p=p, is_causal=True)


@contextlib.contextmanager
def seeded_default_generator(device: torch.device, seed: int) -> Iterator[None]:
    """The default generator of ``device`` seeded with ``seed`` inside, and restored after:
    that generator's state alone is kept aside (``torch.random.fork_rng`` also copies the
    CPU's 5 KB state, and more than once each call, for a GPU's kernel that never reads it)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    else:
        generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)


def _attention_with_head_masks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: int, first_head: int
) -> torch.Tensor:
    """Causal attention of heads ``first_head, ...`` with dropout on the probabilities, each
    head's (B, S, S) mask seeded by its global index, so every layout draws the single
    process's masks.

    ``scaled_dot_product_attention`` draws one mask for all the heads it is given, so a shard's
    heads would get another layout's mask; and calling it head by head is 30 times slower to
    plan on the meta device. This is its math path written out, with the masks given.
    """
    B, heads, S, d = q.shape
    scale = math.sqrt(1.0 / math.sqrt(d))
    scores = (q * scale) @ (k * scale).transpose(-2, -1)  # (B, heads, S, S)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    mask = torch.empty_like(probs)
    # Planning (meta) needs only the shapes: one head's temporary mask stands for each.
    for n in range(1 if q.device.type == "meta" else heads):
        mask[:, n] = keep_mask((B, S, S), p, mix_seed(seed, first_head + n), probs.dtype, q.device)
    return (probs * mask) @ v

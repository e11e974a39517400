"""Which fused kernel attention runs on a GPU: chosen once, when the engine is built.

On CUDA ``scaled_dot_product_attention`` has three fused kernels: FlashAttention-2 (``flash``),
cuDNN's (``cudnn``) and the memory-efficient kernel (``efficient``). Which is fastest depends
on the GPU, the shape, the dtype and dropout, and torch's order of preference is no
measurement of them. The calibration (``execution/planning/calibration/attention.py``) times each one's
forward and backward on the device; the plan carries the kernels ranked by that time at the
run's shape, dtype and dropout (:meth:`DeviceSpec.attention_ranking
<execution.planning.device_specs.DeviceSpec.attention_ranking>`, ``EnginePlan.attention_kernels``)
and :func:`choose_attention` takes the first that passes its check on the device
(:func:`kernel_mismatch`), saying in one line each faster one it passed over and why. Without
timings the kernel is the device's and dtype's (:func:`~.recompute.attention_kernel`: flash in
16 bits, the memory-efficient kernel in float32), as before there were any. On a CPU each case
has one kernel, and it runs unpinned.

The choice is pinned (``sdpa_kernel``), so torch cannot take another behind the plan's back: on
Hopper it would prefer cuDNN's wherever the runtime cuDNN is newer than 9.15, and fall back to
the math path where the kernel cannot run. cuDNN was left out until it was measured: the plan
measured the tensors each kernel keeps for the backward on meta tensors, and only flash's and
the memory-efficient kernel's were modelled. Its meta function keeps what flash keeps (a
float32 logsumexp per query, a philox seed and offset), so it is planned as flash is. It
cannot draw dropout in steps finer than 1/16 (GPT-3's 0.1 is not one), and a compiled block
runs it between graphs where there is dropout (the seeded one-op form is flash's and the
memory-efficient kernel's); docs/measuring_speed.md has the rest.

:class:`AttentionKernel` is the one object the choice is: the engine builds its attention
modules with it (a :class:`modelling.attention_kernel.SDPAKernel`), and nothing changes them
after. It runs its kernel pinned, as one op of a compiled block's graph with dropout where that
op is eager's (``dropout_op``, :func:`compiled_attention`), and on meta tensors as
that kernel runs (``sdpa``: planning's, :meth:`AttentionKernel.on_meta`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from execution.engine.phases.compiled import attention_op_mismatch
from execution.engine.phases.recompute import SDPA_BACKENDS, attention_kernel, kernel_attention
from execution.engine.phases.seeded_attention import dropout_kernel, seeded_attention_op
from modelling.dropout import Seed, seeded_attention, seeded_default_generator

CUDA_KERNELS = tuple(SDPA_BACKENDS)  # flash, efficient, cudnn


@dataclass(frozen=True)
class AttentionKernel:
    """The kernel a rank's attention runs.

    Attributes:
        kernel: ``flash``, ``cudnn`` or ``efficient`` on CUDA; ``cpu_flash`` or ``math`` on a
            CPU.
        backend: The SDPA backend pinned (None: torch chooses, on a CPU).
        measured: Chosen by the calibration's timings (False: by the device and dtype).
        passed_over: (kernel, why) of each faster kernel whose check failed.
        sdpa: What runs SDPA in its place (None: ``F.scaled_dot_product_attention``):
            planning's op of the kernel on meta tensors (:meth:`on_meta`).
        dropout_op: With dropout, what a compiled block (tensor seeds) calls as one op of its
            graph in place of the seeded eager call, ``q, k, v, p, seed, first head ->
            attention`` (:mod:`~execution.engine.phases.seeded_attention`); None: the graph
            breaks at the eager call.
    """

    kernel: str
    backend: SDPBackend | None = None
    measured: bool = False
    passed_over: tuple[tuple[str, str], ...] = ()
    sdpa: Callable[..., torch.Tensor] | None = field(default=None, compare=False)
    dropout_op: Callable[..., torch.Tensor] | None = field(default=None, compare=False)

    @classmethod
    def on_meta(cls, kernel: str) -> AttentionKernel:
        """``kernel`` as it runs on meta and fake tensors (where SDPA itself would take the
        math path): its own op, whose outputs, saved tensors, FLOPs and bytes are the device
        kernel's (:func:`~.recompute.kernel_attention`), given to this model's attention
        alone: not another model, not ``F.scaled_dot_product_attention`` for every thread."""
        return cls(kernel, sdpa=kernel_attention(kernel))

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: Seed, first: int
    ) -> torch.Tensor:
        """Causal attention on this kernel alone (an :class:`~modelling.attention_kernel.
        SDPAKernel`): with dropout ``p`` drawn from ``seed`` for heads ``first, ...``, one op
        of a compiled block's graph where it has one, else the seeded eager call (outside any
        context: where a compiled block's graph breaks there, Dynamo cannot break one inside a
        context, it would break the caller's instead). The pin sets process-wide flags while
        it runs: one thread at a time runs a step's attention."""
        sdpa = self.sdpa or F.scaled_dot_product_attention
        if p:
            if self.dropout_op is not None and self.sdpa is None and isinstance(seed, torch.Tensor):
                return self.dropout_op(q, k, v, p, seed, first)
            return seeded_attention(q, k, v, p, seed, first, False, sdpa, self.backend)
        pinned = contextlib.nullcontext() if self.backend is None else sdpa_kernel(self.backend)
        with pinned:
            return sdpa(q, k, v, is_causal=True)

    def record(self) -> dict:
        """What a results file keeps of it."""
        passed_over = [list(pair) for pair in self.passed_over]
        return {"kernel": self.kernel, "measured": self.measured, "passed_over": passed_over}

    def describe(self) -> str:
        how = "the fastest timed that passed its check" if self.measured else "untimed"
        return f"{self.kernel} ({how})"


def choose_attention(
    device_type: str,
    dtype: torch.dtype,
    dropout: float,
    ranked: tuple[str, ...],
    check: Callable[[str], str | None],
    say: Callable[[str], None] = print,
) -> AttentionKernel:
    """The first of ``ranked`` (the kernels the calibration timed, fastest first) whose
    ``check`` gives no reason against it, each one passed over said in one line; without
    timings, or where none passes, the device's and dtype's kernel (unchecked, as before)."""
    default = attention_kernel(device_type, dropout, dtype)
    if device_type != "cuda":
        return AttentionKernel(default)
    passed_over = []
    for kernel in ranked:
        reason = check(kernel)
        if reason is None:
            return AttentionKernel(kernel, SDPA_BACKENDS[kernel], True, tuple(passed_over))
        passed_over.append((kernel, reason))
        say(f"attention: {kernel} passed over, faster but its check failed: {reason}")
    return AttentionKernel(default, SDPA_BACKENDS[default], False, tuple(passed_over))


def engine_attention(plan, shapes, layout, dtype: torch.dtype, compiled: bool) -> AttentionKernel:
    """The kernel an engine's attention runs (:func:`choose_attention`), from its plan's
    ranking; checked at one call of its own: a micro-batch's whole sequences over this rank's
    heads of the model's ``shapes`` (a tensor-parallel shard's; a context-parallel rank's
    share of them). ``layout``'s main rank says what it passed over and, where timings chose,
    what runs; ``compiled`` (blocks compiled), why attention's dropout runs between graphs
    where it does (:func:`compiled_attention`)."""
    device = layout.device
    heads = max(1, shapes.heads // shapes.tp1 // layout.cp.size)
    dropout = plan.model.dropout_prob
    check = functools.partial(
        kernel_mismatch,
        device,
        dtype,
        heads,
        shapes.head_dim,
        plan.sequence_length,
        dropout=dropout,
    )
    say = print if layout.is_main else (lambda line: None)
    ranked = plan.attention_kernels
    chosen = choose_attention(device.type, dtype, dropout, ranked, check, say)
    if ranked and device.type == "cuda":
        say(f"attention: {chosen.describe()}")
    if compiled:
        chosen, reason = compiled_attention(chosen, shapes, device, dtype)
        if reason is not None:
            say(f"--compile: attention's dropout runs between graphs ({reason})")
    return chosen


def compiled_attention(
    attention: AttentionKernel, shapes, device: torch.device, dtype: torch.dtype
) -> tuple[AttentionKernel, str | None]:
    """``attention`` for compiled blocks of ``shapes`` (this rank's shard): with dropout, run
    as one op of the block's graph where that op gives eager's numbers on ``device`` in
    ``dtype``; where it does not, its call breaks the graph as before, and the reason is
    returned (else None). Chosen before the blocks are built, which take it."""
    if not shapes.dropout_prob or shapes.dropout_parity:
        return attention, None
    heads = shapes.heads // shapes.tp1
    kernel = dropout_kernel(device.type, attention.backend, shapes.head_dim)
    if kernel is None:
        return attention, None
    on_gpu = device.type == "cuda"  # the CPU's compiled op is the tests'
    reason = attention_op_mismatch(device, dtype, heads, shapes.head_dim, kernel, compiled=on_gpu)
    if reason is not None:
        return attention, reason
    op = functools.partial(seeded_attention_op, kernel=kernel)
    return dataclasses.replace(attention, dropout_op=op), None


# A kernel's output and gradients may be at most this many times as far from float64's as
# attention written out in the same dtype is (scores, softmax and products each rounded to
# it), and at least this many roundings of the dtype, relative to the largest element.
# FlashAttention's own tests hold its 16-bit kernels to a factor of 2; in float32 the
# written-out form rounds about as seldom as a fused kernel does, and the CPU's fused kernel
# is 2.4 times as far as it in q's gradient (4.2e-7 against 1.7e-7). A wrong mask, scale or
# layout is off by a large share of the largest element (a softmax scale 10% off: 7.7e-2 in
# bfloat16, whose written-out form is 8e-3 off).
REFERENCE_FACTOR = 4
FLOOR_ROUNDINGS = 2
CHECK_SEQUENCE = 256  # the small batch's sequence (at most): its float64 reference is squared


@functools.cache
def kernel_mismatch(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    sequence: int,
    kernel: str,
    dropout: float,
) -> str | None:
    """Why ``kernel`` cannot run a rank's causal attention of ``heads`` heads of ``head_dim``
    over ``sequence`` tokens with ``dropout`` on ``device``, or None where it can: it runs
    forward and backward at that shape (a kernel refuses some sequence lengths, head sizes
    and dropout probabilities); without dropout, its output and gradients on a small batch
    are as near float64's as :data:`REFERENCE_FACTOR` allows; with dropout, its mask is the
    seed's alone (a recompute and the backward draw it again: the same seed gives the same
    numbers bit for bit, another seed others). Checked once per process and case."""
    backend = SDPA_BACKENDS.get(kernel)
    try:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            ran = _attention_and_grads(device, dtype, (1, heads, sequence, head_dim), dropout, 1)
            if not all(t.isfinite().all() for t in ran):
                return "not finite at the run's shape"
            small = (2, heads, min(sequence, CHECK_SEQUENCE), head_dim)
            reason = _numbers_mismatch(device, dtype, small)
            if reason is None and dropout:
                first, again = (
                    _attention_and_grads(device, dtype, small, dropout, 1) for _ in "12"
                )
                other = _attention_and_grads(device, dtype, small, dropout, 2)
                if not all(torch.equal(a, b) for a, b in zip(first, again, strict=True)):
                    reason = "its dropout mask is not its seed's alone"
                elif torch.equal(first[0], other[0]):
                    reason = "another seed drew the same mask"
    except Exception as error:  # any failure of the kernel means: not this one
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
    return reason


def _inputs(device, dtype, shape) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # q, k, v and the output's gradient as a block hands them over: q, k and v strided views
    # of one (B, S, 3, heads, d) tensor.
    b, h, s, d = shape
    qkv = torch.randn(b, s, 3, h, d, generator=generator).to(device, dtype)
    grad = torch.randn(shape, generator=generator).to(device, dtype)
    return [*qkv.permute(2, 0, 3, 1, 4).unbind(0), grad]


def _attention_and_grads(device, dtype, shape, dropout: float, seed: int) -> list[torch.Tensor]:
    """The kernel's output and the gradients of q, k and v, dropout drawn from ``seed``."""
    *inputs, grad = _inputs(device, dtype, shape)
    leaves = [t.detach().requires_grad_() for t in inputs]
    with seeded_default_generator(leaves[0].device, seed):
        out = F.scaled_dot_product_attention(*leaves, dropout_p=dropout, is_causal=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _written_out(q, k, v):
    """Causal attention as its formula, each op in the inputs' dtype."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def _numbers_mismatch(device, dtype, shape) -> str | None:
    """Where the kernel's output and gradients (without dropout) stray further from float64's
    than :data:`REFERENCE_FACTOR` allows; None where they do not."""
    ours = _attention_and_grads(device, dtype, shape, 0.0, 1)
    *inputs, grad = _inputs(device, dtype, shape)

    def written(work: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.detach().to(work).requires_grad_() for t in inputs]
        out = _written_out(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(work))]

    exact, rounded = written(torch.float64), written(dtype)
    eps = torch.finfo(dtype).eps
    names = ("output", "q's gradient", "k's gradient", "v's gradient")
    for name, got, near, want in zip(names, ours, rounded, exact, strict=True):
        scale = want.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        error = ((got.double() - want).abs().max() / scale).item()
        allowed = max(REFERENCE_FACTOR * ((near.double() - want).abs().max() / scale).item(), 0)
        allowed = max(allowed, FLOOR_ROUNDINGS * eps)
        if error > allowed:
            return (
                f"its {name} is {error:.1e} of the largest from float64's ({allowed:.1e} allowed)"
            )
    return None

"""Compiled parts (``--compile``): each part's computation through ``torch.compile``.

As torchtitan compiles per block, the engine compiles its stateless templates in place
(``nn.Module.compile``): the decoder block and the head. Every layer is the same block bound
to other weights (``functional_call``), and Dynamo takes parameters as inputs, so one graph
serves every layer and micro-batch. It compiles a few variants, each once, in the first step:
a forward without autograd (a forward phase, or the evaluation), one under autograd (a
recompute in the backward, or a kept forward), and the head's.

The embedding stays eager: its forward is a lookup with nothing to fuse, and inductor lowers
its backward to a zero-filled float32 copy of the whole table and a scatter into it, which
inductor's own schedule prices at four times eager's kernel (gpt3_175B_h100x256's shard:
3.9 GB more per micro-batch; execution/planning/compiled_costs.py).

What the graphs leave out runs eagerly between them, exactly as without ``--compile``:
collectives of an axis larger than one (:mod:`modelling.parallel`), and in float32 the head's
projection, whose weight's gradient is summed in place (:mod:`modelling.grad_sinks`;
:func:`~execution.engine.phases.phase_context.sinks_in_head`): the head compiles as two
graphs, its norm's and its cross-entropy's. Residual and embedding
dropout stay in the graph as one op drawing eager's mask from a tensor seed
(:meth:`BlockSeeds.as_tensors`, which :class:`~execution.engine.phases.step.Step` hands a
compiled part), and so does attention with dropout
(:mod:`~execution.engine.phases.seeded_attention`) where :func:`attention_op_mismatch` finds
the op gives eager's numbers on the device; elsewhere its call breaks the graph and runs
eagerly, seeded for the call (:mod:`modelling.dropout`).
Inductor's own random numbers are never drawn (``fallback_random`` stays on as a guard).
With dropout 0 a compiled step differs from an eager one by rounding only (fused kernels sum
in another order).

A graph inductor fails to compile is left out from then on (Dynamo compiles the calls inside
it instead, or runs them eagerly), and the run goes on
(the engine runs its phases under :func:`~utils.torch_private.eager_where_compiling_fails`;
:class:`CompileWatch` counts such frames, and the engine says so in one line).

A step after the first that compiles again is a bug (a guard that fails for every layer or
micro-batch recompiles each time): :class:`CompileWatch` counts the graphs each step compiled,
and the training loop says so in one line.
"""

from __future__ import annotations

import contextlib
import functools
import io

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from execution.engine.phases.recompute import SDPA_BACKENDS
from execution.engine.phases.seeded_attention import seeded_attention_op
from modelling.dropout import fused_attention_with_dropout, mix_seed
from modelling.gpt import HEAD, LAYERS
from utils.torch_private import dynamo_counters, forget_compiled

# Options of the inductor compile of every part: random ops keep eager's generator.
INDUCTOR_OPTIONS = {"fallback_random": True}


@functools.cache
def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run on a device of ``device_type`` in this process, or
    None when it can: a small function is compiled and run once per process (inductor needs
    a C++ compiler and Python's headers on a CPU, Triton on a GPU), and its error's first
    two lines (the backend, then what failed in it) are the reason."""
    probe = torch.compile(_probe, options=INDUCTOR_OPTIONS)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            probe(torch.ones(8, device=device_type))
    except Exception as error:  # any failure of the tool chain means: run eager
        # Dynamo's first line names the backend; the second, what failed in it.
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return " ".join(lines[:2] or [type(error).__name__])[:200]
    return None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).relu().sum()


COMPILED_PARTS = (LAYERS, HEAD)  # not the embedding (module docstring)


def compile_parts(templates: dict[str, nn.Module]) -> None:
    """Compiles the templates of :data:`COMPILED_PARTS` in place: calls (and
    ``functional_call``) run their graphs."""
    for part in COMPILED_PARTS:
        templates[part].compile(options=INDUCTOR_OPTIONS)


# The seeded attention op against eager's call: its output must be eager's bit for bit (the
# same kernel on the same generator state) and its gradients within this many units of
# rounding of the dtype, relative to the largest gradient (its backward is the kernel's own
# backward, or on the math path the same arithmetic written out: here they differ by at most
# one rounding, while a mask drawn from another seed moves them by a third of the largest).
ATTENTION_OP_ROUNDINGS = 4


@functools.cache
def attention_op_mismatch(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    kernel: str,
    compiled: bool = False,
) -> str | None:
    """Why attention with dropout cannot run as one op on ``device`` (its output or gradients
    are not eager's, or it fails), or None where it can: checked once per process and shape
    of head, on a small random batch (:data:`ATTENTION_OP_ROUNDINGS`); with ``compiled`` the
    op inside a graph inductor compiled too (on a GPU, whose kernels' random state the
    tests on a CPU never see compiled)."""
    generator = torch.Generator().manual_seed(0)
    # q, k and v as a block hands them over: strided views of one (B, S, 3, heads, d) tensor.
    qkv = torch.randn(2, 64, 3, heads, head_dim, generator=generator).to(device, dtype)
    inputs = list(qkv.permute(2, 0, 3, 1, 4).unbind(0))
    grad = torch.randn(inputs[0].shape, generator=generator).to(device, dtype)
    p, seed = 0.1, 12345
    backend = SDPA_BACKENDS.get(kernel)
    pinned = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)

    def op(q, k, v, seed_tensor):
        return seeded_attention_op(q, k, v, p, seed_tensor, 0, kernel)

    candidates = {"the op": op}
    if compiled:
        candidates["the compiled op"] = torch.compile(op, fullgraph=True, options=INDUCTOR_OPTIONS)
    try:
        with pinned:
            eager = _attention_and_grads(
                lambda q, k, v: fused_attention_with_dropout(q, k, v, p, mix_seed(seed, 0)),
                inputs,
                grad,
            )
        results = {
            name: _attention_and_grads(
                functools.partial(call, seed_tensor=torch.tensor(seed)), inputs, grad
            )
            for name, call in candidates.items()
        }
    except Exception as error:  # any failure of the op means: attention between graphs
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    finally:  # each check compiles op anew: its graphs would pile up against Dynamo's limit
        forget_compiled(op)
    names = ("output without grad", "output", "q's gradient", "k's gradient", "v's gradient")
    finfo = torch.finfo(dtype)
    for candidate, result in results.items():
        for name, got, want in zip(names, result, eager, strict=True):
            if name.startswith("output"):
                if not torch.equal(got, want):
                    return f"{candidate}'s {name} is not eager's"
                continue
            error = (got - want).abs().max() / want.abs().max().clamp_min(finfo.tiny)
            if error > ATTENTION_OP_ROUNDINGS * finfo.eps:
                return f"{candidate}'s {name} is {error:.1e} of the largest from eager's"
    return None


def _attention_and_grads(attention, inputs: list[torch.Tensor], grad: torch.Tensor) -> list:
    """attention's output without grad and with it, then the gradients of q, k and v."""
    with torch.no_grad():
        plain = attention(*inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = attention(*leaves)
    return [plain, out, *torch.autograd.grad(out, leaves, grad)]


class CompileWatch:
    """Counts the graphs Dynamo compiled (the process's count), so that a step can say how
    many it compiled, and the frames it failed to compile (under
    :func:`~utils.torch_private.eager_where_compiling_fails` they run eagerly), so that the
    run can say so."""

    def __init__(self):
        self._seen = self.total()
        self._failed = self.failures()

    @staticmethod
    def total() -> int:
        return int(dynamo_counters()["stats"]["unique_graphs"])

    @staticmethod
    def failures() -> int:
        """Frames Dynamo took on and could not compile (every other frame counts as ok)."""
        frames = dynamo_counters()["frames"]
        return int(frames["total"] - frames["ok"])

    def since_last(self) -> int:
        """Graphs compiled since the last call (or since the watch was made)."""
        now = self.total()
        compiled, self._seen = now - self._seen, now
        return compiled

    def failed_since_last(self) -> int:
        """Frames that failed to compile since the last call (or since the watch was made)."""
        now = self.failures()
        failed, self._failed = now - self._failed, now
        return failed

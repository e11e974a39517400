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
collectives of an axis larger than one (:mod:`modelling.parallel`) and attention with
dropout, seeded for the call (:mod:`modelling.dropout`). Residual and embedding dropout stay
in the graph as one op drawing eager's mask from a tensor seed (:meth:`BlockSeeds.as_tensors`,
which :class:`~execution.engine.phases.step.Step` hands a compiled part). Inductor's own random
numbers are never drawn (``fallback_random`` stays on as a guard). With dropout 0 a
compiled step differs from an eager one by rounding only (fused kernels sum in another order).

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

from modelling.gpt import HEAD, LAYERS
from utils.torch_private import dynamo_counters

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


class CompileWatch:
    """Counts the graphs Dynamo compiled (the process's count), so that a step can say how
    many it compiled."""

    def __init__(self):
        self._seen = self.total()

    @staticmethod
    def total() -> int:
        return int(dynamo_counters()["stats"]["unique_graphs"])

    def since_last(self) -> int:
        """Graphs compiled since the last call (or since the watch was made)."""
        now = self.total()
        compiled, self._seen = now - self._seen, now
        return compiled

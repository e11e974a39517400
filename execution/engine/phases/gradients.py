"""A phase's gradients: accumulated over its micro-batches, reduced over the data-parallel
replicas, added to the step's, and counted in the global norm.

A phase fills float32 accumulators of its part, one flat vector per kind, from its
micro-batches; the first micro-batch's gradients are copied in, the rest added, so no vector is
zero-filled first. The decoder layers' accumulators come from an :class:`AccumulatorPool` that
hands one layer's to the next: a step asks for a set per layer and pass, and allocating each
anew costs an allocation and, on a CPU, page faults on every page of it. The mean over replicas
(:func:`start_reduction`) is a reduce-scatter where the RTS group is the replica group, else an
all-reduce of which this rank keeps its slice; with ``--overlap_communication`` it runs behind
the next phase's compute (:class:`InFlight`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from execution.engine.storage.buffers import FlatSpec
from execution.parallel.mesh import GroupAxis, Pending
from modelling.gpt import LAYERS
from modelling.grad_sinks import GradSink
from modelling.parallel import Axis


class AccumulatorPool:
    """Float32 gradient vectors of the decoder layers, reused from one layer's backward phase
    to the next within a step (the embedding and the head run once a pass: theirs are fresh).

    With overlap a phase's reduction may still read its accumulators while the next phase
    fills its own, so the pool hands out a fresh set when none is free and takes a set back
    once its reduction has completed (:meth:`release`): two at most, as without a pool. A
    phase of another part empties it, so no idle set is held through a pass's forward or the
    head (the planner measures the working set without one).
    """

    def __init__(self, specs: dict[str, dict[str, FlatSpec]], device: torch.device):
        self.specs, self.device = specs, device
        self._free: list[dict[str, torch.Tensor]] = []

    def take(self, part: str) -> Accumulators:
        if part != LAYERS:
            self._free.clear()
        flats = self._free.pop() if self._free else None
        if flats is None:
            flats = {
                kind: torch.empty(spec.padded, dtype=torch.float32, device=self.device)
                for kind, spec in self.specs[part].items()
            }
        return Accumulators(part, flats, self.specs[part])

    def release(self, acc: Accumulators) -> None:
        if acc.part == LAYERS:
            self._free.append(acc.flats)


class Accumulators:
    """One phase's gradient vectors per kind, with named views into them."""

    def __init__(self, part: str, flats: dict[str, torch.Tensor], specs: dict[str, FlatSpec]):
        self.part, self.flats = part, flats
        self.views: dict[str, torch.Tensor] = {}
        for kind, spec in specs.items():
            self.views.update(spec.views(flats[kind]))
            flats[kind][spec.numel :].zero_()  # the padding is summed and reduced too
        self._filled: set[str] = set()
        self._sinks: dict[str, GradSink] = {}

    def sink(self, name: str) -> GradSink:
        """A sink into ``name``'s view, where the model sums its micro-batches' gradients as
        it makes them (:mod:`modelling.grad_sinks`); what autograd returns for it is dropped."""
        self._sinks[name] = GradSink(self.views[name])
        return self._sinks[name]

    def add(self, names, grads) -> None:
        """Adds one micro-batch's gradients (the first of the phase is copied in): all of
        them in one op where they are all first or all not (one call on the host, and on a
        GPU a few launches, for a layer's dozen tensors; each element's sum is the same)."""
        kept = [(n, g) for n, g in zip(names, grads, strict=True) if n not in self._sinks]
        names, grads = [n for n, _ in kept], [g for _, g in kept]
        if not names:
            return
        first = [name not in self._filled for name in names]
        if len(set(first)) != 1:
            for name, g in zip(names, grads, strict=True):
                self.add_one(name, g)
            return
        views = [self.views[name] for name in names]
        if first[0]:
            torch._foreach_copy_(views, grads)
            self._filled.update(names)
        else:
            torch._foreach_add_(views, grads)

    def add_one(self, name: str, g: torch.Tensor) -> None:
        if name in self._sinks:
            return
        if name in self._filled:
            self.views[name].add_(g)
        else:
            self.views[name].copy_(g)
            self._filled.add(name)

    def complete(self) -> None:
        """Zeroes what no micro-batch wrote (a view no gradient reached)."""
        for name, view in self.views.items():
            sunk = name in self._sinks and self._sinks[name].filled
            if name not in self._filled and not sunk:
                view.zero_()


def start_reduction(
    acc: dict[str, torch.Tensor],
    rts: dict[str, Axis],
    replicas: GroupAxis,
    dp: int,
    overlap: bool,
) -> dict[str, Callable[[], torch.Tensor]]:
    """Starts the mean over data-parallel replicas of each kind's accumulator; each returned
    function waits for it and gives this rank's RTS slice.

    Each context rank's gradient is its sequence piece's share of the sum (the loss is
    pre-divided by cp), so the sum runs over ``replicas`` (dp x cp) and the mean divides by
    ``dp`` only.
    """
    out = {}
    for kind, flat in acc.items():
        group = rts[kind]
        if group.size == replicas.size:  # the same replicas (tp1 or tp2 is 1): one collective
            pending = replicas.start_reduce_scatter(flat) if overlap else None
            pending = pending or Pending(replicas.reduce_scatter(flat))
            out[kind] = functools.partial(_mean_of, pending, dp)
        else:  # RTS group larger: all-reduce over the replicas, then keep our slice.
            pending = (
                replicas.start_all_reduce_(flat) if overlap else Pending(replicas.all_reduce_(flat))
            )
            out[kind] = functools.partial(_mean_of, pending, dp, group.size, group.rank)
    return out


def _mean_of(pending: Pending, dp: int, rts: int = 1, rank: int = 0) -> torch.Tensor:
    """A finished reduction's mean over ``dp`` replicas; after an all-reduce (the RTS group
    is larger than dp), only this rank's 1/``rts`` slice of it."""
    total = pending.wait()
    if rts > 1:
        total = total.view(rts, -1)[rank]
    return total / dp if dp > 1 else total


class InFlight:
    """Gradient reductions started and not yet added to the step's gradients.

    With overlap, a phase's reductions are completed (waited for, accumulated, counted in the
    norm) when a later phase starts its own, so each runs behind the next phase's compute, and
    at most two phases' accumulators are alive. Completion follows issue order, so the norm
    and the accumulators add up in the same order as without overlap (bitwise the same).
    Without overlap each is completed at once.
    """

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._queue: list[tuple[object, Callable[[], None]]] = []

    def add(self, phase: object, complete: Callable[[], None]) -> None:
        if not self.overlap:
            complete()
            return
        while self._queue and self._queue[0][0] is not phase:
            self._queue.pop(0)[1]()
        self._queue.append((phase, complete))

    def finish(self) -> None:
        while self._queue:
            self._queue.pop(0)[1]()

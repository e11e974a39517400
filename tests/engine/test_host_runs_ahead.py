"""No phase makes the host wait for the device: between the first phase's start and the last
phase's end the host reads no device value and synchronises no stream, so on a GPU it can queue
a phase's kernels ahead of the device, and a captured CUDA graph of a layer phase (which may hold
no host synchronisation) has nothing to trip on. The step's own synchronisations come after the
phases: the losses and the gradients' norm read, the gradient stores settled.

Two ways the host waits for a device are watched, on the CPU that runs the test:

- a read of a device value: the aten ops that copy a value out for the host to branch on
  (``.item()``, ``bool()``, ``nonzero`` and others whose result's size depends on values), seen
  by a dispatch mode on every op the phases run;
- a stream's ``synchronize`` (the host waits for a side stream's copies: an event's
  ``synchronize`` on a GPU), counted on every stream kind, inside ``late_side_streams`` (the
  CPU stand-in that defers a side stream's work until something waits for it, as a GPU's
  would run late). The stand-in also runs its queue when a collective is issued, which a GPU
  does on the stream, without the host: not counted.

Eager only: under a dispatch mode Dynamo traces the saved tensors' hooks into the compiled
regions and recompiles them each layer, so a compiled run there is not the run a user has; the
compiled regions are pure functions of their inputs, with the same engine around them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter

import pytest
import torch

from execution.engine.engine import StepHooks
from execution.engine.storage import streams
from execution.parallel.mesh import ParallelLayout
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.reference import small_config
from utils.torch_private import TorchDispatchMode

# Ops whose result the host must wait for: a value read out (item, bool, equal, allclose) or a
# size that depends on the values (nonzero, masked_select, unique).
VALUE_READS = {
    "aten._local_scalar_dense.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.allclose.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
}
OUTSIDE = "outside the phases"


class HostWaits(TorchDispatchMode):
    """Counts the waits of the thread that runs the phases for the device, by where they
    happen: the kind of the phase running (the engine's ``on_phase`` hook), or
    :data:`OUTSIDE`. A host update behind the step waits on a thread of its own, as it may."""

    def __init__(self):
        super().__init__()
        self.where, self.seen = OUTSIDE, Counter()
        self.thread = threading.get_ident()

    def on_phase(self, phase) -> None:
        self.where = OUTSIDE if phase is None else phase.kind

    def count(self, what: str) -> None:
        if threading.get_ident() == self.thread:
            self.seen[(self.where, what)] += 1

    def inside(self) -> dict:
        return {key: n for key, n in self.seen.items() if key[0] != OUTSIDE}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in VALUE_READS:
            self.count(str(func))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def watching_streams(self):
        """Every stream kind's host waits counted while it lasts."""
        patched = []
        for cls in (streams.EagerStream, streams.CudaStream, streams.LateStream):
            original = cls.synchronize

            def counted(stream, event, _original=original):
                self.count(f"{type(stream).__name__}.synchronize")
                return _original(stream, event)

            cls.synchronize = counted
            patched.append((cls, original))
        try:
            yield self
        finally:
            for cls, original in patched:
                cls.synchronize = original


def _waits(config, on_phase=None) -> HostWaits:
    """The host's waits in the second step (the first allocates and measures)."""
    with streams.late_side_streams():
        engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, 2, seed=1)
    engine.train_step(replica_batch(config, batches[0], 0), 0, 1e-3, StepHooks())
    waits = HostWaits()

    def hook(phase) -> None:
        waits.on_phase(phase)
        if on_phase is not None:
            on_phase(phase)

    with waits, waits.watching_streams():
        hooks = StepHooks(on_phase=hook)
        engine.train_step(replica_batch(config, batches[1], 0), 1, 1e-3, hooks)
    engine.finish_update()
    return waits


PLACEMENTS = {
    "resident": ("device", "device", "device"),
    "remote": ("host", "host", "host"),
    "host weights": ("host", "device", "device"),
}
CASES = [
    (recompute, placement, fixed)
    for recompute, placement in itertools.product(("full", "selective", "none"), PLACEMENTS)
    for fixed in (False, True)
    if not (fixed and placement == "host weights")
]


@pytest.mark.parametrize(("recompute", "placement", "fixed"), CASES)
def test_no_phase_waits_for_the_device(recompute, placement, fixed):
    """Each recompute mode and placement, two passes of two micro-batches, dropout's seeded
    masks on, the host update behind the next step where weights are on the host, and the
    fixed weight buffers a captured graph would replay on."""
    weights, grads, activations = PLACEMENTS[placement]
    config = small_config(
        *("--dropout_prob", "0.1", "--passes", "2", "--recompute", recompute),
        *("--weights_placement", weights, "--grads_placement", grads),
        *("--activations_placement", activations, "--overlap_update", "true"),
        *("--fixed_weight_buffers", str(fixed).lower()),
    )
    waits = _waits(config)
    assert waits.inside() == {}
    # The step's own waits come after its phases, and the probe sees them (so it could see
    # more): the losses' and the norm's reads, and gradients stored on the host settled.
    assert waits.seen[(OUTSIDE, "aten._local_scalar_dense.default")] >= 2
    assert (waits.seen[(OUTSIDE, "LateStream.synchronize")] > 0) == (grads == "host")


def test_a_read_inside_a_phase_is_seen():
    """The probe's own check: a value read as a layer forward starts is counted there."""

    def read(phase) -> None:
        if phase is not None and phase.kind == "layer_forward":
            torch.ones(1).item()

    waits = _waits(small_config("--passes", "2"), on_phase=read)
    assert waits.inside() == {("layer_forward", "aten._local_scalar_dense.default"): 4}

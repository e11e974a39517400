"""The GPU's stream ordering, applied on the CPU: copies on the side streams complete late.

On CUDA, weights loaded ahead and activations stored to the host are copied on side streams
and ordered against the compute only by the waits the state store makes. Here the side
streams are :class:`~execution.engine.storage.streams.LateStream`: their work runs only when waited
for, and their destinations hold NaN until then. Every placement, recompute mode, overlap
setting and pass count must then train bit for bit as the eager engine does (the reference),
and removing any one wait must show.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from execution.engine.storage.streams import LateStream, late_side_streams
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape
from tests.distributed import CPU, global_batches, replica_batch
from tests.reference import small_config

STEPS = 2
BASE = ["--dropout_prob", "0.1", "--global_batch_size", "4", "--micro_batch_size", "1"]


def _config(weights: str, activations: str, recompute: str, overlap: bool, passes: int):
    return small_config(
        *BASE,
        *("--weights_placement", weights, "--grads_placement", "device"),
        *("--activations_placement", activations, "--recompute", recompute),
        *("--overlap_communication", str(overlap).lower(), "--passes", str(passes)),
    )


def _train(config, late: bool) -> tuple[list[float], PhasedEngine]:
    layout = ParallelLayout.single(CPU)
    run = RunShape.of(config)
    plan, _ = plan_for_process(run, layout)
    with late_side_streams(late):
        engine = PhasedEngine(run.engine_plan(plan), layout)
    assert isinstance(engine.state.loads, LateStream) == late
    batches = global_batches(config, STEPS)
    losses = [
        engine.train_step(replica_batch(config, batches[s], 0), s, 1e-3).loss for s in range(STEPS)
    ]
    return losses, engine


COMBINATIONS = list(
    itertools.product(("device", "host"), ("device", "host"), ("full", "selective", "none"))
)


@pytest.mark.slow
@pytest.mark.parametrize(("weights", "activations", "recompute"), COMBINATIONS)
def test_late_side_streams_train_bit_for_bit_as_eager(weights, activations, recompute):
    """For each placement and recompute mode, with and without overlap, in 1 and 2 passes."""
    for overlap, passes in itertools.product((False, True), (1, 2)):
        config = _config(weights, activations, recompute, overlap, passes)
        eager, reference = _train(config, late=False)
        late, engine = _train(config, late=True)
        where = (weights, activations, recompute, overlap, passes)
        assert [x.hex() for x in late] == [x.hex() for x in eager], where
        ours, theirs = full_state(engine), full_state(reference)
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs), where
        # The stand-in really deferred what the placement moves: host weights are loaded
        # ahead, host activations stored behind, and device gradients staged for the host's
        # update of host weights (on the update's own stream).
        assert (engine.state.loads.waits > 0) == (weights == "host"), where
        assert (engine.state.stores.waits > 0) == (activations == "host"), where
        assert (engine.state.grads.staging_stream.waits > 0) == (weights == "host"), where


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_host_gradients_are_stored_late_and_read_after_their_store():
    """Gradients in host memory go there on the store stream, pass after pass; the next
    pass's accumulation and the optimizer wait for them: bitwise the eager run."""
    for weights, passes in itertools.product(("device", "host"), (1, 2)):
        config = small_config(
            *BASE,
            *("--weights_placement", weights, "--grads_placement", "host"),
            *("--activations_placement", "device", "--passes", str(passes)),
        )
        eager, reference = _train(config, late=False)
        late, engine = _train(config, late=True)
        assert [x.hex() for x in late] == [x.hex() for x in eager], (weights, passes)
        ours, theirs = full_state(engine, "grads"), full_state(reference, "grads")
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
        assert engine.state.stores.waits > 0


@pytest.mark.parametrize("stream", ["loads", "stores"])
def test_a_missing_wait_shows(monkeypatch, stream):
    """Without the wait for a side stream's copy, its destination is read while it still
    holds NaN: the loss is no longer the eager run's."""
    config = _config("host", "host", "full", overlap=True, passes=2)
    eager, _ = _train(config, late=False)
    monkeypatch.setattr(LateStream, "wait", _wait_except(stream))
    late, _ = _train(config, late=True)
    assert not math.isfinite(late[0]) and math.isfinite(eager[0])


@pytest.mark.parametrize("grads", ["host", "device"])
def test_a_missing_host_wait_shows(monkeypatch, grads):
    """Without the host's wait for the store stream, the host reads gradients (staged from
    the device for a host update, or stored to the host) before they arrive: NaN."""
    config = small_config(
        *BASE,
        *("--weights_placement", "host", "--grads_placement", grads),
        *("--activations_placement", "device", "--passes", "1"),
    )
    eager, _ = _train(config, late=False)
    monkeypatch.setattr(LateStream, "synchronize", lambda self, event: None)
    late, _ = _train(config, late=True)
    assert math.isfinite(eager[1]) and not math.isfinite(late[1])


def _wait_except(skipped: str):
    """LateStream.wait that does nothing on the store's ``skipped`` stream."""
    original = LateStream.wait

    def wait(self, event, tensors=()):
        if getattr(self, "role", None) == skipped:
            return
        original(self, event, tensors)

    return wait


def test_a_late_cuda_stream_queues_a_spin_before_each_submission(monkeypatch):
    """The GPU twin of the stand-in, with CUDA's calls recorded instead of made (no GPU here):
    each submission on a late stream queues ``torch.cuda._sleep`` on the side stream before
    its work, and an ordinary stream queues none."""
    from execution.engine.storage import streams

    calls = []

    class Recorded:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append(name)

    monkeypatch.setattr(torch.cuda, "Stream", Recorded)
    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Recorded())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(("sleep", cycles)))
    with late_side_streams():
        late = streams.side_streams(torch.device("cuda", 0))
    for stream in late:
        calls.clear()
        stream.submit(lambda: calls.append("work"))
        assert calls == ["wait_stream", ("sleep", streams.LATE_CUDA_CYCLES), "work", "record"]
    calls.clear()
    on_time, _ = streams.side_streams(torch.device("cuda", 0))
    on_time.submit(lambda: calls.append("work"))
    assert calls == ["wait_stream", "work", "record"]

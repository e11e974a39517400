"""Host-device syncs per training step, counted by the GPU's rules (tests/engine/sync_count.py): none
inside the phase loop, and as many per step whatever the micro-batches and passes."""

from __future__ import annotations

import functools

import pytest

from execution.engine.engine import StepHooks
from execution.engine.phases.bodies import BODIES
from execution.parallel.mesh import ParallelLayout
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.engine.sync_count import SyncCounter
from tests.reference import small_config

PLACEMENTS = {
    "resident": ["--placement", "resident"],
    "remote": ["--placement", "remote"],
    "host weights, device grads": ["--weights_placement", "host", "--grads_placement", "device"],
}


def _counted_step(*flags: str, bug=None) -> SyncCounter:
    config = small_config("--dropout_prob", "0.1", "--micro_batch_size", "1", *flags)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    if bug is not None:
        bug()
    batch = replica_batch(config, global_batches(config, 1)[0], 0)
    counter = SyncCounter()
    with counter:
        engine.train_step(batch, 0, 1e-3, StepHooks(on_phase=counter.on_phase))
    return counter


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_sync_in_the_phase_loop_and_as_many_per_step_at_any_batch_or_passes(placement):
    counts = []
    for micro_batches, passes in ((2, 1), (8, 1), (8, 4)):
        batch = ["--global_batch_size", str(micro_batches), "--passes", str(passes)]
        counter = _counted_step(*PLACEMENTS[placement], *batch)
        assert not counter.in_loop, (micro_batches, passes, dict(counter.in_loop))
        counts.append(counter.total)
    assert counts[0] == counts[1] == counts[2], counts
    # What remains: the gradient norm and the loss, read once the phases are done.
    assert counts[0]["item"] == 3


def test_a_sync_inside_a_phase_is_caught(monkeypatch):
    """A phase body that reads a value on the host (a bug on a GPU: the host stalls there
    every micro-batch) is counted inside the loop, once per layer forward and pass."""

    def read_in_forward(monkeypatch):
        body = BODIES["layer_forward"]

        def forward_reading_a_value(step, phase):
            step.batch.ids.sum().item()
            body(step, phase)

        monkeypatch.setitem(BODIES, "layer_forward", forward_reading_a_value)

    counter = _counted_step(
        "--global_batch_size",
        "4",
        "--passes",
        "2",
        bug=functools.partial(read_in_forward, monkeypatch),
    )
    assert counter.in_loop["item"] == 2 * 2  # 2 layers x 2 passes

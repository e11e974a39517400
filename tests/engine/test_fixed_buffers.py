"""``--fixed_weight_buffers``: every decoder layer phase computes from one of two fixed device
buffers of weights, what a captured CUDA graph needs (it replays on the addresses it was
captured with), and the run's numbers do not change.

The reference is the same run without the buffers: a load there hands a phase the buffer row
itself (weights kept on the device) or a fresh copy (weights on the host), at another address
for each layer. The copy into a fixed buffer moves the same float32 values, so losses and
every weight after the steps are equal to the bit. The planned working set grows by one
layer's gathered weights (the two buffers, less the copy a phase held without them), counted
by hand from the layer's packed shapes.
"""

from __future__ import annotations

import pytest
import torch

from execution.engine.engine import StepHooks
from execution.engine.phases.recompute import MODES
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import LAYERS
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.reference import small_config

LAYER_COUNT = 3
STEPS = 2


def _run(fixed: bool, recompute: str, placement: str):
    """Two training steps of a 3-layer model over two passes; each decoder layer load's
    (layer, addresses per kind), in order, the losses and the engine."""
    flags = ["--layers", str(LAYER_COUNT), "--recompute", recompute, "--placement", placement]
    flags += ["--passes", "2", "--fixed_weight_buffers", str(fixed).lower()]
    config = small_config(*flags)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    state, loads = engine.state, []
    load = state.load_weight_vectors

    def recorded(part, row, dtype):
        vectors = load(part, row, dtype)
        if part == LAYERS:
            loads.append((row, {kind: t.data_ptr() for kind, t in vectors.items()}))
        return vectors

    state.load_weight_vectors = recorded
    losses = []
    for step, batch in enumerate(global_batches(config, STEPS, seed=1)):
        tokens = replica_batch(config, batch, 0)
        losses.append(engine.train_step(tokens, step, 1e-3, StepHooks()).loss)
    return loads, losses, engine


def _weights(engine) -> list[torch.Tensor]:
    return [t for part in engine.state.parts.values() for t in part.weights.values()]


@pytest.mark.parametrize("placement", ["resident", "remote"])
@pytest.mark.parametrize("recompute", MODES)
def test_layers_compute_from_two_buffers_in_turn_with_the_same_numbers(recompute, placement):
    loads, losses, engine = _run(True, recompute, placement)
    # Forward 0, 1, 2 and backward 2, 1, 0 in each of two passes, each step.
    assert [row for row, _ in loads] == [0, 1, 2, 2, 1, 0] * 2 * STEPS
    buffers = engine.state.fixed.addresses()
    assert buffers[0] != buffers[1]
    assert [addresses for _, addresses in loads] == [buffers[n % 2] for n in range(len(loads))]

    reference_loads, reference_losses, reference = _run(False, recompute, placement)
    assert losses == reference_losses
    for held, expected in zip(_weights(engine), _weights(reference), strict=True):
        assert torch.equal(held, expected)
    # Without the buffers, weights kept on the device are used in place: each layer's at its
    # own row, so the address check above can fail. (A fresh copy's address is the
    # allocator's: reused by chance, never by guarantee.)
    if placement == "resident":
        first_pass = reference_loads[:LAYER_COUNT]
        assert len({tuple(a.values()) for _, a in first_pass}) == LAYER_COUNT


@pytest.mark.parametrize("placement", ["resident", "remote"])
def test_the_plan_counts_the_two_buffers(placement):
    """The planned working set is measured with every state on the host, which bounds every
    placement (execution/planning/measure.py). There a layer phase held its own weights'
    fresh copy and the next layer's, prefetched; with the buffers it holds the two buffers
    (its own and the last phase's, whose copies are dropped once in) and the next layer's
    copy: one layer's gathered weights (its packed kinds, padded, float32) more. On the
    device, weights used in place held none and now hold the two buffers, within that bound."""

    def planned(fixed: bool):
        flags = ["--layers", str(LAYER_COUNT), "--recompute", "full", "--placement", placement]
        config = small_config(*flags, "--fixed_weight_buffers", str(fixed).lower())
        return planned_engine(config, ParallelLayout.single(CPU))

    without, with_buffers = planned(False), planned(True)
    layer_bytes = 4 * sum(spec.padded for spec in without.specs[LAYERS].values())
    grown = with_buffers.memory.working_set - without.memory.working_set
    assert grown == layer_bytes

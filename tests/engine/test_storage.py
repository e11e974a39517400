"""The engine's storage alone, in one process (execution/engine/storage): a layer's weights
written into its buffers and loaded back, activations stored and fetched, gradients
accumulated pass after pass, and a host update's reading of device-kept gradients through
its staging buffers, on host and on device placements. Every move is a copy or a cast, and
every sum here a float32 sum in one order: each result is compared to the bit with what plain
torch computes from the same tensors (``torch.cat``, ``Tensor.to``, ``+``), and each move
that crosses the host link is counted in bytes.
"""

from __future__ import annotations

import pytest
import torch

from execution.engine.storage import gradient_store
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import EMBEDDING, HEAD, LAYERS
from tests.distributed import planned_engine
from tests.reference import small_config

CPU = torch.device("cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_of(*flags: str):
    """One process's engine over the small config (2 decoder layers, hidden 32)."""
    return planned_engine(small_config("--passes", "1", *flags), ParallelLayout.single(CPU))


def random_layer(engine, seed: int) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors, named as in the model, at the buffers' shapes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator)
        for spec in engine.specs[LAYERS].values()
        for name, shape in zip(spec.names, spec.shapes, strict=True)
    }


@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("weights", ["host", "device"])
def test_a_layer_s_weights_round_trip_exactly(weights, precision):
    """Written into one row of the buffers, a layer's tensors are that row's float32 vector of
    each kind (the kind's tensors flattened in order, nothing else touched); loaded back, with
    or without a prefetch, they are the tensors cast to the compute dtype, and a load from host
    memory moves exactly their bytes at that dtype."""
    engine = engine_of("--weights_placement", weights, "--precision", precision)
    state, dtype, layer = engine.state, DTYPES[precision], 1
    other_row = {k: t[0].clone() for k, t in state.parts[LAYERS].weights.items()}
    local = random_layer(engine, seed=1)
    state.write_shard(LAYERS, layer, "weights", local)

    for kind, spec in engine.specs[LAYERS].items():
        packed = torch.cat([local[name].reshape(-1) for name in spec.names])
        assert torch.equal(state.parts[LAYERS].weights[kind][layer], packed), kind
        assert torch.equal(state.parts[LAYERS].weights[kind][0], other_row[kind]), kind
    expected = {name: t.to(dtype) for name, t in local.items()}
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    for prefetched in (False, True):
        state.traffic.host_to_device = 0
        hits = state.prefetch_hits
        if prefetched:
            state.prefetch_weights(LAYERS, layer, dtype, gather=False)
        loaded = state.load_weights(LAYERS, layer, dtype)
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert loaded[name].dtype == dtype and torch.equal(loaded[name], tensor), name
        assert state.traffic.host_to_device == (nbytes if weights == "host" else 0)
        # Device weights with nothing to gather are loaded at their phase, never ahead.
        assert state.prefetch_hits == hits + (prefetched and weights == "host")
    assert state.drop_prefetched() == 0


@pytest.mark.parametrize("activations", ["host", "device"])
def test_activations_and_their_gradients_round_trip_exactly(activations):
    """Each boundary's x and dx of each entry come back as stored, whichever entries and
    boundaries were written after them (x has a row per boundary, dx two rows that the
    boundaries alternate between)."""
    engine = engine_of("--activations_placement", activations, "--recompute", "full")
    store, layers = engine.state.activations, engine.shapes.layers
    entries = range(engine.memory.micro_batches_per_pass)
    shape = (*store.layout.tokens, engine.shapes.hidden)
    generator = torch.Generator().manual_seed(2)
    xs = {
        (n, e): torch.randn(shape, generator=generator) for n in range(layers + 1) for e in entries
    }
    for (n, e), x in xs.items():
        store.store_x(n, e, x)
    for (n, e), x in xs.items():
        assert torch.equal(store.fetch_x(n, e), x), (n, e)
    dxs = {(n, e): torch.randn(shape, generator=generator) for n in (2, 1) for e in entries}
    for (n, e), dx in dxs.items():
        store.store_dx(n, e, dx)
    for (n, e), dx in dxs.items():
        assert torch.equal(store.fetch_dx(n, e), dx), (n, e)


@pytest.mark.parametrize("grads", ["host", "device"])
def test_gradients_accumulate_pass_after_pass_as_a_hand_sum(grads):
    """Three passes' gradients of one layer row: the first replaces what the row held, the
    others add to it, in pass order; after the wait for the stores in flight the buffer holds
    (g1 + g2) + g3 to the bit, and each pass's store to host memory moved the row's bytes."""
    engine = engine_of("--grads_placement", grads)
    state, layer = engine.state, 0
    generator = torch.Generator().manual_seed(3)
    passes = [
        {
            kind: torch.randn(spec.shard, generator=generator)
            for kind, spec in engine.specs[LAYERS].items()
        }
        for _ in range(3)
    ]
    for kind in passes[0]:  # a previous step's gradients, which the first pass replaces
        state.parts[LAYERS].grads[kind][layer].fill_(7.0)
    state.traffic.device_to_host = 0
    for index, shards in enumerate(passes):
        totals = state.grads.accumulate(LAYERS, layer, dict(shards), first=index == 0)
    state.grads.settle()
    nbytes = 0
    for kind, spec in engine.specs[LAYERS].items():
        expected = (passes[0][kind] + passes[1][kind]) + passes[2][kind]
        assert torch.equal(state.parts[LAYERS].grads[kind][layer], expected), kind
        assert torch.equal(totals[kind], expected), kind
        assert torch.equal(state.parts[LAYERS].grads[kind][1], torch.zeros(spec.shard)), kind
        nbytes += spec.shard * 4
    assert state.traffic.device_to_host == (3 * nbytes if grads == "host" else 0)


def test_a_host_update_reads_device_gradients_in_staged_pieces(monkeypatch):
    """Weights on the host, gradients on the device: the host update reads each row of each
    kind in pieces of at most the staging buffers' size, copied while it works on the previous
    piece. The pieces tile every row in order, each gradient piece is that slice of the
    device row, beside the same slices of the weights and both moments, and the copies move
    the gradients' bytes once."""
    monkeypatch.setattr(gradient_store, "STAGING_ELEMENTS", 1000)
    engine = engine_of("--weights_placement", "host", "--grads_placement", "device")
    state = engine.state
    assert [t.numel() for t in state.grads.staging] == [1000, 1000]
    generator = torch.Generator().manual_seed(4)
    for part in state.parts.values():
        for name in ("grads", "exp_avg", "exp_avg_sq"):
            for rows in getattr(part, name).values():
                rows.copy_(torch.randn(rows.shape, generator=generator))
    order = state.part_rows()
    state.traffic.device_to_host = 0
    read: dict[tuple, list] = {}
    for part, kind, row, piece, (w, g, m, v) in state.host_update_pieces(order):
        assert piece.stop - piece.start <= 1000
        buffers = state.parts[part]
        for tensor, name in ((w, "weights"), (m, "exp_avg"), (v, "exp_avg_sq")):
            source = getattr(buffers, name)[kind][row][piece]
            assert tensor.data_ptr() == source.data_ptr() and tensor.shape == source.shape
        read.setdefault((part, row, kind), []).append((piece, g.clone()))
    expected_rows = [(p, r, k) for p, r in order for k in engine.specs[p]]
    assert list(read) == expected_rows, "every row of every kind, in the update's order"
    nbytes = 0
    for (part, row, kind), pieces in read.items():
        shard = engine.specs[part][kind].shard
        starts = [piece.start for piece, _ in pieces]
        assert starts == list(range(0, shard, 1000)) and pieces[-1][0].stop == shard
        gathered = torch.cat([g for _, g in pieces])
        assert torch.equal(gathered, state.parts[part].grads[kind][row]), (part, row, kind)
        nbytes += shard * 4
    assert state.traffic.device_to_host == nbytes
    assert {EMBEDDING, HEAD, LAYERS} == {part for part, _, _ in read}

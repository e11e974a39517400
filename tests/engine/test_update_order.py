"""The host update behind a step writes its rows in the order the next step loads them, and
a load waits for its own row alone.

The reference for the order is the engine itself: the (part, row) of each weight load a real
step makes (``StateStore.load_weight_vectors``, which every load and prefetched load goes
through), in the order of each one's first load. A pipeline's last stage loads its layers
before the head and the word embedding tied to it; a Llama head is a part of its own. The
numbers of the overlapped update against the serial one are tests/engine/test_overlapped_update.py's.
"""

from __future__ import annotations

import shlex
import threading

import pytest
import torch

from config.loading import parse_config
from execution.engine.engine import PhasedEngine
from execution.engine.phases.bodies import BODIES
from execution.engine.phases.schedule import EMBEDDING_FORWARD
from execution.engine.storage.row_updates import RowUpdates
from execution.parallel.mesh import ParallelLayout
from tests.distributed import (
    CPU,
    engine_batch,
    global_batches,
    learning_rates,
    planned_engine,
    small_config,
)

LLAMA = (
    "--config llama_tiny --layers 3 --hidden_size 32 --heads 4 --intermediate_size 88 "
    "--sequence_length 8 --max_positional_length 8 --vocab_size 1000 --device cpu"
)


def _llama(*flags: str):
    config, _ = parse_config([*shlex.split(LLAMA), *flags])
    return config


def _orders(engine, monkeypatch) -> tuple[list, list]:
    """(the rows in the order the host update wrote them, the rows in the order the next
    step first loaded them), from two steps on meta tensors (the update runs on the calling
    thread there, between the two)."""
    written, loaded = [], []
    finished = RowUpdates.finished

    def record_written(rows, part, row):
        written.append((part, row))
        finished(rows, part, row)

    monkeypatch.setattr(RowUpdates, "finished", record_written)
    load = engine.state.load_weight_vectors

    def record_loaded(part, row, dtype):
        if (part, row) not in loaded:
            loaded.append((part, row))
        return load(part, row, dtype)

    monkeypatch.setattr(engine.state, "load_weight_vectors", record_loaded)
    plan = engine.plan
    shape = (plan.gradient_accumulation, plan.micro_batch_size, plan.sequence_length + 1)
    tokens = torch.zeros(shape, dtype=torch.long, device="meta")
    engine.train_step(tokens, 0, 1e-3)
    loaded.clear()  # the first step's, before any update
    engine.train_step(tokens, 1, 1e-3)
    return written[: len(written) // 2], loaded  # the first update's rows, the next step's


@pytest.mark.parametrize(
    "config, stage, expected",
    [
        (  # passes: every layer of the first pass's forward, then the head
            lambda: small_config("--layers", "3", "--passes", "2", "--global_batch_size", "4"),
            0,
            [("embedding", 0), ("layers", 0), ("layers", 1), ("layers", 2), ("head", 0)],
        ),
        (  # the last of two stages: its layers, then the head with the tied word embedding
            lambda: small_config("--layers", "3", "--pipeline_parallel", "2"),
            1,
            [("layers", 0), ("head", 0), ("embedding", 0)],
        ),
        (  # the first of two stages: the embedding, then its layers
            lambda: small_config("--layers", "3", "--pipeline_parallel", "2"),
            0,
            [("embedding", 0), ("layers", 0), ("layers", 1)],
        ),
        (  # an untied head (Llama): a part of its own, loaded after the last layer
            lambda: _llama("--passes", "2", "--global_batch_size", "4", "--micro_batch_size", "2"),
            0,
            [("embedding", 0), ("layers", 0), ("layers", 1), ("layers", 2), ("head", 0)],
        ),
    ],
    ids=["passes", "last-stage", "first-stage", "untied-head"],
)
def test_the_update_writes_rows_in_the_order_the_next_step_loads_them(
    config, stage, expected, monkeypatch
):
    config = config()
    config.execution.weights_placement = "host"
    pp = config.execution.pipeline_parallel
    # Planned for this stage's rank on the CPU, run on meta tensors (a pipeline's links
    # only shape what they would send there).
    planned = planned_engine(config, ParallelLayout.shapes_only(1, 1, 1, CPU, pp=pp, stage=stage))
    engine = PhasedEngine(planned.plan, ParallelLayout.shapes_only(1, 1, 1, pp=pp, stage=stage))
    assert engine.state.places["weights"].remote
    written, loaded = _orders(engine, monkeypatch)
    assert loaded == expected  # the engine's own loads (the reference)
    assert written == loaded


def test_a_load_waits_for_its_own_row_alone(monkeypatch):
    """The update writes the embedding, then is held at the first layer until the main
    thread waits for that layer: the next step's first phase (the embedding's forward) must
    have run by then. Before, the first phase's prefetch of the next layer waited for it
    before the phase ran. Prefetch on, one process: no collective orders the prefetches."""
    config = small_config("--layers", "2", "--overlap_update", "true", "--prefetch", "true")
    config.execution.weights_placement = "host"
    engine = planned_engine(config, ParallelLayout.single(CPU))
    assert engine.plan.prefetch and engine.overlaps_update
    release, events = threading.Event(), []
    refresh = engine.state.refresh_weight_copy

    def hold_the_first_layer(part, kind, row, piece):
        if (part, row) == ("layers", 0):
            release.wait(timeout=10.0)
        refresh(part, kind, row, piece)

    wait = RowUpdates.wait

    def waits_release(rows, part, row):
        if rows.pending(part, row):
            events.append(("waits for", part, row))
            if (part, row) == ("layers", 0):
                release.set()
        wait(rows, part, row)

    body = BODIES[EMBEDDING_FORWARD]

    def embedding_forward(run, phase):
        body(run, phase)
        events.append(("ran", EMBEDDING_FORWARD))

    batches = global_batches(config, 2)
    lrs = learning_rates(2)
    # Held from before the first step: its update starts on its own thread as the step ends,
    # and on a loaded machine had written the first layer before a hold set after the step.
    engine.state.refresh_weight_copy = hold_the_first_layer
    engine.train_step(engine_batch(engine, batches[0], 0), 0, lrs[0])
    events.clear()
    monkeypatch.setattr(RowUpdates, "wait", waits_release)
    monkeypatch.setitem(BODIES, EMBEDDING_FORWARD, embedding_forward)
    engine.train_step(engine_batch(engine, batches[1], 0), 1, lrs[1])
    behind = engine.optimizer.behind  # the update that ran behind this step, clocked
    engine.finish_update()
    ran = events.index(("ran", EMBEDDING_FORWARD))
    assert ("waits for", "layers", 0) in events[ran:], events  # after the phase, not before
    assert [(r["part"], r["row"]) for r in behind] == engine.optimizer.order
    waits = {(r["part"], r["row"]): r["waited_s"] for r in behind}
    assert waits[("layers", 0)] > 0  # its own load, after the first phase, did wait for it
    assert all(r["written_s"] is not None for r in behind)

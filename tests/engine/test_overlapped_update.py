"""``--overlap_update``: a step's host AdamW runs behind the next step, and the numbers are the
serial update's, bitwise.

The reference is the same engine with the update run to its end before ``train_step``
returns. The update is slowed (each shard's AdamW sleeps first, on the update's thread), so
that the next step really starts while it runs: the checks see the next step's first load
wait for its row, and every reader of all the rows (a checkpoint, an evaluation, RigL, the
end of the run, an interrupt) meet an update still in flight unless it waits.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from pathlib import Path

import pytest
import torch

import run_pretraining
from execution.checkpoint.load import read_weights
from execution.checkpoint.logical import full_state
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import StepHooks
from execution.engine.update import optimizer
from execution.parallel.mesh import ParallelLayout
from tests.distributed import (
    CPU,
    engine_batch,
    global_batches,
    learning_rates,
    planned_engine,
    run_ranks,
    small_config,
    with_execution,
)

STEPS = 4
STATES = ("weights", "exp_avg", "exp_avg_sq")
SLOW_S = 0.01  # each shard's update sleeps this long first


class SlowUpdates:
    """Wraps the shard update: it waits for ``gate`` (open unless a test holds it) and sleeps
    first, and counts the updates begun and ended."""

    def __init__(self, update):
        self.update, self.begun, self.ended = update, 0, 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.begun += 1
        self.gate.wait()
        time.sleep(SLOW_S)
        self.update(*args, **kwargs)
        with self.lock:
            self.ended += 1


@pytest.fixture
def slow_updates(monkeypatch):
    slow = SlowUpdates(optimizer.adamw_)
    monkeypatch.setattr(optimizer, "adamw_", slow)
    return slow


def _engine(*flags: str, overlap: bool, **execution):
    config = with_execution(small_config(*flags), **execution)
    config.execution.overlap_update = "true" if overlap else "false"
    return config, planned_engine(config, ParallelLayout.single(CPU))


def _states(engine) -> dict:
    engine.finish_update()
    return {state: full_state(engine, state) for state in STATES}


def _assert_same(ours: dict, theirs: dict) -> None:
    for state, tensors in theirs.items():
        for name, tensor in tensors.items():
            assert torch.equal(ours[state][name], tensor), f"{state} {name}"


def _train(engine, batches, dp_rank: int = 0, hooks=None) -> list[float]:
    lrs = learning_rates(len(batches))
    return [
        engine.train_step(engine_batch(engine, batches[s], dp_rank), s, lrs[s], hooks).loss
        for s in range(len(batches))
    ]


RIGL = ("--sparsity", "0.5", "--rigl_every", "2", "--rigl_end_fraction", "1")


@pytest.mark.parametrize(
    "flags, placement, behind",
    [
        ((), "remote", [True] * (STEPS - 1)),
        # Device weights are updated on the device, in stream order: nothing runs behind.
        ((), "resident", [False] * (STEPS - 1)),
        (("--grads_placement", "device"), "remote", [True] * (STEPS - 1)),  # staged gradients
        # A connectivity update (after the second step) reads every row: it waits.
        (RIGL, "remote", [True, False, True]),
    ],
    ids=["streamed", "resident", "staged-gradients", "rigl"],
)
def test_the_overlapped_update_is_bitwise_the_serial_one(slow_updates, flags, placement, behind):
    flags = (*flags, "--dropout_prob", "0.1", "--steps", str(STEPS))
    config, serial = _engine(*flags, overlap=False, placement=placement)
    batches = global_batches(config, STEPS)
    expected = _train(serial, batches)
    _, overlapped = _engine(*flags, overlap=True, placement=placement)
    # The update is held until the next step's first phase has begun: that phase finds it
    # still running, and its loads wait for it.
    running = []

    def first_phase(phase):
        if phase is not None and not slow_updates.gate.is_set():
            running.append(overlapped.optimizer._in_flight is not None)
            slow_updates.gate.set()

    hooks = StepHooks(on_phase=first_phase)
    lrs = learning_rates(STEPS)
    losses = []
    for step in range(STEPS):
        batch = engine_batch(overlapped, batches[step], 0)
        losses.append(overlapped.train_step(batch, step, lrs[step], hooks).loss)
        slow_updates.gate.clear()
    slow_updates.gate.set()
    assert losses == expected
    _assert_same(_states(overlapped), _states(serial))
    assert running == behind


def _dp_ranks(overlap: bool) -> tuple[list[float], dict]:
    config, engine = _distributed_engine(overlap)
    losses = _train(engine, global_batches(config, STEPS), dp_rank=engine.layout.dp.rank)
    return losses, _states(engine)


def _distributed_engine(overlap: bool):
    flags = ("--data_parallel", "2", "--dropout_prob", "0.1", "--steps", str(STEPS))
    config = with_execution(small_config(*flags), placement="remote")
    config.execution.overlap_update = "true" if overlap else "false"
    layout = ParallelLayout.build(2, 1, 1, CPU)
    return config, planned_engine(config, layout)


def test_the_overlapped_update_is_bitwise_the_serial_one_at_dp_2(tmp_path):
    (tmp_path / "serial").mkdir()
    (tmp_path / "overlapped").mkdir()
    (serial, serial_states), _ = run_ranks(_dp_ranks, 2, tmp_path / "serial", False)
    for losses, states in run_ranks(_dp_ranks, 2, tmp_path / "overlapped", True):
        assert losses == serial
        _assert_same(states, serial_states)


def test_a_checkpoint_and_an_evaluation_wait_for_the_update(slow_updates, tmp_path):
    config, serial = _engine(overlap=False, placement="remote")
    batches = global_batches(config, 2)
    _train(serial, batches)
    evaluation = [engine_batch(serial, batches[0], 0)[0]]
    expected_loss = serial.evaluate(evaluation)
    _, overlapped = _engine(overlap=True, placement="remote")
    _train(overlapped, batches)
    checkpointer = Checkpointer(tmp_path, overlapped, config, keep=1, log=lambda _: None)
    assert overlapped.optimizer._in_flight is not None  # the last step's update runs
    checkpointer.save(2, None)
    checkpointer.close()
    _, saved = read_weights(tmp_path)
    expected = full_state(serial)
    assert all(torch.equal(saved[name], expected[name]) for name in expected)
    _train(overlapped, batches[:1])  # another update in flight
    _train(serial, batches[:1])
    assert overlapped.evaluate(evaluation) == serial.evaluate(evaluation) != expected_loss


SMALL_RUN = (
    "--config tiny --layers 2 --hidden_size 32 --heads 2 --sequence_length 16 "
    "--global_batch_size 4 --micro_batch_size 2 --device cpu --placement remote "
    "--overlap_update true --log_every 100 --eval_every 0"
)


def _run(tmp_path: Path, name: str, *flags: str) -> Path:
    out = tmp_path / name
    run_pretraining.main([*shlex.split(SMALL_RUN), "--output_dir", str(out), *flags])
    return out


def test_the_end_of_a_run_waits_for_the_update(slow_updates, tmp_path):
    _run(tmp_path, "whole", "--steps", "3")  # no checkpoint: only the end waits
    assert slow_updates.ended == slow_updates.begun > 0  # nothing runs past the run


def test_an_interrupt_waits_for_the_update(slow_updates, tmp_path, monkeypatch):
    from execution.training import loop

    def interrupt_at_step_3(step, *args):
        if step == 2:
            raise KeyboardInterrupt
        return learning_rate(step, *args)

    learning_rate = loop.learning_rate
    monkeypatch.setattr(loop, "learning_rate", interrupt_at_step_3)
    with pytest.raises(loop.Interrupted, match="interrupted at step 2"):
        _run(tmp_path, "interrupted", "--steps", "5", "--save", str(tmp_path / "ckpt"))
    assert slow_updates.ended == slow_updates.begun > 0
    lines = (tmp_path / "interrupted" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]

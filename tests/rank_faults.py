"""Test-only faults of one rank in the middle of a step: killed, or stalled; and of every rank's
saves: each commit held back a while (``slow_commits``), so a test can stop a run while it
writes a checkpoint.

No flag or environment variable of the program exposes them. A test installs one in a process
it runs itself (:func:`install`), or starts the job through ``tests/fixtures/run_with_fault.py``,
which installs the fault its first argument names and then runs the entry script as
``python SCRIPT FLAGS...`` would (under torchrun, in every worker).

The fault strikes as the step's third phase starts (the head, with one decoder layer): the
ranks have run collectives of the step, and more are to come. A kill first waits until the
run's last checkpoint is committed (rank 0 commits it in the background while this rank
trains on), so that which checkpoint a restart finds does not depend on how fast a busy
machine wrote it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time
from dataclasses import dataclass

from execution.checkpoint.commit import SaveFolder
from execution.checkpoint.files import LATEST_FILE
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import PhasedEngine, StepHooks

STRIKES_AT_PHASE = 2  # 0-based
COMMIT_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Fault:
    """``kill``: SIGKILL rank ``rank`` mid-step ``step`` (1-based); ``stall``: it sleeps
    ``seconds`` there, then goes on; ``slow_commits``: every save waits ``seconds`` after
    writing, before it commits (``rank`` and ``step`` unused)."""

    kind: str
    rank: int
    step: int
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.step}:{self.seconds:g}"

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, rank, step, seconds = text.split(":")
        assert kind in ("kill", "stall", "slow_commits"), text
        return cls(kind, int(rank), int(step), float(seconds))


def install(fault: Fault) -> None:
    """Makes this process's engine strike ``fault`` when it runs that rank's step (or its
    saves commit late)."""
    if fault.kind == "slow_commits":
        commit = SaveFolder.commit

        def slow_commit(folder, tmp, final):
            time.sleep(fault.seconds)
            commit(folder, tmp, final)

        SaveFolder.commit = slow_commit
        return
    train_step, save = PhasedEngine.train_step, Checkpointer.save
    saved: list[tuple[Checkpointer, int]] = []  # this process's saves, the last one last

    def faulty_train_step(engine, tokens, step, lr, hooks=None):
        if step + 1 == fault.step and engine.layout.rank == fault.rank:
            hooks = _striking(hooks or StepHooks(), fault, saved)
        return train_step(engine, tokens, step, lr, hooks)

    def recorded_save(checkpointer, step, loader_state):
        saved.append((checkpointer, step))
        return save(checkpointer, step, loader_state)

    PhasedEngine.train_step, Checkpointer.save = faulty_train_step, recorded_save


def _striking(hooks: StepHooks, fault: Fault, saved: list) -> StepHooks:
    phases = itertools.count()

    def on_phase(phase) -> None:
        if hooks.on_phase is not None:
            hooks.on_phase(phase)
        if next(phases) != STRIKES_AT_PHASE:
            return
        if fault.kind == "kill":
            if saved:
                _wait_for_commit(*saved[-1])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(fault.seconds)

    return dataclasses.replace(hooks, on_phase=on_phase)


def _wait_for_commit(checkpointer: Checkpointer, step: int) -> None:
    latest = checkpointer.directory / LATEST_FILE
    deadline = time.monotonic() + COMMIT_DEADLINE_S
    while time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() == f"step_{step}":
            return
        time.sleep(0.01)
    raise AssertionError(f"step {step} was not committed in {checkpointer.directory}")

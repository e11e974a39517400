"""An update running on the host behind the next step, row by row.

With ``--overlap_update`` the host's AdamW of step t runs on a thread of its own while step
t+1 begins (:class:`~execution.engine.update.optimizer.AdamWDriver`). It updates the rows in
the order the next step first loads them (the embedding, each decoder layer, the head), and
marks each row as it finishes; a load of a row waits for that row alone
(:class:`RowUpdates`), so the next step's first phases run while the later rows update.
Whatever reads every row (a checkpoint, an evaluation, RigL, the end of the run) waits for the
whole update first.

Each row's end and each wait are clocked (:meth:`RowUpdates.report`): what the next GPU run's
phase clock prints, row by row, to say whether a load waited for its own row's update or for
the update's pace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


class UpdateFailed(RuntimeError):
    """The update running behind the step raised; the step that waited for it cannot go on."""


class RowUpdates:
    """The (part, row) pairs of one update in flight, each marked when its update is done.

    Args:
        rows: Every (part, row) the update changes.
    """

    def __init__(self, rows: Iterable[tuple[str, int]]):
        self._done = {row: threading.Event() for row in rows}
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        self._written: dict[tuple[str, int], float] = {}  # seconds after the start
        self._waited: dict[tuple[str, int], float] = {}  # seconds loads blocked, summed

    def finished(self, part: str, row: int) -> None:
        """The update of (part, row) is complete: its weights, moments and compute-dtype copy
        are written and its gradient is read."""
        self._written[(part, row)] = time.perf_counter() - self._started
        self._done[(part, row)].set()

    def pending(self, part: str, row: int) -> bool:
        """Whether a wait for (part, row) would block now (its update not yet written)."""
        event = self._done.get((part, row))
        return event is not None and not event.is_set()

    def failed(self, error: BaseException) -> None:
        """The update raised: every waiter is released, and each raises."""
        self._error = error
        for event in self._done.values():
            event.set()

    def wait(self, part: str, row: int) -> None:
        """Returns once (part, row) is updated; raises :class:`UpdateFailed` if the update
        raised."""
        event = self._done.get((part, row))
        if event is not None and not event.is_set():
            started = time.perf_counter()
            event.wait()
            waited = time.perf_counter() - started
            self._waited[(part, row)] = self._waited.get((part, row), 0.0) + waited
        self._raise_if_failed()

    def wait_all(self) -> None:
        for event in self._done.values():
            event.wait()
        self._raise_if_failed()

    def report(self) -> list[dict]:
        """Each row in the update's order: ``part``, ``row``, ``written_s`` (seconds from the
        update's start to the row's end; None if it never ended) and ``waited_s`` (how long
        loads, or their prefetches, blocked on it)."""
        return [
            {
                "part": part,
                "row": row,
                "written_s": self._written.get((part, row)),
                "waited_s": self._waited.get((part, row), 0.0),
            }
            for part, row in self._done
        ]

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise UpdateFailed(f"the host update behind the step failed: {self._error}") from (
                self._error
            )

"""An update running on the host behind the next step, row by row.

With ``--overlap_update`` the host's AdamW of step t runs on a thread of its own while step
t+1 begins (:class:`~execution.engine.update.optimizer.AdamWDriver`). It updates the rows in
the order the next step first loads them (the embedding, each decoder layer, the head), and
marks each row as it finishes; a load of a row waits for that row alone
(:class:`RowUpdates`), so the next step's first phases run while the later rows update.
Whatever reads every row (a checkpoint, an evaluation, RigL, the end of the run) waits for the
whole update first.
"""

from __future__ import annotations

import threading
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

    def finished(self, part: str, row: int) -> None:
        """The update of (part, row) is complete: its weights, moments and compute-dtype copy
        are written and its gradient is read."""
        self._done[(part, row)].set()

    def failed(self, error: BaseException) -> None:
        """The update raised: every waiter is released, and each raises."""
        self._error = error
        for event in self._done.values():
            event.set()

    def wait(self, part: str, row: int) -> None:
        """Returns once (part, row) is updated; raises :class:`UpdateFailed` if the update
        raised."""
        event = self._done.get((part, row))
        if event is not None:
            event.wait()
        self._raise_if_failed()

    def wait_all(self) -> None:
        for event in self._done.values():
            event.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise UpdateFailed(f"the host update behind the step failed: {self._error}") from (
                self._error
            )

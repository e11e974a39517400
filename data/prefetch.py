"""Reads the next training batches on a background thread while the current step computes.

:class:`PrefetchingLoader` wraps any loader with ``next_batch()`` (and, optionally,
``state_dict()`` / ``load_state_dict()`` / ``epoch`` / ``skipped_records``, as
:class:`data.loader.PretrainingDataLoader` has). One worker thread calls the wrapped loader; the
training thread never touches it while a read may be running, so the wrapped loader needs no
locking. Reading a batch is file I/O, CRC checks and numpy/torch copies, which release the GIL,
so the read overlaps the step instead of stalling it.

Position semantics: the wrapped loader runs ``depth`` batches ahead, but everything the wrapper
reports describes the batches the caller has *consumed*. After ``k`` calls of ``next_batch()``,
``state_dict()``, ``epoch`` and ``skipped_records`` equal the plain loader's after ``k`` calls,
so a checkpoint saved then resumes at batch ``k`` (the prefetched batches are read again after
a resume, never lost). Each of these values is snapshotted by the worker right after it read
the batch, and becomes current when that batch is handed out.

Once wrapped, the loader belongs to the wrapper's thread: resume with the wrapper's
``load_state_dict`` (it discards what was read ahead), never the wrapped loader's.

Errors: an exception raised while reading (e.g. ``DataError`` from a corrupt record) is raised
again, as the same object, by the ``next_batch()`` call that needed that batch, not earlier.
"""

from __future__ import annotations

import collections
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Position:
    """What the wrapped loader reports after a given number of batches has been read."""

    state: dict | None
    epoch: int | None
    skipped_records: int | None


def _position_of(loader: Any) -> _Position:
    return _Position(
        loader.state_dict() if hasattr(loader, "state_dict") else None,
        getattr(loader, "epoch", None),
        getattr(loader, "skipped_records", None),
    )


class PrefetchingLoader:
    """Prefetches ``depth`` batches of ``loader`` on one background thread.

    Args:
        loader: Has ``next_batch() -> torch.Tensor``; its other position methods are optional.
        depth: Batches read ahead of the caller (1: the next step's batch).
        pin_memory: Pin each batch in page-locked host memory on the worker thread, so the
            engine's ``to(cuda, non_blocking=True)`` is an asynchronous DMA. Only useful (and only
            possible) when CUDA is available.

    Call :meth:`close` (or use it as a context manager) when done; it waits at most for the read
    in progress and never hangs on queued reads.
    """

    def __init__(self, loader: Any, depth: int = 1, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.loader = loader
        self.depth = depth
        self.pin_memory = pin_memory
        self._consumed = _position_of(loader)
        self._pending: collections.deque[futures.Future] = collections.deque()
        self._executor: futures.ThreadPoolExecutor | None = futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="batch-prefetch"
        )

    # ------------------------------------------------------------------ batches

    def _read(self) -> tuple[torch.Tensor, _Position]:
        """Worker thread: one batch of the wrapped loader and the position right after it."""
        batch = self.loader.next_batch()
        if self.pin_memory:
            batch = batch.pin_memory()
        return batch, _position_of(self.loader)

    def _fill(self) -> None:
        while len(self._pending) < self.depth:
            self._pending.append(self._executor.submit(self._read))

    def next_batch(self) -> torch.Tensor:
        """The next batch, as ``loader.next_batch()`` would return it; starts reading the ones after.

        Raises:
            Whatever the wrapped loader raised while reading this batch (the same exception).
            The reads queued behind it are dropped, so a retry reads this batch again.
        """
        if self._executor is None:
            raise RuntimeError("next_batch() on a closed PrefetchingLoader")
        self._fill()
        future = self._pending.popleft()
        try:
            batch, position = future.result()
        except BaseException:
            self._drop_pending()
            raise
        self._consumed = position
        self._fill()  # the read of the following batch overlaps the caller's step
        return batch

    def _drop_pending(self) -> None:
        """Cancels queued reads and waits for the running one, then rewinds the wrapped loader.

        Afterwards the wrapped loader is idle and positioned after the consumed batches.
        """
        for future in self._pending:
            future.cancel()
        # Waits without raising: an error in a read nobody has asked for yet is not reported.
        futures.wait(self._pending)
        read_ahead = bool(self._pending)
        self._pending.clear()
        if read_ahead and self._consumed.state is not None:
            self.loader.load_state_dict(self._consumed.state)

    # ------------------------------------------------------------------ position

    def state_dict(self) -> dict:
        """The wrapped loader's state after the batches consumed so far (not the prefetched)."""
        if self._consumed.state is None:
            raise AttributeError(f"{type(self.loader).__name__} has no state_dict()")
        return dict(self._consumed.state)

    def load_state_dict(self, state: dict) -> None:
        """Positions the wrapped loader at ``state``; batches read ahead are discarded."""
        self._drop_pending()
        self.loader.load_state_dict(state)
        self._consumed = _position_of(self.loader)

    @property
    def epoch(self) -> int | None:
        """The wrapped loader's ``epoch`` after the consumed batches."""
        return self._consumed.epoch

    @property
    def skipped_records(self) -> int | None:
        """Bad records skipped while reading the consumed batches (not the prefetched ones)."""
        return self._consumed.skipped_records

    @property
    def samples_per_epoch(self) -> int:
        return self.loader.samples_per_epoch

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stops the worker: queued reads are cancelled, a running one is waited for."""
        if self._executor is None:
            return
        self._drop_pending()
        self._executor.shutdown(wait=True)
        self._executor = None

    def __enter__(self) -> PrefetchingLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

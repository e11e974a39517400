"""Ordered, memory-bounded parallel map over worker processes, and the scripts' error exit."""

from __future__ import annotations

import multiprocessing
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from config.command_line import exit_for_bad_input
from config.errors import BadInput

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    func: Callable[[T], R],
    items: Iterable[T],
    workers: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
) -> Iterator[R]:
    """`map(func, items)` over `workers` forked processes, yielding results in input order.

    `multiprocessing.Pool.imap` reads its whole input ahead of the workers, which for a 20 GB
    corpus means 20 GB in memory; here at most `2 * workers` items are in flight.

    Args:
        func: a module-level function (it is called in the worker processes).
        items: the inputs; consumed lazily.
        workers: number of processes; 1 or fewer runs everything in this process.
        initializer: called once in each worker (and once here when `workers <= 1`).
        initargs: arguments for `initializer`.

    Yields:
        `func(item)` for each item, in order.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(func, items)
        return
    # fork: workers inherit imported modules instantly; on 2 cores a spawn start-up would cost
    # more than a small job takes.
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(func, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def run_script(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a script's `main`, turning bad input (a `DataError`, `ConfigError` or missing file)
    into one line, ``{script}: error: ...``, and exit code 2 (`exit_for_bad_input`)."""
    try:
        code = main(argv)
    except (BadInput, FileNotFoundError) as error:
        exit_for_bad_input(Path(main.__code__.co_filename).name, error)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)

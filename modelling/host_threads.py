"""A pool of host threads that each run torch's ops on one core: the pool spreads the work.

Torch parallelises an op over an OpenMP team once it is large enough (32 Ki elements for an
elementwise op), and every thread that is not OpenMP's own opens a team of its own, as large as
``torch.get_num_threads()``. A pool of such threads would run up to cores x cores threads on
the host. On two cores, two threads drew gpt3_6.7B's initial weights 1.07x as fast as one
thread did while each opened a team of two, 1.65x with teams of one
(``benchmarks/init_shard.py --model gpt3_6.7B``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def one_core_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """``workers`` threads named ``name-N``, each running torch's ops on an OpenMP team of one
    (where torch has OpenMP); the calling thread keeps its team."""
    return _team_pool(workers, name, team=1)


def team_thread(name: str, team: int) -> ThreadPoolExecutor:
    """One thread named ``name-0`` whose torch ops run on an OpenMP team of ``team``: a kernel
    torch parallelises itself (its fused AdamW) gets that many cores, whatever the process's
    own count (torchrun gives each rank one); the calling thread keeps its team."""
    return _team_pool(1, name, team=team)


def _team_pool(workers: int, name: str, team: int) -> ThreadPoolExecutor:
    set_team_size = openmp_team_setter()

    def sized_team() -> None:
        # Torch sizes a thread's team on the thread's first parallel op, from the process-wide
        # count: asked first, so that it does not undo the size set here.
        torch.get_num_threads()
        if set_team_size is not None:
            set_team_size(team)  # omp_set_num_threads acts on the calling thread only

    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=sized_team)


@functools.cache
def openmp_team_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch ships and loaded (GNU's libgomp on
    Linux, LLVM's libomp elsewhere), or None where torch has none (a build without OpenMP)."""
    libraries = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libomp*", "libiomp*"):
        for library in sorted(libraries.glob(pattern)):
            try:
                return ctypes.CDLL(str(library)).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None

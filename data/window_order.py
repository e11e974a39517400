"""The order in which training visits a set of windows, and the batch layout checks, shared by
the plain loader and the blended one (data/loader.py, data/blend.py).

Epoch ``e`` visits every window once, in a permutation seeded by ``(seed, e)`` (and the corpus'
number, for corpora after the first of a blend). Position ``p`` of the concatenated epochs is
window ``permutation(p // n)[p % n]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from data.dataset import WindowTable
from data.errors import DataError


class WindowOrder:
    """The epochs' permutations of ``num_windows`` windows.

    Args:
        num_windows: windows per epoch.
        seed: the run's seed (>= 0).
        corpus: the corpus' number in a blend; 0 draws the permutations of a plain run.
    """

    def __init__(self, num_windows: int, seed: int, corpus: int = 0):
        self.num_windows, self.seed, self.corpus = num_windows, seed, corpus
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the windows."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs in practice
                self._permutations.clear()
            key = [self.seed, epoch, *([self.corpus] if self.corpus else [])]
            self._permutations[epoch] = np.random.default_rng(key).permutation(self.num_windows)
        return self._permutations[epoch]

    def window_at(self, positions: np.ndarray) -> np.ndarray:
        """The windows at ``positions`` of the concatenated epochs."""
        n = self.num_windows
        epochs = positions // n
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self.permutation(int(epoch))[positions[mask] % n]
        return windows


def read_rows(
    table: WindowTable, positions: np.ndarray, window_at: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Read the windows at `positions` of a cyclic order; a bad window takes the next good one.

    Args:
        table: the windows.
        positions: positions in the order; position p lies in cycle `p // num_windows`.
        window_at: maps positions to window numbers.

    Returns:
        int64 array [len(positions), sequence_length + 1].
    """
    n = table.num_windows
    rows = table.read(window_at(positions))
    for i, row in enumerate(rows):
        position = int(positions[i])
        cycle_start, offset = position - position % n, position % n
        step = 1
        while row is None and step < n:  # only in skip mode: bad records give None
            substitute = cycle_start + (offset + step) % n
            row = table.read(window_at(np.array([substitute])))[0]
            step += 1
        if row is None:
            raise DataError("every window of the data set lies in a corrupt record")
        rows[i] = row
    return np.stack(rows)


def check_batch_layout(
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    seed: int,
) -> int:
    """Checks a loader's batch layout; returns the gradient accumulation it implies.

    Raises:
        DataError: a size that is not positive, a batch that does not divide, a rank outside
            the replicas, or a negative seed.
    """
    rows_per_pass = micro_batch_size * data_parallel_size
    if micro_batch_size < 1 or data_parallel_size < 1 or global_batch_size < 1:
        raise DataError(
            f"global_batch_size {global_batch_size}, micro_batch_size {micro_batch_size} and "
            f"data_parallel_size {data_parallel_size} must be positive"
        )
    if global_batch_size % rows_per_pass:
        raise DataError(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
            f"{micro_batch_size} x data_parallel {data_parallel_size} = {rows_per_pass}"
        )
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise DataError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
    if seed < 0:
        raise DataError(f"seed {seed} must be >= 0")
    return global_batch_size // rows_per_pass

"""Weighted blends of corpora: ``--data_blend "0.7 'a/*.tfrecord' 0.3 'b/*.bin'"``.

A blend is pairs of a weight and a glob (Megatron's ``--data-path 0.7 A 0.3 B``); the weights
are normalised. Each corpus is a data set of its own (TFRecords or token files, any mix), with
its own epochs: corpus ``d`` visits its windows in the permutations of ``(seed, epoch, d)``
(corpus 0 in those of a plain run, ``(seed, epoch)``).

Which corpus position ``p`` of the blended sequence draws from is an interleave fixed by the
weights, as Megatron's blends are: positions come in blocks of ``BLOCK`` whose counts per
corpus keep the running totals within a window of ``weight * positions`` (the largest corpus
takes the rounding, within one window per corpus), and inside a block each corpus' draws are
spread evenly (each corpus' j-th of c draws sits at (j + 1/2) / c of the block). So any stretch
of the sequence holds the corpora in their proportions to within a few windows, and the draws
of a batch, a resumed run's next batch and the counts drawn so far are each a function of the
position alone: resuming at any data-parallel size continues the same global batches.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence

import numpy as np
import torch

from data.dataset import WindowSet, WindowTable, split_records
from data.errors import DataError
from data.window_order import WindowOrder, check_batch_layout, read_rows

BLOCK = 4096
STATE_FORMAT = 1


def blend_words(entries: Sequence[str]) -> list[str]:
    """The words of a blend given as one string (shell-quoted) or as separate words."""
    if len(entries) != 1:
        return list(entries)
    try:
        return shlex.split(entries[0])
    except ValueError as error:
        raise DataError(f"the blend {entries[0]!r} cannot be split into words: {error}") from None


def is_blend(entries: Sequence[str]) -> bool:
    """Whether a file list is a blend: its first word is a number (a weight)."""
    try:
        words = blend_words(entries)
    except DataError:
        return False
    return bool(words) and _number(words[0]) is not None


def parse_blend(entries: Sequence[str], flag: str) -> list[tuple[float, str]]:
    """``["0.7 'a/*' 0.3 'b/*'"]`` (or the words apart) -> ``[(0.7, "a/*"), (0.3, "b/*")]``.

    Raises:
        DataError: an odd number of words, a weight that is not a positive number.
    """
    words = blend_words(entries)
    if not words or len(words) % 2:
        raise DataError(
            f"{flag} is pairs of WEIGHT GLOB, e.g. \"0.7 'a/*.tfrecord' 0.3 'b/*.bin'\"; got "
            f"{len(words)} word(s): {' '.join(words)}"
        )
    corpora = []
    for weight_text, pattern in zip(words[::2], words[1::2], strict=True):
        weight = _number(weight_text)
        if weight is None or not math.isfinite(weight) or weight <= 0:
            raise DataError(
                f"{flag}: the weight {weight_text!r} of {pattern} must be a positive number"
            )
        corpora.append((weight, pattern))
    return corpora


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class Interleave:
    """Which corpus each position of a blend draws from (see the module's docstring).

    Args:
        weights: the corpora's weights (positive; normalised here).
    """

    def __init__(self, weights: Sequence[float]):
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        # The largest corpus takes the rounding of the others, at most one window each a
        # block; a block of K * K positions holds that much of it.
        self.block = max(BLOCK, len(w) ** 2)
        self._largest = int(np.argmax(self.weights))
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def drawn_before_block(self, block: int) -> np.ndarray:
        """Windows each corpus has given in positions ``[0, block * self.block)``."""
        n = block * self.block
        counts = np.floor(self.weights * n).astype(np.int64)
        counts[self._largest] = n - (counts.sum() - counts[self._largest])
        return counts

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, that corpus' draw number) of each position of block ``block``."""
        if block not in self._cache:
            if len(self._cache) >= 2:
                self._cache.clear()
            before = self.drawn_before_block(block)
            counts = self.drawn_before_block(block + 1) - before
            corpus = np.repeat(np.arange(len(counts)), counts)
            within = np.concatenate([np.arange(c) for c in counts])
            spread = (within + 0.5) / counts[corpus]  # evenly over the block
            order = np.lexsort((corpus, spread))
            corpus = corpus[order]
            self._cache[block] = (corpus, before[corpus] + within[order])
        return self._cache[block]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, draw number within that corpus) of each position."""
        corpus = np.empty_like(positions)
        draw = np.empty_like(positions)
        blocks = positions // self.block
        for block in np.unique(blocks):
            mask = blocks == block
            corpora, draws = self._block(int(block))
            offsets = positions[mask] % self.block
            corpus[mask], draw[mask] = corpora[offsets], draws[offsets]
        return corpus, draw

    def drawn_before(self, position: int) -> np.ndarray:
        """Windows each corpus has given in positions ``[0, position)``."""
        block, offset = divmod(position, self.block)
        counts = self.drawn_before_block(block)
        corpus = self._block(block)[0][:offset]
        return counts + np.bincount(corpus, minlength=len(counts))


class BlendedDataLoader:
    """Deterministic, resumable training batches of a weighted blend, for one data-parallel rank.

    Args:
        corpora: (weight, glob) pairs (:func:`parse_blend`).
        Others: as :class:`data.loader.PretrainingDataLoader`; ``validation_fraction`` holds
            out that fraction of each corpus.

    Raises:
        DataError: bad files or records (naming them), or a batch layout that does not divide.
    """

    def __init__(
        self,
        corpora: list[tuple[float, str]],
        sequence_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
        vocab_size: int,
        skip_corrupt_records: bool = False,
        validation_fraction: float = 0.0,
    ):
        self.gradient_accumulation = check_batch_layout(
            global_batch_size, micro_batch_size, data_parallel_rank, data_parallel_size, seed
        )
        self.sequence_length = sequence_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.seed = seed
        self.corpora = corpora
        self._sets, self._tables, self._orders = [], [], []
        for number, (_, pattern) in enumerate(corpora):
            windows = WindowSet([pattern], sequence_length, vocab_size, skip_corrupt_records)
            train, _ = split_records(windows.num_records, validation_fraction)
            self._sets.append(windows)
            self._tables.append(WindowTable(windows, train))
            self._orders.append(WindowOrder(self._tables[-1].num_windows, seed, number))
        self.interleave = Interleave([weight for weight, _ in corpora])
        self.step = 0
        self._skipped_before = 0

    @property
    def samples_per_epoch(self) -> int:
        """Windows of all corpora together (each corpus has epochs of its own)."""
        return sum(t.num_windows for t in self._tables)

    @property
    def epoch(self) -> int:
        """Complete passes over the most revisited corpus before the next global batch."""
        drawn = self.interleave.drawn_before(self.step * self.global_batch_size)
        return max(int(n) // t.num_windows for n, t in zip(drawn, self._tables, strict=True))

    @property
    def skipped_records(self) -> int:
        return self._skipped_before + sum(s.skipped_records for s in self._sets)

    def describe(self) -> str:
        """The corpora, their weights and windows, for the start-up line."""
        shares = self.interleave.weights
        return "blend of " + ", ".join(
            f"[{i}] {share:.3g} x {pattern} ({table.num_windows} sequences)"
            for i, ((_, pattern), share, table) in enumerate(
                zip(self.corpora, shares, self._tables, strict=True)
            )
        )

    def windows_drawn(self, steps: int) -> dict[str, int]:
        """Windows each corpus has given to the first ``steps`` global batches (all ranks)."""
        drawn = Interleave(self.interleave.weights).drawn_before(steps * self.global_batch_size)
        return {f"windows_drawn_{i}": int(n) for i, n in enumerate(drawn)}

    def batch_positions(self, step: int) -> np.ndarray:
        rows = self.gradient_accumulation * self.micro_batch_size
        first = step * self.global_batch_size + self.data_parallel_rank * rows
        return np.arange(first, first + rows, dtype=np.int64)

    def next_batch(self) -> torch.Tensor:
        """As :meth:`data.loader.PretrainingDataLoader.next_batch`, drawn from the corpora."""
        corpus, draw = self.interleave.locate(self.batch_positions(self.step))
        rows = np.empty((len(corpus), self.sequence_length + 1), dtype=np.int64)
        for number in np.unique(corpus):
            mask = corpus == number
            table, order = self._tables[number], self._orders[number]
            rows[mask] = read_rows(table, draw[mask], order.window_at)
        self.step += 1
        shape = (self.gradient_accumulation, self.micro_batch_size, self.sequence_length + 1)
        return torch.from_numpy(rows).view(shape)

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "sequence_length": self.sequence_length,
            "blend": [
                {"weight": weight, "samples_per_epoch": t.num_windows, "data_digest": s.digest()}
                for (weight, _), t, s in zip(self.corpora, self._tables, self._sets, strict=True)
            ],
            "skipped_records": self.skipped_records,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (any data-parallel layout).

        Raises:
            DataError: the state belongs to other corpora, weights, seed or batch shape.
        """
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"data loader state has format {state.get('format')}, expected 1")
        mine = self.state_dict()
        if "blend" not in state:
            raise DataError(
                "cannot resume the data loader: the checkpoint was trained on --input_files, "
                "not on a blend; give its --input_files"
            )
        for key in ("seed", "global_batch_size", "sequence_length"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the data loader: the checkpoint has {key} {state.get(key)}, "
                    f"this run has {mine[key]}; resuming would change the batches"
                )
        if state["blend"] != mine["blend"]:
            raise DataError(
                "cannot resume the data loader: this run's blend is not the checkpoint's (other "
                "weights, corpora, files or record counts); give the saved run's --data_blend"
            )
        self.step = int(state["step"])
        self._skipped_before = int(state["skipped_records"]) - sum(
            s.skipped_records for s in self._sets
        )

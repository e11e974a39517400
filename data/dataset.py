"""The set of training windows held by a list of files, read on demand through their indices.

The files are TFRecord shards of token windows, or token files (``prefix.bin`` with its
``prefix.idx``, Megatron's indexed layout, data/indexed_tokens.py). Every record of a shard holds
the same number of token ids (the writer cuts fixed windows), read from the shard's first record. A record of `L` ids serves `(L - 1) // sequence_length` windows of
`sequence_length + 1` ids, starting every `sequence_length` ids: consecutive windows share one
boundary id, which is the last label of one window and the first input of the next, so every id
is still predicted once. That way records written for sequence length 1024 (1025 ids) serve 128,
256, 512 and 1024 without waste.

Windows are numbered record by record through the sorted file list; a `WindowTable` numbers the
windows of a subset of records (the training or the held-out validation records).

A token file is read as the records a TFRecord writer with ``--seq-length`` and ``--stride``
equal to the run's sequence length would have cut from the same stream: record k is ids
``k * s .. k * s + s`` of the file. So its windows, their numbering (and with it the shuffle,
the sharding over ranks and the resumption) and the held-out records are those of such
TFRecords, and training on either gives the same losses.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from data.errors import DataError
from data.indexed_tokens import INDEX_SUFFIX, TOKEN_SUFFIX, IndexedTokens
from data.tfrecord_io import FEATURE_NAME, RecordError, decode_example, index_path_for, read_record

INDEX_COMMAND = "python data/index_tfrecord.py"


def expand_files(patterns: Sequence[str]) -> list[str]:
    """Expand paths and glob patterns into a sorted, de-duplicated list of data files.

    Sorting makes the window numbering, and so the shuffle, independent of the order in which
    the patterns were given. Index files and `metadata.json` matched by a broad glob are ignored.
    A Megatron data set may be named by its prefix (``corpus_text_document`` for
    ``corpus_text_document.bin``), as Megatron's own flags name it.

    Raises:
        DataError: the list is empty, a pattern matches nothing, or a path does not exist.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise DataError("no input files given: the list of TFRecord files or globs is empty")
    files: set[str] = set()
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = [
                m
                for m in glob.glob(pattern, recursive=True)
                if os.path.isfile(m) and not m.endswith((".index", ".json", INDEX_SUFFIX))
            ]
            if not matches:
                raise DataError(f"input pattern {pattern} matches no files")
            files.update(os.path.abspath(m) for m in matches)
        elif os.path.isdir(pattern):
            raise DataError(
                f"input {pattern} is a folder; give its files with a glob, e.g. '{pattern}/*.tfrecord'"
            )
        elif not os.path.isfile(pattern) and os.path.isfile(pattern + TOKEN_SUFFIX):
            files.add(os.path.abspath(pattern + TOKEN_SUFFIX))
        elif not os.path.isfile(pattern):
            raise DataError(f"input file {pattern} does not exist")
        else:
            files.add(os.path.abspath(pattern))
    return sorted(files)


@dataclass
class Shard:
    """One TFRecord file: its index and the number of ids in each record."""

    path: str
    offsets: np.ndarray
    sizes: np.ndarray
    record_length: int = 0
    bad: set[int] = field(default_factory=set)  # records found corrupt (skip mode)

    @property
    def num_records(self) -> int:
        return len(self.offsets)

    def where(self, record: int) -> str:
        return f"{self.path} record {record} (byte offset {int(self.offsets[record])})"

    def opened(self):
        """The file, open for :meth:`read` (a context manager)."""
        return open(self.path, "rb")

    def read(self, file, record: int) -> np.ndarray:
        """The ids of record `record`; raises RecordError for a damaged one."""
        offset, size = int(self.offsets[record]), int(self.sizes[record])
        return decode_example(read_record(file, offset, size))


class TokenShard:
    """A token file as records of `sequence_length + 1` ids every `sequence_length` ids.

    Args:
        tokens: the file's checked index.
        sequence_length: the run's sequence length.
    """

    def __init__(self, tokens: IndexedTokens, sequence_length: int):
        self.path = tokens.path
        self.tokens = tokens
        self.stride = sequence_length
        self.record_length = sequence_length + 1
        self.num_records = max(0, (tokens.num_tokens - 1) // sequence_length)
        self.bad: set[int] = set()
        self._ids: np.ndarray | None = None

    def where(self, record: int) -> str:
        start = record * self.stride
        return f"{self.path} window {record} (tokens {start:,} to {start + self.stride:,})"

    def opened(self):
        # Mapped once: a read touches only the pages of its windows, and the map costs no
        # file handle.
        if self._ids is None:
            self._ids = self.tokens.tokens()
        return contextlib.nullcontext(self._ids)

    def read(self, ids: np.ndarray, record: int) -> np.ndarray:
        start = record * self.stride
        return np.asarray(ids[start : start + self.record_length], dtype=np.int64)


def read_index(path: str, skip_truncated: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """Read the index of TFRecord file `path` and check it against the file's size.

    Args:
        path: the TFRecord file.
        skip_truncated: drop the records a truncated file has lost instead of raising.

    Returns:
        (offsets, sizes, lost): int64 arrays with one entry per complete record, and the number
        of records lost from the end of a truncated file (only with `skip_truncated`).

    Raises:
        DataError: the index is missing, malformed or stale, or the file is truncated.
    """
    index = index_path_for(path)
    if not index.is_file():
        raise DataError(
            f"{path} has no index file {index.name}: create it with {INDEX_COMMAND} {path}"
        )
    try:
        table = np.array(index.read_text().split(), dtype=np.int64).reshape(-1, 2)
    except ValueError:
        raise DataError(
            f"{index} is not an index (lines of 'offset length'): rebuild it with {INDEX_COMMAND} {path}"
        ) from None
    offsets, sizes = table[:, 0].copy(), table[:, 1].copy()
    if len(offsets) == 0:
        raise DataError(f"{path} holds no records (its index {index.name} is empty)")
    ends = offsets + sizes
    if offsets[0] != 0 or np.any(offsets[1:] != ends[:-1]) or np.any(sizes <= 16):
        raise DataError(f"{index} is not a valid index: rebuild it with {INDEX_COMMAND} {path}")
    file_size = os.path.getsize(path)
    if ends[-1] > file_size:
        record = int(np.argmax(ends > file_size))
        if skip_truncated and record > 0:
            return offsets[:record], sizes[:record], len(offsets) - record
        raise DataError(
            f"{path} record {record} (byte offset {int(offsets[record])}) is truncated: it needs "
            f"bytes up to {int(ends[record])}, the file ends at {file_size}; the file was cut short "
            f"(re-copy it or write it again)"
        )
    if ends[-1] < file_size:
        raise DataError(
            f"{index} covers {int(ends[-1])} of the {file_size} bytes of {path}: the index is stale, "
            f"rebuild it with {INDEX_COMMAND} {path}"
        )
    return offsets, sizes, 0


class WindowSet:
    """Token windows of `sequence_length + 1` ids over the records of a list of TFRecord files.

    Args:
        input_files: TFRecord paths or glob patterns.
        sequence_length: the model's sequence length.
        vocab_size: the model's vocabulary size; every id must be below it.
        skip_corrupt_records: skip and count bad records instead of raising `DataError`.
    """

    def __init__(
        self,
        input_files: Sequence[str],
        sequence_length: int,
        vocab_size: int,
        skip_corrupt_records: bool = False,
    ):
        if sequence_length < 1 or vocab_size < 1:
            raise DataError(
                f"sequence_length {sequence_length} and vocab_size {vocab_size} must be positive"
            )
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.skip_corrupt_records = skip_corrupt_records
        files = expand_files(input_files)
        for directory in sorted({os.path.dirname(f) for f in files}):
            self._check_metadata(directory)
        self.shards: list[Shard | TokenShard] = []
        self.skipped_records = 0
        for path in files:
            if path.endswith(TOKEN_SUFFIX):
                self.shards.append(self._token_shard(path))
                continue
            offsets, sizes, lost = read_index(path, skip_corrupt_records)
            self.shards.append(Shard(path, offsets, sizes))
            self.skipped_records += lost
        for shard in self.shards:
            if isinstance(shard, Shard):
                self._set_record_length(shard)
        counts = [s.num_records for s in self.shards]
        # Flat record numbering: record r is record `record_number[r]` of shard `record_shard[r]`.
        self.record_shard = np.repeat(np.arange(len(self.shards)), counts)
        self.record_number = np.concatenate([np.arange(c) for c in counts])
        lengths = np.repeat([s.record_length for s in self.shards], counts)
        self.windows_per_record = (lengths - 1) // sequence_length

    @property
    def num_records(self) -> int:
        return len(self.record_shard)

    def digest(self) -> str:
        """A fingerprint of the data set (file names and record counts) to check resumption."""
        text = "\n".join(
            f"{os.path.basename(s.path)} {s.num_records} {s.record_length}" for s in self.shards
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _check_metadata(self, directory: str) -> None:
        """Fail early when the writer's metadata says the tokenizer's vocabulary is too large."""
        path = os.path.join(directory, "metadata.json")
        if not os.path.isfile(path):
            return
        try:
            with open(path) as file:
                vocab = int(json.load(file)["vocab_size"])
        except (ValueError, KeyError, TypeError):
            return  # not ours or damaged: the per-record id check still guards every batch
        if vocab > self.vocab_size:
            raise DataError(
                f"{path}: the data was tokenised with a vocabulary of {vocab} tokens but the model's "
                f"vocab_size is {self.vocab_size}: use the model's tokenizer or a larger vocab_size"
            )

    def _token_shard(self, path: str) -> TokenShard:
        shard = TokenShard(IndexedTokens.open(path), self.sequence_length)
        if shard.num_records == 0:
            raise DataError(
                f"{path} holds {shard.tokens.num_tokens} tokens, fewer than sequence_length + 1 "
                f"= {self.sequence_length + 1}: give more text or a smaller sequence_length"
            )
        return shard

    def _set_record_length(self, shard: Shard) -> None:
        """Take the shard's record length from its first readable record."""
        with shard.opened() as file:
            for record in range(shard.num_records):
                ids = self._read(shard, file, record, check_length=False)
                if ids is not None:
                    break
            else:
                raise DataError(f"{shard.path}: every record is corrupt")
        if len(ids) < self.sequence_length + 1:
            raise DataError(
                f"{shard.where(record)} has {len(ids)} tokens, fewer than sequence_length + 1 = "
                f"{self.sequence_length + 1}: re-run write_into_tfrecord.py with --seq-length >= "
                f"{self.sequence_length} (the model's sequence_length), or join these records "
                f"into longer ones with data/lengthen_records.py --input "
                f"{os.path.dirname(shard.path) or '.'} --output DIR --seq-length "
                f"{self.sequence_length}"
            )
        shard.record_length = len(ids)

    def _read(
        self, shard: Shard | TokenShard, file, record: int, check_length: bool = True
    ) -> np.ndarray | None:
        """Read and check one record; on a problem raise `DataError`, or count it and return None."""
        if record in shard.bad:
            return None
        try:
            ids = shard.read(file, record)
            problem = None
            if check_length and len(ids) != shard.record_length:
                problem = (
                    f"has {len(ids)} tokens but the first record of this file has {shard.record_length}; "
                    f"every record of a file must have the same length (write_into_tfrecord.py "
                    f"writes them so)"
                )
            elif len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                position = int(np.argmax((ids < 0) | (ids >= self.vocab_size)))
                problem = (
                    f"holds token id {int(ids[position])} at position {position}, outside the "
                    f"model's vocabulary [0, {self.vocab_size}): the data was tokenised with "
                    f"another tokenizer, or vocab_size is too small"
                )
        except RecordError as error:
            problem = f"is not a valid {FEATURE_NAME!r} record: {error}"
        if problem is None:
            return ids
        if not self.skip_corrupt_records:
            raise DataError(
                f"{shard.where(record)} {problem} (skip_corrupt_records skips such records)"
            )
        shard.bad.add(record)
        self.skipped_records += 1
        return None

    def read_windows(self, records: np.ndarray, windows: np.ndarray) -> list[np.ndarray | None]:
        """Read window `windows[i]` of flat record `records[i]` for every i.

        Each file is opened once per call and closed before returning, and records are read in
        file order. A bad record gives None in skip mode (and is counted once).

        Returns:
            One int64 array of `sequence_length + 1` ids per request, or None.
        """
        out: list[np.ndarray | None] = [None] * len(records)
        shard_ids = self.record_shard[records]
        seq = self.sequence_length
        for shard_id in np.unique(shard_ids):
            shard = self.shards[shard_id]
            requests = np.flatnonzero(shard_ids == shard_id)
            numbers = self.record_number[records[requests]]
            with shard.opened() as file:
                for i in requests[np.argsort(numbers, kind="stable")]:
                    record = int(self.record_number[records[i]])
                    ids = self._read(shard, file, record)
                    if ids is not None:
                        start = int(windows[i]) * seq
                        out[i] = ids[start : start + seq + 1]
        return out


class WindowTable:
    """Numbers the windows of a subset of records: window j -> (flat record, window in record).

    Args:
        window_set: the records and their window counts.
        records: sorted flat record numbers in this subset.
    """

    def __init__(self, window_set: WindowSet, records: np.ndarray):
        self.window_set = window_set
        self.records = records
        counts = window_set.windows_per_record[records]
        self.starts = np.concatenate(([0], np.cumsum(counts)))
        self.num_windows = int(self.starts[-1])

    def read(self, window_ids: np.ndarray) -> list[np.ndarray | None]:
        """Read windows by number (see `WindowSet.read_windows`)."""
        position = np.searchsorted(self.starts, window_ids, side="right") - 1
        return self.window_set.read_windows(
            self.records[position], window_ids - self.starts[position]
        )


HOLDOUT_SEED = 20240917  # fixed, so the held-out records do not change with the training seed


def split_records(num_records: int, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split flat record numbers into (training, held-out validation) records.

    Whole records are held out, so the split is the same for every sequence length. The choice
    depends only on the number of records and the fraction.

    Raises:
        DataError: the fraction is outside [0, 1) or leaves no training records.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(f"validation_fraction {validation_fraction} must be in [0, 1)")
    num_held = round(validation_fraction * num_records)
    if validation_fraction > 0:
        num_held = max(num_held, 1)
    if num_held >= num_records:
        raise DataError(
            f"validation_fraction {validation_fraction} of {num_records} records leaves no training data"
        )
    held = np.zeros(num_records, dtype=bool)
    held[np.random.default_rng(HOLDOUT_SEED).permutation(num_records)[:num_held]] = True
    return np.flatnonzero(~held), np.flatnonzero(held)

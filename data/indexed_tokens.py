"""Token files: Megatron-LM's indexed data set layout, a ``prefix.bin`` and ``prefix.idx`` pair.

``prefix.bin`` holds the token ids of every sequence (here: a document followed by its
end-of-text id), back to back, as one fixed-width integer type. ``prefix.idx`` is, little
endian:

    9 bytes  b"MMIDIDX\\x00\\x00"      magic
    uint64   1                        version
    uint8    dtype code               1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
    uint64   S                        number of sequences
    uint64   D                        number of document indices
    int32[S] sizes                    tokens per sequence
    int64[S] pointers                 byte offset of each sequence in prefix.bin
    int64[D] document indices         sequence index where each document starts, then S
    (int8[S] modes, in multimodal data sets only)

That is the layout Megatron-LM's ``indexed_dataset.py`` writes and reads (``_IndexWriter``);
Megatron is not needed to read or write it. The writer picks the narrowest width that holds the
vocabulary, as Megatron does: uint16 up to 65,536 ids, int32 above (Megatron's format has no
uint32). The loader maps ``prefix.bin`` and reads windows in place.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
TOKEN_SUFFIX, INDEX_SUFFIX = ".bin", ".idx"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_FLOAT_CODES = {6: "float64", 7: "float32"}


def token_dtype(vocab_size: int) -> type:
    """The narrowest of Megatron's types that holds ids ``0 .. vocab_size - 1``."""
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def index_path_of(bin_path: str | os.PathLike) -> Path:
    """``prefix.bin`` -> ``prefix.idx``."""
    return Path(bin_path).with_suffix(INDEX_SUFFIX)


@dataclass
class IndexedTokens:
    """The index of one token file, checked against the file.

    Attributes:
        path: the ``.bin`` file.
        dtype: its ids' type.
        sizes: tokens per sequence (int32).
        document_indices: the sequence index where each document starts, then the count.
        num_tokens: ids in the file.
    """

    path: str
    dtype: type
    sizes: np.ndarray
    document_indices: np.ndarray
    num_tokens: int

    @classmethod
    def open(cls, bin_path: str) -> IndexedTokens:
        """Reads ``prefix.idx`` and checks it against ``prefix.bin``.

        Raises:
            DataError: the index is missing, truncated or not an index, or the ``.bin`` does
                not hold what it describes; the message names the file.
        """
        index = index_path_of(bin_path)
        if not index.is_file():
            raise DataError(
                f"{bin_path} has no index {index.name} beside it: a token file is a prefix.bin "
                "and prefix.idx pair (Megatron's indexed data set, or write_into_tfrecord.py "
                "--output-format tokens); copy the .idx too"
            )
        raw = index.read_bytes()
        if len(raw) < _HEADER.size:
            raise DataError(
                f"{index} is truncated: {len(raw)} bytes, shorter than the {_HEADER.size}-byte "
                "header of an index"
            )
        magic, version, code, count, num_doc = _HEADER.unpack_from(raw)
        if magic != INDEX_MAGIC:
            raise DataError(f"{index} is not a Megatron index (it does not start with MMIDIDX)")
        if version != INDEX_VERSION:
            raise DataError(f"{index} has index version {version}; version 1 is read here")
        if code not in DTYPE_CODES:
            kind = _FLOAT_CODES.get(code, f"unknown code {code}")
            raise DataError(f"{index} says the tokens are {kind}, not integer ids")
        expected = _HEADER.size + 12 * count + 8 * num_doc
        if len(raw) < expected:
            raise DataError(
                f"{index} is truncated: its header promises {count} sequences and {num_doc} "
                f"document indices ({expected} bytes), the file has {len(raw)}; copy it again"
            )
        if len(raw) not in (expected, expected + count):  # + count: a multimodal index's modes
            raise DataError(
                f"{index} has {len(raw) - expected} bytes after the {num_doc} document indices "
                "its header promises: not an index of this layout"
            )
        sizes = np.frombuffer(raw, np.int32, count, _HEADER.size)
        pointers = np.frombuffer(raw, np.int64, count, _HEADER.size + 4 * count)
        documents = np.frombuffer(raw, np.int64, num_doc, _HEADER.size + 12 * count)
        dtype = DTYPE_CODES[code]
        return cls(
            bin_path,
            dtype,
            sizes,
            documents,
            _check(bin_path, index, sizes, pointers, documents, dtype),
        )

    def tokens(self) -> np.ndarray:
        """The file's ids, mapped (read on access, never loaded whole)."""
        if self.num_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def where(self, token: int) -> str:
        """Names token ``token`` of the file: its position and its sequence."""
        sequence = int(np.searchsorted(np.cumsum(self.sizes, dtype=np.int64), token, "right"))
        return f"{self.path} token {token:,} (sequence {sequence})"


def _check(
    bin_path: str,
    index: Path,
    sizes: np.ndarray,
    pointers: np.ndarray,
    documents: np.ndarray,
    dtype: type,
) -> int:
    """Checks the index's arrays and the ``.bin``'s size; returns the number of tokens."""
    width = np.dtype(dtype).itemsize
    if len(sizes) and sizes.min() < 0:
        raise DataError(f"{index} holds a negative sequence size: not a valid index")
    ends = np.cumsum(sizes, dtype=np.int64) * width
    starts = np.concatenate(([0], ends[:-1]))
    if not np.array_equal(pointers, starts):
        # Megatron's builder writes the sequences back to back; only that is read here.
        raise DataError(
            f"{index}: the sequences do not lie back to back from byte 0 of {Path(bin_path).name} "
            "(their pointers skip or overlap bytes); rebuild the data set with Megatron's "
            "preprocess_data.py or write_into_tfrecord.py --output-format tokens"
        )
    count = len(sizes)
    if len(documents) and (
        documents[0] != 0 or documents[-1] != count or np.any(np.diff(documents) < 0)
    ):
        raise DataError(
            f"{index}: its document indices do not run from 0 up to its {count} sequences: "
            "not a valid index"
        )
    num_bytes = int(ends[-1]) if count else 0
    actual = os.path.getsize(bin_path)
    if actual < num_bytes:
        raise DataError(
            f"{bin_path} is truncated: its index promises {num_bytes // width:,} tokens "
            f"({num_bytes:,} bytes), the file has {actual:,} bytes; copy it again"
        )
    if actual > num_bytes:
        raise DataError(
            f"{index} covers {num_bytes:,} of the {actual:,} bytes of {bin_path}: the index "
            "belongs to another file (copy the matching .idx, or write both again)"
        )
    return num_bytes // width


class IndexedTokensWriter:
    """Writes documents into ``prefix.bin`` and ``prefix.idx``, each document one sequence.

    Both are written under temporary names and renamed into place by :meth:`close`, the index
    last, so a crash or an error (:meth:`abort`) leaves neither behind.

    Args:
        bin_path: the ``.bin`` to create.
        dtype: the ids' type (:func:`token_dtype`).
    """

    def __init__(self, bin_path: Path, dtype: type):
        self.path = Path(bin_path)
        self.dtype = dtype
        self._temporary = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self._file = open(self._temporary, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._sizes: list[np.ndarray] = []
        self.num_tokens = 0

    def write(self, ids: np.ndarray, sizes: np.ndarray) -> None:
        """Appends documents: ``ids`` is their ids back to back, ``sizes`` their lengths."""
        self._file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self._sizes.append(np.asarray(sizes, dtype=np.int32))
        self.num_tokens += len(ids)

    def close(self) -> int:
        """Finishes both files; returns the bytes written."""
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        width = np.dtype(self.dtype).itemsize
        pointers = np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64) * width))
        documents = np.arange(len(sizes) + 1, dtype=np.int64)  # each document one sequence
        code = next(c for c, t in DTYPE_CODES.items() if t == self.dtype)
        header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, code, len(sizes), len(documents))
        index = index_path_of(self.path)
        index_temporary = index.with_name(f".{index.name}.tmp{os.getpid()}")
        body = sizes.tobytes() + pointers[: len(sizes)].astype(np.int64).tobytes()
        index_temporary.write_bytes(header + body + documents.tobytes())
        os.replace(self._temporary, self.path)
        os.replace(index_temporary, index)
        return self.num_tokens * width + len(header) + len(body) + documents.nbytes

    def abort(self) -> None:
        """Closes and deletes what was written."""
        self._file.close()
        self._temporary.unlink(missing_ok=True)

"""TFRecord files of token windows: record framing, the `tf.train.Example` encoding and index files.

A TFRecord file is a sequence of records, each

    uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

(little endian). Here `data` is a serialized `tf.train.Example` holding one int64 feature,
`input_ids`. That protobuf is small enough to encode and decode by hand, so neither TensorFlow nor
protobuf is needed. Varints are coded with numpy, a whole record at a time, because a Python loop
over 2049 tokens per record would dominate the writer's time.

An index file has one line per record, ``"<byte offset> <byte length>"``, where the length covers
the whole framed record: the format of `tfrecord.tools.tfrecord2idx`.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from utils.checksum import crc32c

FEATURE_NAME = "input_ids"
INDEX_SUFFIX = ".index"

_HEADER = struct.Struct("<QI")  # record length, masked crc of the length
_FOOTER = struct.Struct("<I")  # masked crc of the data
_MASK_DELTA = 0xA282EAD8
# Protobuf wire types.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class RecordError(ValueError):
    """A record that cannot be read as an `input_ids` example; the caller names the file."""


def masked_crc32c(data: bytes) -> int:
    """The CRC32C of `data`, masked the way TFRecord stores it (rotated right 15 bits, plus a delta).

    Args:
        data: the bytes to checksum.

    Returns:
        The masked checksum as an unsigned 32-bit integer.
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def index_path_for(tfrecord_path: str | os.PathLike) -> Path:
    """The index file belonging to a TFRecord file: `x.tfrecord` -> `x.index`, `x` -> `x.index`."""
    path = Path(tfrecord_path)
    if path.suffix == ".tfrecord":
        return path.with_suffix(INDEX_SUFFIX)
    return path.with_name(path.name + INDEX_SUFFIX)


# ----------------------------------------------------------------------------------- varints


def _encode_varints(values: np.ndarray) -> bytes:
    """Protobuf varints of non-negative integers, concatenated."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    if values.size == 0:
        return b""
    # Number of 7-bit groups per value: 1 + how many of the thresholds 2^7, 2^14, ... it reaches.
    thresholds = np.left_shift(np.uint64(1), np.arange(7, 64, 7, dtype=np.uint64))
    num_bytes = 1 + (values[:, None] >= thresholds[None, :]).sum(axis=1)
    max_bytes = int(num_bytes.max())
    shifts = np.arange(0, 7 * max_bytes, 7, dtype=np.uint64)
    groups = (values[:, None] >> shifts[None, :]) & np.uint64(0x7F)
    position = np.arange(max_bytes)[None, :]
    continuation = (position < (num_bytes[:, None] - 1)).astype(np.uint64) << np.uint64(7)
    coded = (groups | continuation).astype(np.uint8)
    return coded[position < num_bytes[:, None]].tobytes()


def _decode_varints(data: bytes | memoryview) -> np.ndarray:
    """Decode a run of concatenated varints (a packed repeated int64 field) into int64 values."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    last = raw < 0x80
    if not last[-1]:
        raise RecordError("packed int64 list ends inside a varint")
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise RecordError("varint longer than 10 bytes")
    # Byte i of a value holds bits 7*i .. 7*i+6.
    byte_in_value = np.arange(raw.size) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << (7 * byte_in_value).astype(np.uint64)
    return np.add.reduceat(parts, starts).view(np.int64)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise RecordError("message ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise RecordError("varint longer than 10 bytes")


def _fields(data: memoryview):
    """Yield (field number, wire type, value) of one protobuf message; LEN values as memoryviews."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == _LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise RecordError("length-delimited field runs past the end of its message")
            value, pos = data[pos : pos + size], pos + size
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            if pos + size > len(data):
                raise RecordError("fixed-size field runs past the end of its message")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise RecordError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


# ------------------------------------------------------------------------ tf.train.Example


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint((field << 3) | _LEN) + _varint(len(payload)) + payload


def encode_example(token_ids: np.ndarray, feature_name: str = FEATURE_NAME) -> bytes:
    """Serialize token ids as a `tf.train.Example` with one packed Int64List feature.

    Args:
        token_ids: 1-D array of non-negative token ids.
        feature_name: the feature key.

    Returns:
        The serialized Example.
    """
    ids = np.asarray(token_ids)
    assert ids.ndim == 1 and (ids.size == 0 or ids.min() >= 0), "token ids must be non-negative"
    int64_list = _len_field(1, _encode_varints(ids))  # Int64List.value, packed
    feature = _len_field(3, int64_list)  # Feature.int64_list
    entry = _len_field(1, feature_name.encode()) + _len_field(2, feature)  # map entry key, value
    features = _len_field(1, entry)  # Features.feature
    return _len_field(1, features)  # Example.features


def decode_example(data: bytes | memoryview, feature_name: str = FEATURE_NAME) -> np.ndarray:
    """Parse a serialized `tf.train.Example` and return its int64 feature `feature_name`.

    Args:
        data: the serialized Example.
        feature_name: the feature key to return.

    Returns:
        The feature's values as an int64 array.

    Raises:
        RecordError: the bytes are not an Example, the feature is missing or is not an Int64List.
    """
    keys = []
    for field, wire, features in _fields(memoryview(data)):
        if field != 1 or wire != _LEN:
            continue
        for entry_field, entry_wire, entry in _fields(features):
            if entry_field != 1 or entry_wire != _LEN:
                continue
            key, feature = b"", None
            for f, w, value in _fields(entry):
                if f == 1 and w == _LEN:
                    key = bytes(value)
                elif f == 2 and w == _LEN:
                    feature = value
            name = key.decode("utf-8", errors="replace")
            keys.append(name)
            if name == feature_name:
                return _int64_list(feature if feature is not None else memoryview(b""), name)
    found = ", ".join(repr(k) for k in keys) or "none"
    raise RecordError(f"no feature {feature_name!r} (features found: {found})")


def _int64_list(feature: memoryview, name: str) -> np.ndarray:
    values: list[np.ndarray] = []
    for field, wire, value in _fields(feature):
        if field in (1, 2):
            raise RecordError(f"feature {name!r} is a bytes or float list, not an int64 list")
        if field != 3 or wire != _LEN:
            continue
        for f, w, v in _fields(value):
            if f != 1:
                continue
            if w == _LEN:  # packed, as every TensorFlow writer produces
                values.append(_decode_varints(v))
            elif w == _VARINT:  # unpacked: legal protobuf, rare
                values.append(np.array([v], dtype=np.uint64).view(np.int64))
    return np.concatenate(values) if values else np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------- records


def frame_record(data: bytes) -> bytes:
    """Frame serialized data as one TFRecord: length, its CRC, the data, the data's CRC."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc32c(length)) + data + _FOOTER.pack(masked_crc32c(data))
    )


def read_record(file: BinaryIO, offset: int, size: int) -> bytes:
    """Read and check one framed record whose index entry is (`offset`, `size`).

    Args:
        file: a binary file opened for reading.
        offset: byte offset of the record.
        size: byte length of the whole framed record, as in the index.

    Returns:
        The record's data (a serialized Example).

    Raises:
        RecordError: the record is truncated, disagrees with the index, or fails a CRC check.
    """
    file.seek(offset)
    raw = file.read(size)
    if len(raw) < size:
        raise RecordError(
            f"truncated: the index says {size} bytes at offset {offset}, the file has {len(raw)}"
        )
    return unframe_record(raw, offset)


def unframe_record(raw: bytes, offset: int = 0) -> bytes:
    """Check the framing and both CRCs of one complete framed record and return its data."""
    if len(raw) < _HEADER.size + _FOOTER.size:
        raise RecordError(
            f"truncated: {len(raw)} bytes at offset {offset} is shorter than a header"
        )
    length, length_crc = _HEADER.unpack_from(raw)
    if masked_crc32c(raw[:8]) != length_crc:
        raise RecordError(f"CRC mismatch in the length header at offset {offset}")
    if _HEADER.size + length + _FOOTER.size != len(raw):
        raise RecordError(
            f"length header says {length} data bytes but the index entry holds "
            f"{len(raw) - _HEADER.size - _FOOTER.size} at offset {offset}"
        )
    data = raw[_HEADER.size : _HEADER.size + length]
    (data_crc,) = _FOOTER.unpack_from(raw, _HEADER.size + length)
    if masked_crc32c(data) != data_crc:
        raise RecordError(f"CRC mismatch in the data at offset {offset}")
    return data


def scan_records(path: str | os.PathLike) -> list[tuple[int, int]]:
    """Walk a TFRecord file's length headers and return each record's (offset, size).

    Only the length headers (and their CRCs) are read, so this is fast on large files.

    Raises:
        RecordError: a header is corrupt or the last record is cut short; the message names the
            record number.
    """
    entries: list[tuple[int, int]] = []
    file_size = os.path.getsize(path)
    with open(path, "rb") as file:
        offset = 0
        while offset < file_size:
            header = file.read(_HEADER.size)
            record = len(entries)
            if len(header) < _HEADER.size:
                raise RecordError(f"record {record} at offset {offset}: truncated header")
            length, length_crc = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise RecordError(f"record {record} at offset {offset}: CRC mismatch in the header")
            size = _HEADER.size + length + _FOOTER.size
            if offset + size > file_size:
                raise RecordError(
                    f"record {record} at offset {offset}: truncated, needs {size} bytes, "
                    f"{file_size - offset} left in the file"
                )
            entries.append((offset, size))
            offset += size
            file.seek(offset)
    return entries


def write_index(entries: list[tuple[int, int]], index_path: str | os.PathLike) -> None:
    """Write index entries in the `tfrecord2idx` format, atomically (temporary file + rename)."""
    tmp = Path(f"{index_path}.tmp{os.getpid()}")
    tmp.write_text("".join(f"{offset} {size}\n" for offset, size in entries))
    os.replace(tmp, index_path)


class TFRecordWriter:
    """Writes `input_ids` examples to a TFRecord file and its index file, both in one pass.

    Args:
        path: the TFRecord file to create; the index goes beside it (see `index_path_for`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._entries: list[tuple[int, int]] = []
        self._offset = 0
        self.num_bytes = 0

    def write(self, token_ids: np.ndarray) -> None:
        """Append one record holding `token_ids`."""
        record = frame_record(encode_example(token_ids))
        self._file.write(record)
        self._entries.append((self._offset, len(record)))
        self._offset += len(record)

    @property
    def num_records(self) -> int:
        return len(self._entries)

    def abort(self) -> None:
        """Close and delete the unfinished file; no index is written."""
        self._file.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Flush the TFRecord file, then write its index (so an index never precedes its data)."""
        self._file.close()
        self.num_bytes = self._offset
        write_index(self._entries, index_path_for(self.path))

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RoundRobinShards:
    """Windows written in turn to ``len(paths)`` TFRecord shards, as a context manager.

    On an error (or an interrupt) every shard is deleted: half-written shards would look like
    data to a ``*.tfrecord`` glob. On success every shard is closed (index written) and those
    that got no window (fewer windows than shards) are deleted with their index.

    Attributes:
        writers: One :class:`TFRecordWriter` per shard.
        count: Windows written so far.
    """

    def __init__(self, paths: list[Path]):
        self.writers = [TFRecordWriter(path) for path in paths]
        self.count = 0

    def write(self, window: np.ndarray) -> None:
        self.writers[self.count % len(self.writers)].write(window)
        self.count += 1

    def __enter__(self) -> RoundRobinShards:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for writer in self.writers:
            if exc_type is not None:
                writer.abort()
                continue
            writer.close()
            if writer.num_records == 0:
                writer.path.unlink()
                index_path_for(writer.path).unlink()

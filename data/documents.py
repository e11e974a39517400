"""The writer's inputs: the documents of a corpus, in order, whatever format it comes in.

Every format yields the same thing, one string per document, and the writer tokenises that one
stream, so the same documents give the same windows from any format. Formats:

- ``lines``: text files, one document per non-blank line;
- ``files``: text files, one document per non-empty file;
- ``jsonl``: JSON Lines, one object per line holding the document under ``text_field``; gzip
  and zstd files are recognised by their first bytes and decompressed as they stream;
- ``parquet``: Parquet files, the column ``text_field`` (pyarrow);
- ``arrow``: a folder a HuggingFace ``datasets`` ``save_to_disk`` wrote (its Arrow files in the
  order its ``state.json`` lists them), or Arrow IPC files; column ``text_field`` (pyarrow; the
  ``datasets`` package is not needed).

A document that is empty or only whitespace is skipped in every format. Any problem is a
:class:`DataError` naming the file and the line (JSONL) or row (Parquet, Arrow).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from data.errors import DataError

INPUT_FORMATS = ("lines", "files", "jsonl", "parquet", "arrow")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ROWS_PER_BATCH = 4096  # Parquet and Arrow rows converted to Python strings at a time


def expand_inputs(patterns: list[str], input_format: str = "lines") -> list[Path]:
    """Expand files, directories and glob patterns into the list of inputs, in order.

    A directory stands for every file below it (sorted), except in the ``arrow`` format, where
    a folder is one data set (``save_to_disk``'s). Parquet folders skip the ``_`` and ``.``
    files Spark and Hive leave beside the data (``_SUCCESS``, ``.crc``).

    Raises:
        DataError: a pattern matches nothing, or nothing at all is found.
    """
    files: list[Path] = []
    for pattern in patterns:
        matches = (
            sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        )
        if not matches or not all(os.path.exists(m) for m in matches):
            raise DataError(f"input {pattern} does not exist (check --input-file-path)")
        for match in map(Path, matches):
            if match.is_dir() and input_format != "arrow":
                below = sorted(p for p in match.rglob("*") if p.is_file())
                if input_format == "parquet":
                    below = [p for p in below if not p.name.startswith(("_", "."))]
                files.extend(below)
            else:
                files.append(match)
    if not files:
        raise DataError(f"no input files found in {' '.join(patterns)}")
    return files


def iter_documents(
    files: list[Path], input_format: str = "lines", text_field: str = "text"
) -> Iterator[str]:
    """The documents of ``files`` in order (see the module's docstring for the formats).

    Raises:
        DataError: a file cannot be read as ``input_format``; the message names the file and
            the line or row.
    """
    read = {
        "lines": _lines,
        "files": _whole_file,
        "jsonl": _jsonl,
        "parquet": _parquet,
        "arrow": _arrow,
    }[input_format]
    for path in files:
        for text in read(path, text_field):
            if text.strip():
                yield text


def _whole_file(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as file:
        yield _decode(file.read(), path)


def _lines(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as file:
        # Lines are decoded one by one so that an error can name its line.
        for number, raw in enumerate(file, 1):
            yield _decode(raw, path, number).rstrip("\r\n")


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"line {line}" if line is not None else f"byte {error.start}"
        raise DataError(f"{path} {where} is not UTF-8 text ({error.reason})") from None


# ------------------------------------------------------------------------------ JSON Lines


def _open_maybe_compressed(path: Path) -> tuple[BinaryIO, str, tuple[type, ...]]:
    """The file's bytes, decompressed when it starts with a gzip or zstd header; a word for
    the compression, for messages; and the errors a damaged file raises while it is read."""
    raw = open(path, "rb")  # noqa: SIM115 - returned, closed by the caller
    head = raw.peek(4)[:4]
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw), "gzip", (OSError, EOFError, zlib.error)
    if head == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(
                f"{path} is zstd-compressed: pip install zstandard (requirements.txt lists it)"
            ) from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20), "zstd", (zstandard.ZstdError,)
    return raw, "text", (OSError,)


def _jsonl(path: Path, text_field: str) -> Iterator[str]:
    file, compression, damaged = _open_maybe_compressed(path)
    number = 0
    with file:
        try:
            for number, line in enumerate(file, 1):
                if not line.isspace():
                    yield _json_text(line, path, number, text_field)
        except damaged as error:
            raise DataError(
                f"{path} after line {number} is not a complete {compression} file ({error}): "
                "it was cut short or is damaged"
            ) from None


def _json_text(line: bytes, path: Path, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError of the bytes
        is_json = isinstance(error, json.JSONDecodeError)
        reason = (
            f"{error.msg.removesuffix(' at')}, column {error.colno}" if is_json else "not UTF-8"
        )
        raise DataError(f"{path} line {number} is not JSON ({reason})") from None
    if not isinstance(record, dict):
        kind = type(record).__name__
        raise DataError(f"{path} line {number} is a JSON {kind}, not an object with a text field")
    if text_field not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise DataError(
            f"{path} line {number} has no field {text_field!r} (its fields: {fields}); name the "
            "text's field with --text-field"
        )
    text = record[text_field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise DataError(
            f"{path} line {number}: field {text_field!r} is {kind}, not a string; name the "
            "text's field with --text-field"
        )
    return text


# --------------------------------------------------------------------------- Parquet, Arrow


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            "reading Parquet and Arrow needs pyarrow: pip install pyarrow (requirements.txt "
            "lists it)"
        ) from None
    return pyarrow


def _text_column(schema, path: Path, text_field: str) -> None:
    """Checks that ``schema`` has a string column ``text_field``."""
    pa = _pyarrow()
    if schema.get_field_index(text_field) < 0:
        columns = ", ".join(repr(n) for n in schema.names[:8]) or "none"
        raise DataError(
            f"{path} has no column {text_field!r} (its columns: {columns}); name the text's "
            "column with --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_view(pa, kind)):
        raise DataError(
            f"{path}: column {text_field!r} holds {kind}, not strings; name the text's column "
            "with --text-field"
        )


def _is_view(pa, kind) -> bool:
    is_view = getattr(pa.types, "is_string_view", None)
    return bool(is_view and is_view(kind))


def _texts(batches, path: Path, text_field: str) -> Iterator[str]:
    """The strings of column ``text_field`` of record batches; a null names its row."""
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        if column.null_count:
            first = row + next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
            raise DataError(
                f"{path} row {first}: column {text_field!r} is null, not a string (drop such "
                "rows first)"
            )
        yield from column.to_pylist()
        row += len(batch)


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    pa = _pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path} is not a Parquet file ({error})") from None
    with parquet:
        _text_column(parquet.schema_arrow, path, text_field)
        batches = parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[text_field])
        try:
            yield from _texts(batches, path, text_field)
        except pa.ArrowException as error:
            raise DataError(f"{path} cannot be read as Parquet ({error})") from None


def arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder in the order its ``state.json`` lists, or
    ``[path]`` for a file.

    Raises:
        DataError: the folder is a ``DatasetDict`` (splits), or holds no ``state.json``.
    """
    if not path.is_dir():
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        example = path / (splits[0] if splits else "train")
        raise DataError(
            f"{path} holds the splits {', '.join(splits) or 'of a DatasetDict'}: give one "
            f"split's folder, e.g. {example}"
        )
    state = path / "state.json"
    if not state.is_file():
        raise DataError(
            f"{path} has no state.json: give a folder that datasets' save_to_disk wrote, or "
            "its .arrow files"
        )
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{state} does not list the data set's files (_data_files)") from None
    files = [path / name for name in names]
    for file in files:
        if not file.is_file():
            raise DataError(f"{state} lists {file.name}, which is missing from {path}")
    return files


def _arrow(path: Path, text_field: str) -> Iterator[str]:
    pa = _pyarrow()
    for file in arrow_files(path):
        try:
            source = pa.memory_map(str(file))
            try:  # save_to_disk writes the IPC stream format; others write the file format
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{file} is not an Arrow file ({error})") from None
        with source:
            _text_column(reader.schema, file, text_field)
            try:
                yield from _texts(batches, file, text_field)
            except pa.ArrowException as error:
                raise DataError(f"{file} cannot be read as Arrow ({error})") from None

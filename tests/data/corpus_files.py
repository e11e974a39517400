"""Helpers for the data format tests: one small corpus written in every format people bring
(text lines, JSON Lines plain, gzip and zstd, Parquet, a `datasets` save_to_disk folder), and
Megatron's indexed files built from the documented layout by hand (never by the project's
writer, whose reader they check)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

# No newlines inside a document, so that one document per line reads them too.
DOCUMENTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It was not amused!",
    "  Leading spaces, tabs\tand unicode: naïve café, 東京, emoji 🙂 — and a literal <|endoftext|>.",
    "Numbers 1234567 and code: def f(x): return x ** 2",
    "A longer document that goes on for a while, so that windows cross document boundaries "
    "and the stream is more than a handful of tokens long; it mentions Megatron, Parquet and "
    "JSON Lines, which is what this test is about.",
] * 3
BLANK = "   "  # a whitespace-only document: skipped by every format


def write_every_format(folder: Path) -> dict[str, tuple[str, list[str]]]:
    """Writes DOCUMENTS (with BLANK among them) in every input format under ``folder``.

    Returns:
        format name -> (``--input-format``, ``--input-file-path`` values).
    """
    folder.mkdir(parents=True, exist_ok=True)
    with_blank = [*DOCUMENTS[:3], BLANK, *DOCUMENTS[3:]]
    (folder / "corpus.txt").write_text("\n".join(with_blank) + "\n")
    lines = "".join(
        json.dumps({"id": i, "text": text, "meta": {"n": i}}) + ("\n\n" if i == 2 else "\n")
        for i, text in enumerate(with_blank)
    ).encode()
    (folder / "corpus.jsonl").write_bytes(lines)
    (folder / "corpus.jsonl.gz").write_bytes(gzip.compress(lines))
    (folder / "corpus.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    parquet = folder / "parquet"
    parquet.mkdir()
    half = len(with_blank) // 2
    for part, texts in enumerate((with_blank[:half], with_blank[half:])):
        table = pa.table({"id": list(range(len(texts))), "text": texts})
        pq.write_table(table, parquet / f"part-{part}.parquet", row_group_size=3)
    (parquet / "_SUCCESS").write_text("")  # what Spark leaves beside its output
    arrow = write_save_to_disk(folder / "arrow", with_blank)
    return {
        "lines": ("lines", [str(folder / "corpus.txt")]),
        "jsonl": ("jsonl", [str(folder / "corpus.jsonl")]),
        "jsonl.gz": ("jsonl", [str(folder / "corpus.jsonl.gz")]),
        "jsonl.zst": ("jsonl", [str(folder / "corpus.jsonl.zst")]),
        "parquet": ("parquet", [str(parquet)]),
        "arrow": ("arrow", [str(arrow)]),
    }


def write_save_to_disk(folder: Path, texts: list[str]) -> Path:
    """A folder as ``datasets.Dataset.save_to_disk`` writes it: Arrow IPC stream files and a
    ``state.json`` listing them. The files are listed against their names' order, so a reader
    that sorts them instead of following the list reads the documents in another order."""
    folder.mkdir(parents=True)
    half = len(texts) // 2
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]
    for name, part in zip(names, (texts[:half], texts[half:]), strict=True):
        table = pa.table({"text": part, "label": [0] * len(part)})
        with pa.ipc.new_stream(str(folder / name), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text("{}")
    return folder


# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix: Path, documents: list[list[int]], dtype=np.uint16) -> Path:
    """``prefix.bin`` and ``prefix.idx`` in Megatron's MMIDIDX layout, one sequence per
    document, as its ``IndexedDatasetBuilder`` writes them; returns the ``.bin``."""
    width = np.dtype(dtype).itemsize
    sizes = [len(d) for d in documents]
    pointers = np.concatenate(([0], np.cumsum(sizes[:-1]) * width)).astype(np.int64)
    document_indices = np.arange(len(documents) + 1, dtype=np.int64)
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype])
    index += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(document_indices))
    index += np.asarray(sizes, dtype=np.int32).tobytes() + pointers.tobytes()
    index += document_indices.tobytes()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.idx").write_bytes(index)
    data = np.concatenate([np.asarray(d) for d in documents]).astype(dtype)
    Path(f"{prefix}.bin").write_bytes(data.tobytes())
    return Path(f"{prefix}.bin")


def read_megatron_index(path: Path) -> dict:
    """The fields of an ``.idx``, parsed from the documented layout."""
    raw = path.read_bytes()
    magic, version, code, count, num_doc = struct.unpack_from("<9sQBQQ", raw)
    at = 34
    sizes = np.frombuffer(raw, np.int32, count, at)
    pointers = np.frombuffer(raw, np.int64, count, at + 4 * count)
    documents = np.frombuffer(raw, np.int64, num_doc, at + 12 * count)
    assert len(raw) == at + 12 * count + 8 * num_doc
    return {
        "magic": magic,
        "version": version,
        "code": code,
        "sizes": sizes.tolist(),
        "pointers": pointers.tolist(),
        "documents": documents.tolist(),
    }

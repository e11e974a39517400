"""Tokenise text into windows of `--seq-length + 1` token ids and write them as TFRecord shards.

Input: text files with one document per line (`--input-format lines`, what
`wikipedia_preprocess.py` writes) or one document per file (`--input-format files`), given as
files, directories or glob patterns. Each document is tokenised (GPT-2's BPE by default, or the
HuggingFace `tokenizer.json` given with `--tokenizer`) and followed by the end-of-text token; the
concatenated stream is cut into windows of `seq_length + 1` tokens starting every `--stride`
tokens. A window of `seq_length + 1` gives the model `seq_length` inputs and `seq_length` labels,
so with `--stride seq_length` every token is predicted exactly once. The last, partial window is
dropped. Window i goes to shard i mod `--num-shards`; each shard gets an index file written in the
same pass, and the directory gets a `metadata.json` (tokenizer, vocabulary size, counts).

Tokenisation runs in `--workers` processes; the output does not depend on the number of workers.

Example:
    python data/write_into_tfrecord.py --input-file-path corpus/*.txt --input-format files \
        --output-file-path out/ --seq-length 1024 --stride 1024 --num-shards 4
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python data/write_into_tfrecord.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.errors import DataError
from data.parallel import ordered_map, run_script
from data.progress import Progress
from data.script_checks import output_folder, positive
from data.tfrecord_io import RoundRobinShards, index_path_for
from data.tokenizer import GPT2_EOT_TOKEN, TokenizerSpec, load_tokenizer

CHUNK_BYTES = 1 << 20  # text per worker task: large enough to amortise the IPC, small for memory


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Expand files, directories (every file below, sorted) and glob patterns into a file list.

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
            if match.is_dir():
                files.extend(sorted(p for p in match.rglob("*") if p.is_file()))
            else:
                files.append(match)
    if not files:
        raise DataError(f"no input files found in {' '.join(patterns)}")
    return files


def iter_documents(files: list[Path], input_format: str) -> Iterator[str]:
    """Yield documents: each non-blank line (`lines`) or each non-empty file (`files`).

    Raises:
        DataError: a file is not valid UTF-8; the message names the file and line.
    """
    for path in files:
        with open(path, "rb") as file:
            if input_format == "files":
                text = _decode(file.read(), path)
                if text.strip():
                    yield text
                continue
            # Lines are decoded one by one so that an error can name its line.
            for number, raw in enumerate(file, 1):
                line = _decode(raw, path, number).rstrip("\r\n")
                if line.strip():
                    yield line


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"line {line}" if line is not None else f"byte {error.start}"
        raise DataError(f"{path} {where} is not UTF-8 text ({error.reason})") from None


def iter_chunks(documents: Iterator[str], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[str]]:
    """Group documents into lists of about `chunk_bytes` characters, one worker task each."""
    chunk: list[str] = []
    size = 0
    for document in documents:
        chunk.append(document)
        size += len(document)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker: dict = {}


def _init_worker(spec: TokenizerSpec) -> int:
    """Load the tokenizer into this process (once: forked workers inherit the parent's).

    Returns:
        The vocabulary size.
    """
    if _worker.get("spec") != spec:
        tokenizer, eot_id, vocab_size = load_tokenizer(spec)
        _worker.update(spec=spec, tokenizer=tokenizer, eot=[eot_id], vocab_size=vocab_size)
    return _worker["vocab_size"]


def tokenize_chunk(documents: list[str]) -> tuple[np.ndarray, int, int]:
    """Token ids of `documents`, each followed by the end-of-text id (runs in a worker).

    Returns:
        (int32 ids, number of documents, number of UTF-8 bytes of text).
    """
    tokenizer, eot = _worker["tokenizer"], _worker["eot"]
    # add_special_tokens=False: documents are joined by end-of-text only, nothing else is added.
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets nobody reads.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(documents, add_special_tokens=False)
    total = sum(len(e.ids) for e in encodings) + len(encodings)
    ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(e.ids, eot) for e in encodings),
        dtype=np.int32,
        count=total,
    )
    num_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return ids, len(documents), num_bytes


class WindowCutter:
    """Cuts a stream of token ids, fed piece by piece, into windows of `length` every `stride`.

    Args:
        length: window length (seq_length + 1).
        stride: distance between window starts; `stride < length` overlaps windows.
    """

    def __init__(self, length: int, stride: int):
        self.length, self.stride = length, stride
        self._buffer = np.zeros(0, dtype=np.int32)
        self._skip = 0  # tokens still to drop when stride > length
        self.dropped = 0  # tokens after the last complete window

    def feed(self, ids: np.ndarray) -> Iterator[np.ndarray]:
        """Add ids to the stream and yield every window that is now complete."""
        if self._skip:
            dropped = min(self._skip, len(ids))
            ids, self._skip = ids[dropped:], self._skip - dropped
        buffer = np.concatenate((self._buffer, ids)) if len(self._buffer) else ids
        start = 0
        while start + self.length <= len(buffer):
            yield buffer[start : start + self.length]
            start += self.stride
        self._skip = max(0, start - len(buffer))
        self._buffer = buffer[min(start, len(buffer)) :].copy()

    def finish(self) -> int:
        """Count the tokens left in the buffer as dropped (the partial last window)."""
        self.dropped = len(self._buffer)
        return self.dropped


def write_tfrecords(
    files: list[Path],
    output_dir: Path,
    seq_length: int,
    stride: int,
    num_shards: int,
    workers: int,
    spec: TokenizerSpec,
    input_format: str = "lines",
    prefix: str = "data",
    overwrite: bool = False,
) -> dict:
    """Tokenise `files` and write windows of `seq_length + 1` ids into `num_shards` TFRecord files.

    Args:
        files: the input text files.
        output_dir: directory for the shards, their indices and `metadata.json`.
        seq_length: the model's sequence length; records hold `seq_length + 1` ids.
        stride: tokens between the starts of consecutive windows.
        num_shards: number of output files.
        workers: tokeniser processes.
        spec: which tokenizer.
        input_format: `lines` (one document per line) or `files` (one per file).
        prefix: shard file names are `{prefix}_{i:04d}.tfrecord`.
        overwrite: replace existing `{prefix}_*.tfrecord` shards instead of refusing.

    Returns:
        The metadata written to `metadata.json`.

    Raises:
        DataError: bad options, existing shards, unreadable input, or too little text for a window.
    """
    for flag, value in (("--seq-length", seq_length), ("--stride", stride)):
        positive(flag, value)
    positive("--num-shards", num_shards)
    positive("--workers", workers)
    output_folder("--output-file-path", output_dir, map(Path, files), "--input-file-path")
    try:
        vocab_size = _init_worker(spec)
    except (ValueError, FileNotFoundError) as error:
        raise DataError(str(error)) from None
    output_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(output_dir.glob(f"{prefix}_*.tfrecord"))
    if old and not overwrite:
        # A stale shard from an earlier run would be read by a '*.tfrecord' glob without warning.
        raise DataError(f"{output_dir} already holds {old[0].name} and others; pass --overwrite")
    for path in old:
        path.unlink()
        index_path_for(path).unlink(missing_ok=True)

    length = seq_length + 1
    paths = [output_dir / f"{prefix}_{i:04d}.tfrecord" for i in range(num_shards)]
    cutter = WindowCutter(length, stride)
    progress = Progress("write")
    with RoundRobinShards(paths) as shards_out:
        chunks = iter_chunks(iter_documents(files, input_format))
        for ids, num_docs, num_bytes in ordered_map(
            tokenize_chunk, chunks, workers, _init_worker, (spec,)
        ):
            for window in cutter.feed(ids):
                shards_out.write(window)
            progress.update(num_docs, len(ids), num_bytes)
    num_windows, writers = shards_out.count, shards_out.writers
    dropped = cutter.finish()
    progress.finish()
    if num_windows == 0:
        raise DataError(
            f"the input has {progress.tokens} tokens, fewer than one window of {length} "
            f"(--seq-length {seq_length} + 1): give more text or a smaller --seq-length"
        )
    shards = [{"file": w.path.name, "records": w.num_records} for w in writers if w.num_records]
    disk_bytes = sum(w.num_bytes for w in writers)
    metadata = {
        "tokenizer": spec.path or "gpt2",
        "vocab_size": vocab_size,
        "eot_id": _worker["eot"][0],
        "seq_length": seq_length,
        "record_length": length,
        "stride": stride,
        "documents": progress.documents,
        "tokens": progress.tokens,
        "text_bytes": progress.bytes,
        "records": num_windows,
        "dropped_tail_tokens": dropped,
        "disk_bytes": disk_bytes,
        "bytes_per_token": round(disk_bytes / (num_windows * length), 3),
        "shards": shards,
    }
    (output_dir / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    print(
        f"[write] {num_windows} records of {length} tokens in {len(shards)} shards under "
        f"{output_dir}; {disk_bytes:,} bytes, {metadata['bytes_per_token']} bytes/token; "
        f"{dropped} tail tokens dropped",
        file=sys.stderr,
    )
    return metadata


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input-file-path",
        nargs="+",
        required=True,
        help="text files, directories or glob patterns",
    )
    parser.add_argument(
        "--input-format",
        choices=("lines", "files"),
        default="lines",
        help="one document per line (default) or one document per file",
    )
    parser.add_argument(
        "--output-file-path", required=True, type=Path, help="output directory for the shards"
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        default=2048,
        help="model sequence length; records hold seq-length + 1 ids",
    )
    parser.add_argument(
        "--stride", type=int, help="tokens between window starts (default: --seq-length)"
    )
    parser.add_argument("--num-shards", "--num-output", type=int, default=4)
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokeniser processes (default: all cores)",
    )
    parser.add_argument("--tokenizer", help="a HuggingFace tokenizer.json (default: GPT-2 BPE)")
    parser.add_argument(
        "--eot-token", default=GPT2_EOT_TOKEN, help="end-of-text token placed after every document"
    )
    parser.add_argument("--prefix", default="data", help="shard file name prefix")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing shards with the same prefix"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Each worker runs its own single-threaded tokenizer; the library's thread pool must not be
    # started before fork (it would deadlock in the children) nor compete with the processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    write_tfrecords(
        expand_inputs(args.input_file_path),
        args.output_file_path,
        args.seq_length,
        args.stride if args.stride is not None else args.seq_length,
        args.num_shards,
        args.workers,
        TokenizerSpec(args.tokenizer, args.eot_token),
        args.input_format,
        args.prefix,
        args.overwrite,
    )
    return 0


if __name__ == "__main__":
    run_script(main)

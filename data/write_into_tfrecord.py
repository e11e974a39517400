"""Tokenise a corpus into token windows (TFRecord shards) or token files (`--output-format tokens`).

Input (`--input-format`, files, directories or glob patterns): text with one document per line
(`lines`, what `wikipedia_preprocess.py` writes) or per file (`files`); JSON Lines with the
document under `--text-field` (`jsonl`; `.gz` and `.zst` files are decompressed as they stream);
Parquet files (`parquet`, the column `--text-field`); or a HuggingFace `datasets` folder that
`save_to_disk` wrote (`arrow`). Whatever the format, the documents form one stream, so the same
documents give the same output bit for bit (data/documents.py).

Each document is tokenised (GPT-2's BPE by default, or the HuggingFace `tokenizer.json` given
with `--tokenizer`) and followed by the end-of-text token.

- `--output-format tfrecord` (default): the concatenated stream is cut into windows of
  `seq_length + 1` tokens starting every `--stride` tokens. A window of `seq_length + 1` gives
  the model `seq_length` inputs and `seq_length` labels, so with `--stride seq_length` every
  token is predicted exactly once. The last, partial window is dropped. Window i goes to shard
  i mod `--num-shards`; each shard gets an index file written in the same pass.
- `--output-format tokens`: the stream as one memory-mappable `{prefix}.bin` of ids at the
  narrowest width that holds the vocabulary, with `{prefix}.idx` giving each document's length
  (Megatron-LM's indexed layout, data/indexed_tokens.py). The loader cuts the windows itself at
  the run's sequence length.

The directory also gets a `metadata.json` (tokenizer, vocabulary size, counts). Outputs appear
only when the whole corpus is written: an error leaves nothing behind.

Tokenisation runs in `--workers` processes; the output does not depend on the number of workers.

Example:
    python data/write_into_tfrecord.py --input-file-path corpus/*.jsonl.zst --input-format jsonl \
        --output-file-path out/ --seq-length 1024 --stride 1024 --num-shards 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python data/write_into_tfrecord.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.documents import INPUT_FORMATS, expand_inputs, iter_documents
from data.errors import DataError
from data.indexed_tokens import INDEX_SUFFIX, IndexedTokensWriter, token_dtype
from data.parallel import ordered_map, run_script
from data.progress import Progress
from data.script_checks import output_folder, positive
from data.tfrecord_io import RoundRobinShards, index_path_for
from data.tokenizer import GPT2_EOT_TOKEN, TokenizerSpec, load_tokenizer

INDEX_SUFFIXES = (".index", INDEX_SUFFIX)
CHUNK_BYTES = 1 << 20  # text per worker task: large enough to amortise the IPC, small for memory


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


def tokenize_chunk(documents: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids of `documents`, each followed by the end-of-text id (runs in a worker).

    Returns:
        (int32 ids, int32 tokens of each document with its end-of-text id, UTF-8 bytes of text).
    """
    tokenizer, eot = _worker["tokenizer"], _worker["eot"]
    # add_special_tokens=False: documents are joined by end-of-text only, nothing else is added.
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets nobody reads.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(documents, add_special_tokens=False)
    ids: list[int] = []
    sizes = np.empty(len(encodings), dtype=np.int32)
    for number, encoding in enumerate(encodings):
        document = encoding.ids  # each access builds a new list: read it once
        ids += document
        ids += eot
        sizes[number] = len(document) + 1
    num_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return np.array(ids, dtype=np.int32), sizes, num_bytes


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


@dataclass
class WriteOptions:
    """How the writer reads its inputs and cuts and stores their tokens (the flags' values).

    Attributes:
        input_format: one of `data.documents.INPUT_FORMATS`.
        text_field: the JSON field or column holding the text (jsonl, parquet, arrow).
        output_format: `tfrecord` (windows) or `tokens` (the stream, `.bin` + `.idx`).
        seq_length: the model's sequence length; records hold `seq_length + 1` ids (tfrecord).
        stride: tokens between the starts of consecutive windows (tfrecord).
        num_shards: number of TFRecord files.
        workers: tokeniser processes.
        prefix: output names: `{prefix}_{i:04d}.tfrecord`, or `{prefix}.bin` and `.idx`.
        overwrite: replace existing outputs of the same prefix instead of refusing.
    """

    input_format: str = "lines"
    text_field: str = "text"
    output_format: str = "tfrecord"
    seq_length: int = 2048
    stride: int = 2048
    num_shards: int = 4
    workers: int = 1
    prefix: str = "data"
    overwrite: bool = False


def write_corpus(
    files: list[Path], output_dir: Path, spec: TokenizerSpec, options: WriteOptions
) -> dict:
    """Tokenise `files` into `output_dir` as `options` says (see the module's docstring).

    Every output is written into a temporary folder inside `output_dir` and moved into place
    when the whole corpus is done, so an error or an interrupt changes nothing on disk.

    Returns:
        The metadata written to `metadata.json`.

    Raises:
        DataError: bad options, existing outputs, unreadable input, or too little text.
    """
    o = options
    if o.output_format == "tfrecord":
        for flag, value in (("--seq-length", o.seq_length), ("--stride", o.stride)):
            positive(flag, value)
        positive("--num-shards", o.num_shards)
    positive("--workers", o.workers)
    output_folder("--output-file-path", output_dir, map(Path, files), "--input-file-path")
    try:
        vocab_size = _init_worker(spec)
    except (ValueError, FileNotFoundError) as error:
        raise DataError(str(error)) from None
    old = _existing_outputs(output_dir, o)
    if old and not o.overwrite:
        # A stale shard from an earlier run would be read by a '*.tfrecord' glob without warning.
        raise DataError(f"{output_dir} already holds {old[0].name} and others; pass --overwrite")
    created = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = output_dir / f".writing-{os.getpid()}"
    staging.mkdir()
    try:
        progress = Progress("write")
        documents = iter_documents(files, o.input_format, o.text_field)
        pieces = ordered_map(
            tokenize_chunk, iter_chunks(documents), o.workers, _init_worker, (spec,)
        )
        write = _write_windows if o.output_format == "tfrecord" else _write_tokens
        metadata = write(pieces, staging, o, progress, vocab_size)
        for path in old:
            path.unlink()
        # Data before indices: an index never names bytes that are not there yet.
        for path in sorted(staging.iterdir(), key=lambda p: (p.suffix in INDEX_SUFFIXES, p.name)):
            os.replace(path, output_dir / path.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    staging.rmdir()
    metadata = {
        "tokenizer": spec.path or "gpt2",
        "vocab_size": vocab_size,
        "eot_id": _worker["eot"][0],
        "input_format": o.input_format,
        "output_format": o.output_format,
        **metadata,
        "documents": progress.documents,
        "tokens": progress.tokens,
        "text_bytes": progress.bytes,
    }
    (output_dir / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    return metadata


def _existing_outputs(output_dir: Path, o: WriteOptions) -> list[Path]:
    if not output_dir.is_dir():
        return []
    if o.output_format == "tokens":
        names = [f"{o.prefix}.bin", f"{o.prefix}{INDEX_SUFFIX}"]
        return [output_dir / n for n in names if (output_dir / n).exists()]
    shards = sorted(output_dir.glob(f"{o.prefix}_*.tfrecord"))
    indices = [index_path_for(p) for p in shards]
    return shards + [p for p in indices if p.exists()]


def _write_windows(pieces, folder: Path, o: WriteOptions, progress: Progress, vocab: int) -> dict:
    """Cuts the stream into windows dealt round-robin into TFRecord shards in `folder`."""
    length = o.seq_length + 1
    paths = [folder / f"{o.prefix}_{i:04d}.tfrecord" for i in range(o.num_shards)]
    cutter = WindowCutter(length, o.stride)
    with RoundRobinShards(paths) as shards_out:
        for ids, sizes, num_bytes in pieces:
            for window in cutter.feed(ids):
                shards_out.write(window)
            progress.update(len(sizes), len(ids), num_bytes)
        if shards_out.count == 0:
            raise DataError(
                f"the input has {progress.tokens} tokens, fewer than one window of {length} "
                f"(--seq-length {o.seq_length} + 1): give more text or a smaller --seq-length"
            )
    num_windows, writers = shards_out.count, shards_out.writers
    dropped = cutter.finish()
    progress.finish()
    shards = [{"file": w.path.name, "records": w.num_records} for w in writers if w.num_records]
    disk_bytes = sum(w.num_bytes for w in writers)
    bytes_per_token = round(disk_bytes / (num_windows * length), 3)
    print(
        f"[write] {num_windows} records of {length} tokens in {len(shards)} shards under "
        f"{folder.parent}; {disk_bytes:,} bytes, {bytes_per_token} bytes/token; "
        f"{dropped} tail tokens dropped",
        file=sys.stderr,
    )
    return {
        "seq_length": o.seq_length,
        "record_length": length,
        "stride": o.stride,
        "records": num_windows,
        "dropped_tail_tokens": dropped,
        "disk_bytes": disk_bytes,
        "bytes_per_token": bytes_per_token,
        "shards": shards,
    }


def _write_tokens(pieces, folder: Path, o: WriteOptions, progress: Progress, vocab: int) -> dict:
    """Writes the stream as `{prefix}.bin` and `{prefix}.idx` in `folder`."""
    writer = IndexedTokensWriter(folder / f"{o.prefix}.bin", token_dtype(vocab))
    try:
        for ids, sizes, num_bytes in pieces:
            writer.write(ids, sizes)
            progress.update(len(sizes), len(ids), num_bytes)
        if writer.num_tokens == 0:
            raise DataError("the input holds no text: every document is empty")
    except BaseException:
        writer.abort()
        raise
    disk_bytes = writer.close()
    progress.finish()
    width = np.dtype(writer.dtype).itemsize
    print(
        f"[write] {writer.num_tokens:,} tokens of {progress.documents:,} documents as "
        f"{np.dtype(writer.dtype).name} in {folder.parent / writer.path.name} and its "
        f"{INDEX_SUFFIX}; {disk_bytes:,} bytes",
        file=sys.stderr,
    )
    return {
        "dtype": np.dtype(writer.dtype).name,
        "bytes_per_token": width,
        "disk_bytes": disk_bytes,
        "files": [writer.path.name, writer.path.with_suffix(INDEX_SUFFIX).name],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input-file-path",
        nargs="+",
        required=True,
        help="files, directories or glob patterns (arrow: save_to_disk folders)",
    )
    parser.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="lines",
        help="one document per line (default), per file, per JSON line, per Parquet or Arrow row",
    )
    parser.add_argument(
        "--text-field",
        default="text",
        help="the JSON field or Parquet/Arrow column holding the text (default: text)",
    )
    parser.add_argument("--output-file-path", required=True, type=Path, help="output directory")
    parser.add_argument(
        "--output-format",
        choices=("tfrecord", "tokens"),
        default="tfrecord",
        help="TFRecord windows (default), or token files (.bin + .idx) the loader cuts itself",
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        help="model sequence length; records hold seq-length + 1 ids (tfrecord; default 2048)",
    )
    parser.add_argument(
        "--stride", type=int, help="tokens between window starts (tfrecord; default: --seq-length)"
    )
    parser.add_argument(
        "--num-shards", "--num-output", type=int, help="TFRecord files (tfrecord; default 4)"
    )
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
    parser.add_argument("--prefix", default="data", help="output file name prefix")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing outputs with the same prefix"
    )
    return parser.parse_args(argv)


def options_of(args: argparse.Namespace) -> WriteOptions:
    """The flags as `WriteOptions`; the window flags only go with TFRecord output.

    Raises:
        DataError: a window flag given with `--output-format tokens`.
    """
    windows = {
        "--seq-length": args.seq_length,
        "--stride": args.stride,
        "--num-shards": args.num_shards,
    }
    if args.output_format == "tokens":
        given = [flag for flag, value in windows.items() if value is not None]
        if given:
            raise DataError(
                f"{' and '.join(given)} cut TFRecord windows; token files hold the whole stream "
                "and the run's --sequence_length cuts it: leave them out with --output-format tokens"
            )
    seq_length = 2048 if args.seq_length is None else args.seq_length
    return WriteOptions(
        input_format=args.input_format,
        text_field=args.text_field,
        output_format=args.output_format,
        seq_length=seq_length,
        stride=seq_length if args.stride is None else args.stride,
        num_shards=4 if args.num_shards is None else args.num_shards,
        workers=args.workers,
        prefix=args.prefix,
        overwrite=args.overwrite,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Each worker runs its own single-threaded tokenizer; the library's thread pool must not be
    # started before fork (it would deadlock in the children) nor compete with the processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    options = options_of(args)
    write_corpus(
        expand_inputs(args.input_file_path, args.input_format),
        args.output_file_path,
        TokenizerSpec(args.tokenizer, args.eot_token),
        options,
    )
    return 0


if __name__ == "__main__":
    run_script(main)

"""The writer's throughput for each input format, and the token-file loader's time per batch.

    python -m benchmarks.data_formats --corpus corpus.txt --work /tmp/formats [--workers 2]

``--corpus`` is text with one document per line (what ``wikipedia_preprocess.py`` writes). The
same documents are written as JSON Lines (plain and zstd) and Parquet into ``--work``, and each
is tokenised by ``write_into_tfrecord.py``'s own code, TFRecord output and token output, in
this process (``--repeats`` rounds of every case in turn; the median is printed; the time is
the whole write: reading, forking the workers, tokenising, writing). Then the loader
reads ``tiny``-shaped batches (``--batches`` of 8 windows of 129 ids) from the TFRecords and
from the token file: the time per batch, read on the training thread without the prefetching
that hides it in a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from data.documents import expand_inputs
from data.errors import DataError
from data.loader import PretrainingDataLoader
from data.parallel import run_script
from data.script_checks import output_folder
from data.tokenizer import TokenizerSpec
from data.write_into_tfrecord import WriteOptions, write_corpus


def write_inputs(corpus: Path, work: Path) -> dict[str, tuple[str, Path]]:
    """The corpus' documents as every input format: name -> (--input-format, path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [line.rstrip("\n") for line in corpus.open(encoding="utf-8") if line.strip()]
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    (work / "corpus.jsonl").write_bytes(lines)
    (work / "corpus.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts}), work / "corpus.parquet")
    return {
        "lines": ("lines", corpus),
        "jsonl": ("jsonl", work / "corpus.jsonl"),
        "jsonl.zst": ("jsonl", work / "corpus.jsonl.zst"),
        "parquet": ("parquet", work / "corpus.parquet"),
    }


def time_writer(name, input_format, path, out, output_format, workers) -> tuple[int, float]:
    """(tokens, seconds) of one write, in this process (its workers forked from it)."""
    options = WriteOptions(input_format=input_format, output_format=output_format, workers=workers)
    start = time.perf_counter()
    metadata = write_corpus(expand_inputs([str(path)], input_format), out, TokenizerSpec(), options)
    return metadata["tokens"], time.perf_counter() - start


def time_loader(files: str, batches: int) -> float:
    """Median seconds per `tiny` batch (8 windows of 128 + 1 ids) read on this thread."""
    loader = PretrainingDataLoader([files], 128, 8, 4, 0, 1, 0, 50257)
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        loader.next_batch()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="one document per line")
    parser.add_argument("--work", type=Path, required=True, help="a folder for the outputs")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args(argv)
    if not args.corpus.is_file():
        raise DataError(f"--corpus {args.corpus} is not a file")
    output_folder("--work", args.work, [args.corpus], "--corpus")
    if args.work.exists() and any(args.work.iterdir()):
        raise DataError(f"--work {args.work} is not empty; give a new folder")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    args.work.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(args.corpus, args.work)
    cases = [(name, output) for name in inputs for output in ("tfrecord", "tokens")]
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    tokens = 0
    for repeat in range(args.repeats):  # round by round: a machine's drift touches every case
        for name, output in cases:
            input_format, path = inputs[name]
            out = args.work / f"{name}-{output}-{repeat}"
            tokens, took = time_writer(name, input_format, path, out, output, args.workers)
            seconds[(name, output)].append(took)
    for (name, output), times in seconds.items():
        rate = tokens / statistics.median(times)
        print(f"{name:10} -> {output:8} {tokens:>10,} tokens {rate:>10,.0f} tokens/s", flush=True)
    for kind, files in (
        ("tfrecord", str(args.work / "lines-tfrecord-0" / "*.tfrecord")),
        ("tokens", str(args.work / "lines-tokens-0" / "data.bin")),
    ):
        seconds = time_loader(files, args.batches)
        print(f"loader {kind:8} {seconds * 1e3:.3f} ms per tiny batch (8 x 129 ids)", flush=True)
    return 0


if __name__ == "__main__":
    run_script(main)

"""Rewrite a folder of TFRecord shards as longer records, from the same token stream.

The writer deals window i of its token stream to shard i mod (number of shards), and consecutive
windows overlap by ``record_length - stride`` ids (``metadata.json`` says both). Reading the
records back in that order rebuilds the stream, which is cut again into windows of
``--seq-length + 1`` ids every ``--seq-length``. So the shipped sample (records of 2,049 ids
from one stream) gives records for the long-context presets without its source text:

    python data/lengthen_records.py --input data/sample --output data/sample_32k --seq-length 32768

(138,864 tokens: 4 records of 32,769 ids.) Any folder written by ``write_into_tfrecord.py``
whose stride is at most its sequence length works the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python data/lengthen_records.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config.command_line import exit_for_bad_input
from data.dataset import read_index
from data.errors import DataError
from data.script_checks import existing_folder, output_folder, positive
from data.tfrecord_io import RoundRobinShards, decode_example, read_record
from data.write_into_tfrecord import WindowCutter


def token_stream(folder: Path) -> Iterator[np.ndarray]:
    """The writer's token stream, rebuilt from the records of ``folder`` in window order."""
    try:
        metadata = json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{folder}/metadata.json cannot be read: {err}") from None
    overlap = metadata["record_length"] - metadata["stride"]
    if overlap < 0:
        raise DataError(f"{folder} skips tokens between records (stride > record length)")
    shards = [folder / shard["file"] for shard in metadata["shards"]]
    indices = [read_index(str(path))[:2] for path in shards]
    files = [open(path, "rb") for path in shards]  # noqa: SIM115 - closed below
    try:
        for window in range(metadata["records"]):
            shard, record = window % len(shards), window // len(shards)
            offsets, sizes = indices[shard]
            ids = decode_example(read_record(files[shard], offsets[record], sizes[record]))
            yield ids if window == 0 else ids[overlap:]  # the overlap was in the last record
    finally:
        for file in files:
            file.close()


def lengthen(source: Path, output: Path, seq_length: int, num_shards: int) -> int:
    """Writes the stream of ``source`` as records of ``seq_length + 1`` ids; returns how many."""
    positive("--seq-length", seq_length)
    positive("--num-shards", num_shards)
    existing_folder("--input", source)
    output_folder("--output", output, [source], "--input")
    try:
        metadata = json.loads((source / "metadata.json").read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{source}/metadata.json cannot be read: {err}") from None
    old = sorted(output.glob("*.tfrecord")) if output.is_dir() else []
    if old:  # a stale shard would be read beside the new ones by a '*.tfrecord' glob
        raise DataError(f"--output {output} already holds {old[0].name}; give an empty folder")
    output.mkdir(parents=True, exist_ok=True)
    paths = [output / f"data_{i:04d}.tfrecord" for i in range(num_shards)]
    cutter = WindowCutter(seq_length + 1, seq_length)
    with RoundRobinShards(paths) as shards_out:
        for ids in token_stream(source):
            for window in cutter.feed(ids):
                shards_out.write(window)
    count, writers = shards_out.count, shards_out.writers
    if count == 0:
        raise DataError(
            f"{source} holds {metadata['tokens']} tokens, fewer than one record of "
            f"{seq_length + 1}: give more data or a smaller --seq-length"
        )
    shards = [{"file": w.path.name, "records": w.num_records} for w in writers if w.num_records]
    metadata.update(
        seq_length=seq_length,
        record_length=seq_length + 1,
        stride=seq_length,
        records=count,
        shards=shards,
        lengthened_from=str(source),
    )
    (output / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path, help="folder written by the writer")
    parser.add_argument("--output", required=True, type=Path, help="folder for the new shards")
    parser.add_argument("--seq-length", required=True, type=int, help="records hold this + 1 ids")
    parser.add_argument("--num-shards", type=int, default=1, help="output files (default 1)")
    args = parser.parse_args(argv)
    try:
        count = lengthen(args.input, args.output, args.seq_length, args.num_shards)
    except DataError as err:
        exit_for_bad_input("lengthen_records.py", err)
    print(f"wrote {count} records of {args.seq_length + 1} ids to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

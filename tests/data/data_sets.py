"""Helpers for the data tests: small TFRecord data sets whose every window is recognisable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from data.tfrecord_io import TFRecordWriter

REPO_ROOT = Path(__file__).resolve().parents[2]


def numbered_record(number: int, record_length: int) -> np.ndarray:
    """The ids of record `number` of a numbered data set: `number * record_length + arange(...)`.

    Every id occurs once in the data set, so a window identifies its record and position.
    """
    return number * record_length + np.arange(record_length, dtype=np.int64)


def write_numbered_shards(
    directory: str | os.PathLike, records_per_shard: list[int], record_length: int
) -> list[Path]:
    """Write shards `data_0000.tfrecord`, ... where the records, numbered through the shards in
    order, hold `numbered_record(number, record_length)`.

    Returns:
        The shard paths.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths, number = [], 0
    for shard, count in enumerate(records_per_shard):
        path = directory / f"data_{shard:04d}.tfrecord"
        with TFRecordWriter(path) as writer:
            for _ in range(count):
                writer.write(numbered_record(number, record_length))
                number += 1
        paths.append(path)
    return paths


def run_data_script(script: str, *args: str, cwd: str | os.PathLike | None = None):
    """Run `data/<script>` (python or bash) as a user would; returns the CompletedProcess."""
    path = REPO_ROOT / "data" / script
    command = ["bash", str(path)] if script.endswith(".sh") else [sys.executable, str(path)]
    return subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )

"""Checks of the data scripts' command-line paths and sizes, done before anything is written.

A data script that writes into its own input truncates that input before reading it; a zero or
negative size can loop without end or divide by zero; an output path that names an existing file
fails deep inside ``mkdir``. Each check raises a one-line :class:`DataError` naming the flag.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from data.errors import DataError


def positive(flag: str, value: int) -> None:
    if value < 1:
        raise DataError(f"{flag} must be at least 1, not {value}")


def existing_folder(flag: str, path: Path) -> None:
    if not path.exists():
        raise DataError(f"{flag} {path} does not exist")
    if not path.is_dir():
        raise DataError(f"{flag} {path} is a file; give the folder the writer wrote")


def output_folder(flag: str, path: Path, inputs: Iterable[Path] = (), input_flag: str = "") -> None:
    """``path`` can be a folder the script writes into: not an existing file, and neither an
    input nor a folder holding one, nor inside an input folder."""
    if path.exists() and not path.is_dir():
        raise DataError(f"{flag} {path} is an existing file; give a folder")
    _apart(flag, path, inputs, input_flag)


def output_file(flag: str, path: Path, inputs: Iterable[Path] = (), input_flag: str = "") -> None:
    """``path`` can be a file the script writes: not an existing folder, nor one of its inputs."""
    if path.is_dir():
        raise DataError(f"{flag} {path} is a folder; give a file name")
    _apart(flag, path, inputs, input_flag)


def _apart(flag: str, output: Path, inputs: Iterable[Path], input_flag: str) -> None:
    out = output.resolve()
    for source in inputs:
        src = source.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise DataError(
                f"{flag} {output} overlaps the input {source} ({input_flag}): writing there would "
                "destroy the input before it is read; give a separate output path"
            )

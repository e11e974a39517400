"""The data scripts refuse bad paths and sizes in one line, exit 2, before writing anything:
an output that overlaps the input (which the script would truncate before reading it), zero or
negative sizes (``--seq-length 0`` once filled the disk), a missing input and an output path
that is an existing file. The reference is the bytes on disk before each command.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.entry_points import run_script

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return run_script(ROOT / "data" / name, *args, cwd=Path.cwd(), timeout=120)


# (script, arguments with {tmp}, what the one line says)
CASES = [
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/in --seq-length 64", "overlaps the input"),
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/in/x --seq-length 64", "overlaps"),
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/out --seq-length 0", "--seq-length must be at least 1, not 0"),
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/out --seq-length -5", "--seq-length must be at least 1"),
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/out --seq-length 64 --num-shards 0", "--num-shards must be at least 1"),
    ("lengthen_records.py", "--input {tmp}/missing --output {tmp}/out --seq-length 64", "--input {tmp}/missing does not exist"),
    ("lengthen_records.py", "--input {tmp}/text.txt --output {tmp}/out --seq-length 64", "is a file"),
    ("lengthen_records.py", "--input {tmp}/in --output {tmp}/text.txt --seq-length 64", "is an existing file"),
    ("write_into_tfrecord.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/text.txt", "is an existing file"),
    ("write_into_tfrecord.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}", "overlaps the input"),
    ("write_into_tfrecord.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/out --num-shards 0", "--num-shards must be at least 1"),
    ("write_into_tfrecord.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/out --seq-length 0", "--seq-length must be at least 1"),
    ("write_into_tfrecord.py", "--input-file-path {tmp}/nothing.txt --output-file-path {tmp}/out", "does not exist"),
    ("wikipedia_preprocess.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/text.txt", "overlaps the input"),
    ("wikipedia_preprocess.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/in/metadata.json", "is an existing file"),
    ("wikipedia_preprocess.py", "--input-file-path {tmp}/text.txt --output-file-path {tmp}/o --workers 0", "--workers must be at least 1"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "args", "message"), CASES)
def test_bad_paths_and_sizes_are_one_line_and_change_nothing(tmp_path, script, args, message):
    shutil.copytree(SAMPLE, tmp_path / "in")
    (tmp_path / "text.txt").write_text("one article per line\nand another one here\n")
    before = _snapshot(tmp_path)
    result = _script(script, *args.format(tmp=tmp_path).split())
    assert result.returncode == 2, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()

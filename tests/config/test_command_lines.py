"""Every entry point's command line is the library's: the benchmarks reach it as a package
(``python -m benchmarks.NAME``), never through ``sys.path``, and bad input ends through one
function, ``config.command_line.exit_for_bad_input``: one line and exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from config.command_line import exit_for_bad_input, exit_on_bad_input
from config.errors import ConfigError
from data.errors import DataError
from execution.training import entry
from tests.library_files import library_files

ROOT = Path(__file__).resolve().parents[2]
# Ending a process with status 2 by hand: what only config/command_line.py may do.
EXIT_2 = re.compile(r"\bexit\(2\)|SystemExit\(2\)|^\s*return 2$", re.M)


def test_no_benchmark_reaches_the_library_through_sys_path():
    found = [
        f
        for f in library_files()
        if f.startswith("benchmarks/") and "sys.path" in (ROOT / f).read_text()
    ]
    assert not found, "sys.path under benchmarks/: " + ", ".join(found)


def test_bad_input_ends_through_one_function():
    found = [
        f
        for f in library_files()
        if f != "config/command_line.py" and EXIT_2.search((ROOT / f).read_text())
    ]
    assert not found, "exit 2 by hand, not through exit_for_bad_input: " + ", ".join(found)


def test_the_check_catches_an_exit_2_by_hand():
    assert EXIT_2.search('    print("x: error: y")\n    sys.exit(2)\n')
    assert EXIT_2.search("def main():\n    return 2\n")
    assert not EXIT_2.search("    return 20\n    sys.exit(BAD_INPUT_EXIT)\n")


@pytest.mark.parametrize("error", [ConfigError("--steps must be >= 1"), DataError("bad record")])
def test_either_kind_of_bad_input_is_one_line_and_exit_2(error, capsys):
    def main():
        raise error

    with pytest.raises(SystemExit) as stop:
        exit_on_bad_input(main, "prog")
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"prog: error: {error}\n"


def test_a_bug_is_not_bad_input():
    def main():
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        exit_on_bad_input(main, "prog")


def test_a_rank_that_leaves_the_line_to_rank_0_says_nothing(capsys):
    with pytest.raises(SystemExit) as stop:
        exit_for_bad_input("prog", "said once", say=False)
    assert stop.value.code == 2 and capsys.readouterr().err == ""


def test_a_benchmark_runs_as_a_module_from_the_checkout_and_not_as_a_file():
    """``python -m benchmarks.NAME`` finds the library; ``python benchmarks/NAME.py`` would
    put benchmarks/ first on the path instead, where the library is not: the docs show the
    first (tests/house/test_docs_commands.py)."""
    module = [sys.executable, "-m", "benchmarks.gpu_table", "--results", "/nonexistent"]
    done = subprocess.run(module, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("benchmarks.gpu_table: error: ") and done.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("rank", "joined", "said"),
    [
        (0, False, "prog: error: bad flag\n"),
        (1, False, ""),
        (1, True, "prog: error: rank 1: bad flag\n"),
    ],
)
def test_an_entry_point_s_bad_input_is_said_once_or_by_its_own_rank(
    monkeypatch, capsys, rank, joined, said
):
    """Before the ranks join every rank finds the same mistake and rank 0 says it; after, the
    mistake may be one rank's own, which says it with its rank (execution/training/entry.py)."""

    def main(job):
        job.joined = joined
        raise ConfigError("bad flag")

    monkeypatch.setattr(entry, "launcher_rank", lambda: rank)
    with pytest.raises(SystemExit) as stop:
        entry.run_entry_point(main, "prog")
    assert stop.value.code == 2 and capsys.readouterr().err == said

"""Every benchmark that writes a file checks where it goes before it measures: a folder where a
file goes (or a file where a folder goes) is one line and exit 2, before minutes of work (on a
lent GPU, minutes that cannot be had back), and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.entry_points import assert_refused, run_script


def _folder(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def _file(tmp: Path, name: str) -> Path:
    (tmp / name).write_text("kept\n")
    return tmp / name


def _run_folder(tmp: Path, name: str) -> Path:
    """An --output_dir whose dense run folder holds a run: run_pretraining.py would refuse it
    only after the sparse comparison's first run."""
    (tmp / name / "dense").mkdir(parents=True)
    (tmp / name / "dense" / "metrics.jsonl").write_text("{}\n")
    return tmp / name


# the module under benchmarks/, the flags before the path, how the path is in the way, its name, the message
CASES = {
    "first run --json a folder": (
        "gpu_first_run", ["--device", "cpu", "--json"], _folder, "out.json", "is a folder"
    ),
    "first run --json beside a folder": (
        "gpu_first_run", ["--device", "cpu", "--json"], None, "out.json", "is a folder"
    ),
    "first run --results_dir a file": (
        "gpu_first_run", ["--device", "cpu", "--results_dir"], _file, "results", "is a file"
    ),
    "gpu_check --json a folder": (
        "gpu_check", ["--device", "cpu", "--json"], _folder, "checks.jsonl", "is a folder"
    ),
    "gpu_table --write a folder": ("gpu_table", ["--write"], _folder, "t.md", "is a folder"),
    "bench_step --json a folder": (
        "bench_step", ["--config", "tiny", "--json"], _folder, "rows.json", "is a folder"
    ),
    "calibrate --output a folder": (
        "calibrate", ["--device", "cpu", "--output"], _folder, "spec.json", "is a folder"
    ),
    "time_model_check --output a folder": (
        "time_model_check", ["--output"], _folder, "rows.json", "is a folder"
    ),
    "time_model_check --spec_dir a file": (
        "time_model_check", ["--spec_dir"], _file, "specs", "is a file"
    ),
    "rigl_compare --output_dir a file": (
        "rigl_compare", ["--output_dir"], _file, "rigl", "is a file"
    ),
    "rigl_compare --output_dir holding a run": (
        "rigl_compare", ["--output_dir"], _run_folder, "rigl", "dense/ holds a run"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_an_output_path_in_the_way_is_refused_before_any_work(tmp_path, case):
    script, flags, in_the_way, name, message = CASES[case]
    if in_the_way is None:  # the results file is free, the calibration's beside it is not
        (tmp_path / "out.spec.json").mkdir()
        path = tmp_path / name
    else:
        path = in_the_way(tmp_path, name)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = run_script("-m", f"benchmarks.{script}", *flags, str(path), timeout=60)
    assert_refused(result, f"benchmarks.{script}", message)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

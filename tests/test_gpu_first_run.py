"""benchmarks/gpu_first_run.py --device cpu --quick: the whole first GPU run at tiny sizes, so
that the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import math

import pytest

from execution.planning.device_specs import SPECS, read_spec_file


@pytest.mark.slow
def test_quick_cpu_first_run_has_every_stage_row_and_estimate(quick_first_run):
    result, report, spec_file = quick_first_run
    assert list(report["stages_s"]) == ["checks", "calibration", "rows", "estimates"]

    # Checks: the placement checks ran and passed; what needs CUDA was skipped, not failed.
    checks = {c["check"]: c["ok"] for c in report["checks"]}
    assert [name for name, ok in checks.items() if ok] == [
        "remote vs resident (bf16)",
        "host activations (float32)",
        "host gradients (float32)",
        "bf16 host weights",
    ]
    assert all(ok is None for ok in list(checks.values())[4:])

    # The calibration is a device spec file the dry run reads.
    spec = read_spec_file(spec_file, SPECS["h100_sxm"])
    assert spec.name == "calibrated cpu" and spec.matmul_tflops

    rows = report["rows"]
    assert [r["key"] for r in rows] == ["resident", "plain", "streamed", "fsdp2"]
    measured = [r for r in rows if "step_s" in r]
    assert len(measured) == 3 and "needs CUDA" in rows[3]["skipped"]
    # Each row ran in a process of its own.
    assert len({r["pid"] for r in measured}) == 3
    # The plain loop trains the same model from the same weights: same first loss (float32).
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"], abs=1e-4)
    for row in measured:
        assert row["estimated_step_s"] > 0 and math.isfinite(row["estimated_step_s"])
    table = result.stdout[result.stdout.index("row  ") :]
    for row in rows:
        assert row["variant"] in table

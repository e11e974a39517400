"""benchmarks/calibrate.py on a CPU: its spec file follows from its own raw measurements."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calibrate  # noqa: E402

from execution.planning.device_specs import SPECS, read_spec_file  # noqa: E402


def test_quick_cpu_calibration_writes_a_spec_the_dry_run_reads(tmp_path):
    out = tmp_path / "spec.json"
    result = calibrate.main(["--device", "cpu", "--quick", "--output", str(out), "--base", "h200"])
    spec = read_spec_file(out, SPECS["h200"])
    measured = result["measurements"]
    shapes = measured["matmul"]["shapes"]
    # Every shape of the plan was timed, and its rate is its FLOPs over its time.
    expected = [(m, n, k) for _, m, n, k in calibrate.matmul_shapes(calibrate.QUICK)]
    assert [(s["m"], s["n"], s["k"]) for s in shapes] == expected
    for (m, n, k, tflops), s in zip(spec.matmul_tflops, shapes, strict=True):
        assert (m, n, k) == (s["m"], s["n"], s["k"])
        assert tflops == pytest.approx(2 * m * n * k / s["seconds"] / 1e12)
    # A CPU has no data sheet: the best rate is the peak, and the GPT shapes' efficiency is
    # their FLOPs over their time against it.
    assert spec.peak_tflops == max(e[3] for e in spec.matmul_tflops)
    gpt = [s for s in shapes if s["kind"] != "square"]
    flops = sum(2 * s["m"] * s["n"] * s["k"] for s in gpt)
    rate = flops / sum(s["seconds"] for s in gpt) / 1e12
    assert spec.compute_efficiency == pytest.approx(rate / spec.peak_tflops)
    # No link on a CPU: host memory stands in for it; copies move 2 bytes per byte copied.
    memory = measured["memory"]
    assert spec.device_memory_gb_per_s == pytest.approx(
        2 * memory["bytes"] / memory["seconds"] / 1e9
    )
    assert measured["host_link"] == {}
    assert spec.h2d_gb_per_s == spec.host_link_gb_per_s == spec.host_memory_gb_per_s > 0
    assert spec.launch_overhead_us > 0
    # What the measurements do not cover stays the base entry's.
    assert spec.inter_node_gb_per_s == SPECS["h200"].inter_node_gb_per_s
    assert spec.name == "calibrated cpu"

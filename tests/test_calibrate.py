"""benchmarks/calibrate.py on a CPU: its spec file follows from its own raw measurements, and
the dry run's step time on that spec holds against steps measured on this machine."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calibrate  # noqa: E402

from config.loading import parse_config  # noqa: E402
from execution.parallel.mesh import ParallelLayout  # noqa: E402
from execution.planning.device_specs import SPECS, read_spec_file, resolve_spec  # noqa: E402
from execution.planning.dry_run import estimate, measure_rank  # noqa: E402
from execution.planning.planner import planned_engine  # noqa: E402


@pytest.fixture(scope="module")
def quick_calibration(quick_first_run):
    """The quick calibration of this CPU that the GPU first-run script made (``calibrate.py
    --device cpu --quick``, one thread like this process: tests/conftest.py), and its file."""
    _, _, spec_file = quick_first_run
    return json.loads(spec_file.read_text()), spec_file


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_quick_cpu_calibration_writes_a_spec_the_dry_run_reads(quick_calibration):
    result, out = quick_calibration
    base = SPECS[result["base"]]
    spec = read_spec_file(out, base)
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
    gpt = [s for s in shapes if s["kind"] not in ("square", "grid")]
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
    assert spec.inter_node_gb_per_s == base.inter_node_gb_per_s
    assert spec.storage_gb_per_s == base.storage_gb_per_s
    assert spec.name == "calibrated cpu"
    # A CPU's copies and collectives take the cores that compute; its attention is its own.
    assert spec.device_type == "cpu" and not spec.copies_overlap
    assert 0 < spec.attention_efficiency <= 1
    ops = {op for op, _, rate in spec.collective_gb_per_s if rate > 0}
    assert ops == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send"}
    # The engine's own time: the fit leaves no row's residual unexplained beyond its noise.
    engine = measured["engine"]
    for row in engine["rows"]:
        overhead = row["kernels"] * spec.launch_overhead_us + row["phases"] * spec.phase_overhead_us
        assert row["ops_s"] + overhead * 1e-6 == pytest.approx(row["step_s"], rel=0.5)
    # Waiting for a collective inside a step: two ranks' steps at tensor-parallel 2, the larger
    # model waiting for more calls; the cost per call is the fit through them, each residual
    # over the modelled step relative to its step, by hand.
    rows = measured["waited_collectives"]["rows"]
    assert [(r["layers"], r["micro_batches"]) for r in rows] == [(1, 2), (3, 2)]
    assert 0 < rows[0]["waited_calls"] < rows[1]["waited_calls"]
    excess = [(r["step_s"] - r["modelled_s"], r["waited_calls"], r["step_s"]) for r in rows]
    fit = sum(e * n / t**2 for e, n, t in excess) / sum(n * n / t**2 for _, n, t in excess)
    assert spec.waited_collective_us == pytest.approx(max(fit, 0.0) * 1e6)


# A model whose matmuls are near the quick calibration's shapes (hidden 64, 128 rows).
SMALL = shlex.split(
    "--config tiny --vocab_size 1024 --hidden_size 64 --heads 2 --sequence_length 64 "
    "--max_positional_length 64 --global_batch_size 8 --micro_batch_size 2 --dropout_prob 0 "
    "--precision float32 --device cpu"
)
# The README's table holds within 15% on a quiet machine for most rows
# (benchmarks/time_model_check.py). Here the suite shares the machine with itself, the
# calibration is the quick one, and this model's step (50-80 ms) is mostly the engine's own
# host time, which moves most from run to run: over repeated runs the ratio spread from 0.74 to
# 1.57. A factor of 2 either way still fails a model that leaves out the launches (about 0.3
# here) or counts the host copies twice.
FACTOR = 2.0


@pytest.mark.parametrize(
    "flags",
    [
        "--passes 1 --placement resident --recompute none",
        "--passes 2 --placement remote --recompute full",
    ],
)
@pytest.mark.slow  # needs the calibration, 12 s
def test_the_dry_run_estimates_a_measured_step(quick_calibration, flags):
    """The dry run's step on this machine's calibration, against the median of real steps."""
    _, spec_path = quick_calibration
    config, _ = parse_config([*SMALL, *shlex.split(flags), "--device_spec_file", str(spec_path)])
    engine = planned_engine(config, ParallelLayout.single(torch.device("cpu")))
    plan = engine.plan
    row = plan.sequence_length + plan.model.label_columns
    tokens = torch.randint(0, 1024, (plan.gradient_accumulation, plan.micro_batch_size, row))
    times = []
    for step in range(10):
        started = time.perf_counter()
        engine.train_step(tokens, step=step, lr=1e-3)
        times.append(time.perf_counter() - started)
    measured = statistics.median(times[2:])
    spec = resolve_spec(config)
    estimated = estimate(config, measure_rank(config, 0, spec), spec)["step_time_s"]
    assert 1 / FACTOR <= estimated / measured <= FACTOR, (estimated, measured)

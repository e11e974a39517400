"""benchmarks/idle_gaps.py: a GPU step's idle time split by hand on a made-up trace, the
engine's phases labelled in a real profiled CPU step, and its phase clock."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest
import torch

from benchmarks import idle_gaps
from config.loading import parse_config
from execution.engine.engine import PhasedEngine, StepHooks
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape

ROOT = Path(__file__).resolve().parents[2]


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _kernel(ts: float, dur: float, correlation: int) -> dict:
    return _x("kernel", "gemm", ts, dur, tid=7, correlation=correlation)


def _launch(ts: float, correlation: int) -> dict:
    return _x("cuda_runtime", "cudaLaunchKernel", ts, 2.0, correlation=correlation)


def test_idle_time_split_by_hand():
    events = [
        _x("user_annotation", "ProfilerStep#1", 0.0, 1000.0),  # the profiler's, around ours
        _x("user_annotation", "bench:step", 0.0, 1000.0),
        _x("user_annotation", "phase:layer_forward", 5.0, 395.0),
        _x("user_annotation", "phase:layer_backward", 400.0, 450.0),
        # Kineto's copies of the ranges on the GPU's timeline, later: never the host's
        _x("gpu_user_annotation", "bench:step", -50.0, 1100.0, tid=7),
        _x("gpu_user_annotation", "phase:layer_forward", 10.0, 490.0, tid=7),
        _x("gpu_user_annotation", "phase:layer_backward", 500.0, 400.0, tid=7),
        # 0-10: the step's first 10 us, the host in Python until the first launch at 8
        _launch(8.0, 1),
        _kernel(10.0, 90.0, 1),  # busy 10-100
        # 100-200: the host inside aten::item waiting on cudaStreamSynchronize (100-180),
        # then Python (180-196); the launch at 196, the kernel at 200 (4 us latency)
        _x("cpu_op", "aten::item", 90.0, 95.0),
        _x("cuda_runtime", "cudaStreamSynchronize", 95.0, 85.0),
        _launch(196.0, 2),
        _kernel(200.0, 100.0, 2),  # busy 200-300
        # 300-420: queued at 250 (before the gap), behind a copy 280-410 on another stream
        _launch(250.0, 3),
        _x("gpu_memcpy", "Memcpy HtoD", 280.0, 130.0, tid=8),
        _kernel(420.0, 80.0, 3),  # busy 420-500
        # 500-600: queued at 450, nothing in flight: an event of another stream
        _launch(450.0, 4),
        _kernel(600.0, 300.0, 4),  # busy 600-900; 900-1000 after the last kernel
    ]
    result = idle_gaps.idle_gaps(events)
    assert result["step_ms"] == pytest.approx(1.0)
    # idle: 10 + 100 + 120 + 100 + 100 us
    assert result["idle_ms"] == pytest.approx(0.430)
    split = {(g["phase"], g["cause"]): g["ms"] for g in result["gaps"]}
    assert split == pytest.approx(
        {
            # 0-8 sampled at 1 us: 0-5 outside the phase labels, 5-8 in layer_forward, both
            # in Python; and 100-196 at 12 us: 106-178 (7 samples) synchronising, 190 in Python
            ("outside phases", "python (between ops)"): 0.005,
            ("layer_forward", "python (between ops)"): 0.003 + 0.012,
            ("layer_forward", "aten::item > cudaStreamSynchronize"): 0.084,
            ("layer_forward", "launch latency"): 0.002 + 0.004,
            ("layer_forward", "device waits (a copy in flight)"): 0.120,  # launched at 250
            ("layer_backward", "device waits (event)"): 0.100,  # launched at 450
            ("after the last kernel", "until the step returned"): 0.100,
        }
    )
    assert sum(split.values()) == pytest.approx(result["idle_ms"])
    assert result["host_ms_by_phase"] == pytest.approx(
        {"layer_forward": 0.395, "layer_backward": 0.45}
    )
    # each kernel by the phase its launch was in: 90 + 100 + 80 us, and 300
    assert result["kernel_ms_by_phase"] == pytest.approx(
        {"layer_forward": 0.27, "layer_backward": 0.3}
    )


KINDS = ("embedding_forward", "layer_forward", "head", "layer_backward", "embedding_backward")


def _tiny_engine():
    flags = (
        "--config tiny --layers 2 --hidden_size 32 --sequence_length 16 "
        "--max_positional_length 16 --global_batch_size 2 --micro_batch_size 1 "
        "--device cpu --compile false"
    )
    config, _ = parse_config(shlex.split(flags))
    layout = ParallelLayout.single(torch.device("cpu"))
    run = RunShape.of(config)
    memory, _ = plan_for_process(run, layout)
    return PhasedEngine(run.engine_plan(memory), layout), torch.randint(0, 100, (2, 1, 17))


def test_a_profiled_step_labels_the_engines_phases():
    """On a CPU, the labels the engine's hook opens are in the trace, phase by phase, inside
    the step (the split itself needs kernels: a GPU)."""
    engine, tokens = _tiny_engine()

    def step(i: int, on_phase=None) -> float:
        return engine.train_step(tokens, i, 1e-4, StepHooks(on_phase=on_phase)).loss

    result = idle_gaps.profile_idle(step, 0, torch.device("cpu"))
    assert set(result["host_ms_by_phase"]) == set(KINDS), result["host_ms_by_phase"]
    assert 0 < sum(result["host_ms_by_phase"].values()) < result["step_ms"]
    assert [g["phase"] for g in result["gaps"]] == ["after the last kernel"]  # no kernels


def test_phase_clock_and_the_estimates_by_kind():
    """The clock's segments on a CPU: each kind of phase and what follows them, within the
    step's wall time; estimate_rows lines them up with the dry run's kinds."""
    engine, tokens = _tiny_engine()
    clock = idle_gaps.PhaseClock(torch.device("cpu"))
    started = time.perf_counter()
    engine.train_step(tokens, 0, 1e-4, StepHooks(on_phase=clock))
    clock.stop()
    wall = time.perf_counter() - started
    seconds = clock.seconds()
    assert set(seconds) == {*KINDS, idle_gaps.AFTER_PHASES}
    assert all(t["host_s"] > 0 and t["device_s"] is None for t in seconds.values())
    assert sum(t["host_s"] for t in seconds.values()) <= wall

    from benchmarks import estimate_rows

    clock = {"layer_forward": {"host_s": 1.5, "device_s": 2.0}, "after phases": {"host_s": 0.1}}
    lines = estimate_rows.by_kind_lines(clock, {"layer_forward": 1.75, "optimizer": 0.05})
    assert [line.split() for line in lines[1:]] == [
        ["layer_forward", "2.000", "1.750", "1.500"],
        ["after", "phases", "-", "0.050", "0.100"],
    ]


def test_kernels_alike_in_time_are_not_compared_further():
    """Two kernels that start and end together (on two streams) are one busy stretch; their
    events, dicts, are never compared."""
    events = [
        _x("user_annotation", "bench:step", 0.0, 100.0),
        _launch(2.0, 1),
        _launch(3.0, 2),
        _kernel(10.0, 50.0, 1),
        _kernel(10.0, 50.0, 2),
    ]
    result = idle_gaps.idle_gaps(events)
    assert result["idle_ms"] == pytest.approx(0.010 + 0.040)  # 0-10, then 60-100
    assert result["kernel_ms_by_phase"] == pytest.approx({"outside phases": 0.1})


def test_the_waits_for_the_update_behind_a_step_row_by_row():
    """What the next GPU run prints of the host update behind its clocked step: each row's
    end and its loads' wait, in the update's order, and estimate_rows' one line of them."""
    rows = [
        {"part": "embedding", "row": 0, "written_s": 0.086, "waited_s": 0.086},
        {"part": "layers", "row": 0, "written_s": 0.170, "waited_s": 0.0},
        {"part": "head", "row": 0, "written_s": None, "waited_s": 0.25},
    ]
    lines = idle_gaps.format_update_behind(rows).splitlines()
    assert [line.split() for line in lines[2:5]] == [
        ["embedding", "0", "0.086", "0.086"],
        ["layers", "0", "0.170", "0.000"],
        ["head", "0", "-", "0.250"],
    ]
    assert lines[-1] == "loads waited 0.336 s in all; the update wrote its last row at 0.170 s"

    from benchmarks import estimate_rows

    assert estimate_rows.update_behind_line(rows) == (
        "loads waited 0.336 s for the host update behind the step (longest 0.250 s, head 0); "
        "its last row written at 0.170 s"
    )

"""benchmarks/bench_step.py as a user runs it on a CPU, and its trace arithmetic by hand."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_step
from tests.entry_points import assert_refused, run_script

ROOT = Path(__file__).resolve().parents[2]

SMALL = shlex.split(
    "--hidden_size 32 --sequence_length 32 --max_positional_length 32 "
    "--global_batch_size 4 --micro_batch_size 2 --device cpu"
)

# What gpu_activity makes of a trace with no kernels and no copies: idle all along, no rates.
NOTHING_RECORDED = {
    "h2d_GBps": None,
    "h2d_GB": 0.0,
    "d2h_GBps": None,
    "d2h_GB": 0.0,
    "gpu_idle": 1.0,
    "attention_kernels": [],
}


@pytest.mark.slow
def test_compare_on_cpu_has_every_row_and_the_baseline_agrees_with_us(tmp_path):
    out = tmp_path / "rows.json"
    # In one process, to keep the test short; test_an_out_of_memory_row_is_its_result and
    # tests/benchmarks/test_gpu_first_run.py run rows in processes of their own.
    run = "--config tiny --warmup 1 --steps 1 --compare --in_process --adamw_elements 300000"
    command = [sys.executable, "-m", "benchmarks.bench_step", *shlex.split(run), "--json", str(out)]
    result = subprocess.run(
        [*command, *SMALL], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    ours_labels = [bench_step.VARIANTS[key].label for key in bench_step.COMPARE[:3]]
    plain_label, fsdp2_label = "pytorch loop (ckpt, AdamW)", bench_step.FSDP2_OFFLOAD
    expected = [*ours_labels, plain_label, fsdp2_label]
    assert list(rows) == expected
    table = result.stdout.splitlines()
    assert table[1].split()[:3] == ["variant", "step", "s"]
    for label in expected:
        assert any(line.startswith(label) for line in table[2:]), label
    assert "needs CUDA" in rows[fsdp2_label]["skipped"]
    assert "host AdamW on 300,000 float32: torch's fused AdamW on 1 core " in result.stdout

    ours, plain = rows[ours_labels[0]], rows[plain_label]
    assert ours["ratio"] == 1.0 and plain["ratio"] == pytest.approx(
        plain["tokens_per_s"] / ours["tokens_per_s"]
    )
    for label in [*ours_labels, plain_label]:
        row = rows[label]
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(128 / row["step_s"])
        assert row["mfu"] is None and row["h2d_GBps"] is None and row["gpu_idle"] is None
        assert row["peak_mem_GiB"] > 0.05 and row["host_rss_GiB"] > 0.05
        # Same weights, same batch, float32: the independent loop's first loss is ours, and
        # after an AdamW update (same lr schedule, clipping, decay groups) still close.
        assert row["first_loss"] == pytest.approx(ours["first_loss"], abs=1e-4)
        assert row["last_loss"] == pytest.approx(ours["last_loss"], abs=1e-3)
        assert row["last_loss"] < row["first_loss"]
        assert row["tokens_per_step"] == 4 * 32 and row["device_cap_GiB"] is None
        assert row["host_peak_GiB"] >= row["host_rss_GiB"] > 0
    # In float32 a parameter's state is its weight, gradient and two AdamW moments, 4 bytes
    # each: 16 bytes (ours pads a few shards to the RTS group, within 0.1%).
    assert rows[plain_label]["state_bytes_per_param"] == 16
    assert ours["state_bytes_per_param"] == pytest.approx(16, rel=1e-3)
    assert ours["setup_s"]["buffers"] > 0 and ours["setup_s"]["weights"] > 0


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_an_out_of_memory_row_is_its_result_in_one_line():
    """A plain loop whose embedding alone needs ~200 GB: its process records the allocator's
    error as the row, and the caller gets the row instead of a crash."""
    huge = ["--config", "tiny", "--device", "cpu", "--hidden_size", str(2**20), "--heads", "1"]
    run_args = argparse.Namespace(steps=1, warmup=0, no_profile=True)
    row = bench_step.run_row("plain", huge, run_args, timeout=120)
    assert row["variant"] == "pytorch loop (ckpt, AdamW)"
    assert row["error"].startswith("out of memory: ") and "\n" not in row["error"]
    assert "tokens_per_s" not in row
    assert bench_step.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"))
    assert not bench_step.out_of_memory(ValueError("out of memory"))


def _copy(name: str, ts: float, dur: float, nbytes: int) -> dict:
    """A completed ("X") memcpy event of a Kineto trace."""
    return dict(ph="X", cat="gpu_memcpy", name=name, ts=ts, dur=dur, args={"bytes": nbytes})


def test_gpu_activity_from_a_hand_made_trace():
    h2d, d2h = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
    events = [
        # two overlapping kernels (0-30 and 20-50 us) and one apart (80-90): 60 us busy
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1000.0, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "gelu", "ts": 1020.0, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "add", "ts": 1080.0, "dur": 10.0},
        # a fused attention kernel inside the first: counted once, and named
        {"ph": "X", "cat": "kernel", "name": "fmha_cutlassF_f32", "ts": 1005.0, "dur": 5.0},
        # 4 MB host-to-device in 100 us + 2 MB in 100 us: 30 GB/s; 1 MB back in 50 us: 20 GB/s
        _copy(h2d, ts=900.0, dur=100.0, nbytes=4_000_000),
        _copy(h2d, ts=1000.0, dur=100.0, nbytes=2_000_000),
        _copy(d2h, ts=1100.0, dur=50.0, nbytes=1_000_000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 990.0, "dur": 500.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1000.0},
    ]
    activity = bench_step.gpu_activity(events, wall_seconds=200e-6)
    assert activity["h2d_GBps"] == pytest.approx(30.0)
    assert activity["d2h_GBps"] == pytest.approx(20.0)
    assert activity["h2d_GB"] == pytest.approx(0.006) and activity["d2h_GB"] == pytest.approx(0.001)
    assert activity["gpu_idle"] == pytest.approx(1 - 60 / 200)
    assert activity["attention_kernels"] == ["fmha_cutlassF_f32"]
    assert bench_step.gpu_activity([], 1.0) == NOTHING_RECORDED


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run python -m benchmarks.gpu_check itself")
    command = [sys.executable, "-m", "benchmarks.gpu_check"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "--device cpu" in lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--layers 0", "--layers must be at least 1, got 0"),
        ("--nonsense 1", "unrecognized arguments: --nonsense 1"),
        ("--steps 0", "--steps must be >= 1"),
        ("--json {tmp}/missing/rows.json", "--json {tmp}/missing/rows.json: its folder"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_any_row_runs(tmp_path, flags, message):
    command = shlex.split(flags.format(tmp=tmp_path))
    result = run_script("-m", "benchmarks.bench_step", *command, "--adamw_elements", "0")
    assert_refused(result, "benchmarks.bench_step", message.format(tmp=tmp_path))
    assert result.stderr.startswith(f"benchmarks.bench_step: error: {message.format(tmp=tmp_path)}")
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_profile_step_records_only_the_step_after_the_profiler_warm_up():
    import torch

    calls = []

    def step(i: int) -> float:
        calls.append(i)
        return float(torch.ones(64, 64).matmul(torch.ones(64, 64)).sum())

    activity = bench_step.profile_step(step, 7, torch.device("cpu"))
    assert calls == [7, 8]
    # A CPU records no kernels and no copies: idle all along, no rates.
    assert activity == NOTHING_RECORDED

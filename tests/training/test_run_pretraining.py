"""The real entry point, as a user runs it: trains the tiny preset, writes metrics, fails cleanly."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.entry_points import run_script

ROOT = Path(__file__).resolve().parents[2]
METRIC_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_sec",
    "tokens_per_sec",
    "tflops",
    "mfu",
    "step_time",
    "data_time",
}


def run(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_script("run_pretraining.py", *flags, timeout=timeout)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_preset_lowers_the_loss_on_the_sample_data(tmp_path):
    result = run("--config", "tiny", "--steps", "12", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"output: {tmp_path}/metrics.jsonl" in result.stdout
    metrics = [m for m in read_metrics(tmp_path) if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(m.keys() >= METRIC_KEYS for m in metrics)
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-3:]) / 3
    assert first == pytest.approx(10.8, abs=0.3)  # ln(50257): an untrained model
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "config.yml").exists()


@pytest.mark.slow
def test_bfloat16_with_evaluation_and_offline_wandb(tmp_path):
    evaluation = ["--eval_every", "2", "--eval_batches", "2"]
    wandb = ["--wandb", "--wandb_mode", "offline"]
    # Steps of 4 sequences of 32 tokens: bfloat16 matmuls without the CPU's bf16 instructions
    # are slow (the head's, over 50k words, took 20 s per step of the preset's 1,024 tokens).
    shape = ["--global_batch_size", "4", "--micro_batch_size", "2", "--sequence_length", "32"]
    flags = ["--config", "tiny", "--steps", "3", "--precision", "bfloat16", *shape]
    flags += [*evaluation, *wandb]
    result = run(*flags, "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    # The batch is prefetched during the previous step; the wait for it is reported.
    assert all(0 <= m["data_time"] < m["step_time"] + 1 for m in metrics if "loss" in m)
    assert "| data " in result.stdout
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 3] and all(8 < m["eval_loss"] < 12 for m in evals)
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layers", "0"], "--layers must be at least 1, got 0"),
        (["--nonsense", "1"], "unrecognized arguments: --nonsense 1"),
        (["--config", "tiny", "--data_parallel", "2"], "but the job has 1"),
        (["--input_files", "/nonexistent/*.tfrecord"], "/nonexistent/*.tfrecord"),
        (["--input_files", "data/sample/*.tfrecord", "--eval_every", "2"], "needs held-out data"),
        (["--config", "gpt3_175B"], "this run needs at least"),  # planned before allocating
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, flags, message):
    result = run(*flags, "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_pretraining.py: error: "), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_an_output_dir_with_metrics_is_not_reused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    result = run("--steps", "1", "--output_dir", str(tmp_path))
    assert result.returncode == 2 and "already holds the metrics.jsonl" in result.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'


@pytest.mark.slow
def test_skipped_corrupt_records_are_reported(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "sample", data, ignore=shutil.ignore_patterns("validation"))
    shard = data / "data_0000.tfrecord"
    payload = bytearray(shard.read_bytes())
    payload[100] ^= 0xFF  # inside the first record's data: its CRC no longer matches
    shard.write_bytes(bytes(payload))
    flags = ["--steps", "2", "--input_files", str(data / "*.tfrecord")]

    failed = run(*flags, "--output_dir", str(tmp_path / "strict"))
    assert failed.returncode == 2 and "data_0000.tfrecord" in failed.stderr

    result = run(*flags, "--skip_corrupt_records", "--output_dir", str(tmp_path / "lenient"))
    assert result.returncode == 0, result.stderr
    assert "corrupt records skipped" in result.stdout
    lenient = read_metrics(tmp_path / "lenient")
    assert [m["step"] for m in lenient] == [1, 2]  # so that all() below is not vacuously true
    assert all(m["skipped_records"] >= 1 for m in lenient)


@pytest.mark.slow
def test_start_up_prints_the_memory_plan(tmp_path):
    plan = ["--passes", "2", "--placement", "remote"]
    result = run("--config", "tiny", "--steps", "1", *plan, "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (
        "plan: 2 pass(es) of 1 micro-batch(es); weights on host, grads on host, " in result.stdout
    )
    assert "activations on host" in result.stdout


@pytest.mark.slow
def test_a_run_that_fits_no_plan_says_what_would_fit(tmp_path):
    """gpt3_6.7B in 8 GiB: one line with the least memory it needs and the flags that fit;
    nothing is written."""
    machine = ["--device", "cpu", "--host_memory_gb", "8"]
    result = run("--config", "gpt3_6.7B", *machine, "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "this run needs at least" in lines[0] and "8.0 GiB of host memory" in lines[0]
    assert "it would fit with --" in lines[0] and " processes)" in lines[0]
    assert not (tmp_path / "out").exists()

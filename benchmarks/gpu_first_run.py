"""The first run on a GPU, in one command that fits a lent GPU's minutes and cannot lose them.

    python -m benchmarks.gpu_first_run --results_dir DIR          # one H200: about 8 minutes
    python -m benchmarks.gpu_first_run --device cpu --quick --json out.json   # tiny, for tests
    python -m benchmarks.gpu_first_run --stages calibration row:1.3B-dropout0 # some stages again

Stages, in order of value (first_run_stages.py), each in a process of its own with its own
time limit:

1. probe: the device, its free memory, the host's memory, torch's and CUDA's versions;
   then attention: each fused attention kernel timed at the rows' calls
   (calibrate_attention.py), written beside the results as ``<name>.attention.json``, a
   device spec file the rows run with: each row's engine runs the fastest kernel that
   passes its check (the kernel a row ran, and any it passed over, are in its results);
2. rows: ``llama3_8B`` at full depth, streamed, capped at an H100's memory and at 24 GiB;
   ``gpt3_6.7B`` at full depth, streamed and capped; ``gpt3_1.3B`` resident, compiled at
   dropout 0 and 0.1 and eager; ours streamed against FSDP2 with CPU offload on the same model,
   batch and recompute, both compiled. Each prints how long its buffers (the host pages
   registered) and its weights took to set up;
3. checks: gpu_check.py's correctness checks (remote, host activations, host gradients and
   bfloat16 host weights against resident, with late side streams; GPU against CPU; NCCL;
   pinned prefetch; attention's dropout as one op). A check that kills its process is
   recorded as failed and the remaining checks run in a fresh one;
4. parity: ours, the plain PyTorch loop and FSDP2 with CPU offload at a small size in float32,
   each in its own process: their first losses must agree (the baselines train our model);
5. calibration: calibrate.py's constants, written beside the results as ``<name>.spec.json``.

A real run sizes its stages by ``benchmarks/first_run_plan.json`` (``estimate_rows.py --plan
--write``: each row's batch, each stage's price and host memory, the stages the budget plans).
This process never touches CUDA: a fault in one stage cannot poison another. The results file
is rewritten atomically after every stage. A planned stage starts when the budget
(``--budget_s``) leaves the time it needs (``need_s``), and its limit is cut so that the planned
stages after it keep theirs; a stage the budget did not plan runs only on time the planned ones
do not need; a row whose plan does not fit the host's memory (the probe's) or whose dry run
fits nothing is recorded as skipped, with why. A row keeps the steps that ended and the end of
its output if it is killed at its limit. ``benchmarks/estimate_rows.py`` later prices exactly
the plans the rows ran with the calibrated spec, on any CPU, and ``benchmarks/gpu_table.py``
renders the README's table from the results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import bench_step
from benchmarks.baselines import fsdp2_host_bytes
from benchmarks.child_process import read_json_lines, run_child
from benchmarks.first_run_stages import (
    DEFAULT_BUDGET_S,
    Stage,
    quick_stages,
    read_plan,
    real_stages,
)
from benchmarks.gpu_table import device_slug, run_lines
from benchmarks.stage_prices import host_fits
from config.command_line import (
    check_output_file,
    check_output_folder,
    exit_for_bad_input,
    exit_on_bad_input,
)
from config.loading import OneLineParser, parse_config
from execution.checkpoint.files import write_atomic

HERE = Path(__file__).resolve().parent
CHECK_STEPS = 2  # the second step's loss shows the first update's gradients
PARITY_TOLERANCE = 1e-4  # float32 first losses near ln(50257); summation order only
HOST_HEADROOM = 1.15  # Python, CUDA context, batches and the allocator's slack beside FSDP2's
PROBE = """
import json, os, sys, torch
out = {"torch": torch.__version__, "cpus": os.cpu_count(), "python": sys.version.split()[0]}
with open("/proc/meminfo") as meminfo:
    kib = {line.split(":")[0]: int(line.split()[1]) for line in meminfo}
out["host_available_GiB"] = kib["MemAvailable"] / 2**20
out["host_total_GiB"] = kib["MemTotal"] / 2**20
if sys.argv[1] == "cuda":
    free, total = torch.cuda.mem_get_info(0)
    props = torch.cuda.get_device_properties(0)
    out.update(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
               cuda=torch.version.cuda, free_GiB=free / 2**30, total_GiB=total / 2**30,
               gpus=torch.cuda.device_count())
else:
    out.update(name="cpu", cuda=None)
print("PROBE " + json.dumps(out))
"""


def stages(device: str, quick: bool) -> list[Stage]:
    """What the run does, in order, with the time each needs and may take: at CPU size, or
    sized by the priced plan (first_run_stages.py; ValueError where it is missing or stale)."""
    return quick_stages(device) if quick else real_stages(device, read_plan())


@dataclass
class Report:
    """What the results file holds, rewritten atomically after every stage."""

    path: Path
    device: str
    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    probe: dict = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def write(self) -> None:
        data = {
            "device": self.device,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed(),
            "probe": self.probe,
            "stages": self.stages,
            "checks": self.checks,
            "rows": self.rows,
        }
        write_atomic(self.path, json.dumps(data, indent=1))  # never half a file, even if killed

    @property
    def spec_file(self) -> Path:
        return self.path.with_suffix(".spec.json")

    @property
    def attention_file(self) -> Path:
        """The attention stage's timings: the device spec file the rows run with."""
        return self.path.with_suffix(".attention.json")


def run_probe(stage: Stage, report: Report, timeout: float) -> dict:
    done = run_child([sys.executable, "-c", PROBE, report.device], timeout)
    found = re.search(r"^PROBE (.*)$", done.output, re.MULTILINE)
    if done.returncode == 0 and found:
        report.probe = json.loads(found.group(1))
        return {"ok": True}
    return {"ok": False, "error": done.last_line(), "output_tail": done.tail}


def run_checks(stage: Stage, report: Report, timeout: float, quick: bool) -> dict:
    """gpu_check.py in a process; after a crash, the remaining checks in a fresh one."""
    from benchmarks import gpu_check

    names, record = list(gpu_check.CHECKS), report.path.with_suffix(".checks.jsonl")
    record.unlink(missing_ok=True)
    deadline, crashes = time.perf_counter() + timeout, []
    while names:
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--device", report.device]
        command += ["--steps", str(CHECK_STEPS), "--json", str(record), "--checks", *names]
        done = run_child(
            [*command, *(["--quick"] if quick else [])], deadline - time.perf_counter()
        )
        ended = read_json_lines(record)
        report.checks = ended + crashes
        names = [n for n in gpu_check.CHECKS if n not in {c["check"] for c in report.checks}]
        if done.returncode in (0, 1) or not names:
            break
        if done.returncode == gpu_check.CUDA_POISONED_EXIT:
            continue  # the failed check is recorded; the rest run in a fresh process
        why = "timed out" if done.timed_out else f"its process ended with {done.returncode}"
        crashes.append(
            {
                "check": names[0],
                "ok": False,
                "detail": f"{why}: {done.last_line()}",
                "output_tail": done.tail,
            }
        )
        report.checks = ended + crashes
        names = names[1:]
        if done.timed_out or time.perf_counter() >= deadline:
            break
    record.unlink(missing_ok=True)
    return {"ok": all(c["ok"] is not False for c in report.checks)}


def run_calibration(stage: Stage, report: Report, timeout: float, quick: bool) -> dict:
    command = [sys.executable, "-m", "benchmarks.calibrate", "--device", report.device]
    command += ["--output", str(report.spec_file), *(["--quick"] if quick else [])]
    if "h200" in report.probe.get("name", "").lower():
        command += ["--base", "h200"]
    done = run_child(command, timeout)
    if done.returncode == 0 and report.spec_file.exists():
        return {"ok": True, "spec_file": report.spec_file.name}
    why = "timed out" if done.timed_out else f"exit code {done.returncode}"
    return {"ok": False, "error": f"{why}: {done.last_line()}", "output_tail": done.tail}


def run_attention(stage: Stage, report: Report, timeout: float) -> dict:
    command = [sys.executable, "-m", "benchmarks.calibrate_attention", "--device", report.device]
    done = run_child([*command, "--output", str(report.attention_file)], timeout)
    if done.returncode == 0 and report.attention_file.exists():
        return {"ok": True, "spec_file": report.attention_file.name, "output_tail": done.tail}
    why = "timed out" if done.timed_out else f"exit code {done.returncode}"
    return {"ok": False, "error": f"{why}: {done.last_line()}", "output_tail": done.tail}


def run_row(stage: Stage, report: Report, timeout: float) -> dict:
    if stage.row == "fsdp2":
        if report.device != "cuda":
            row = {"variant": bench_step.FSDP2_OFFLOAD, "skipped": bench_step.FSDP2_NEEDS_CUDA}
            return _record_row(stage, report, row)
        config, _ = parse_config(list(stage.flags))
        needed = fsdp2_host_bytes(config) * HOST_HEADROOM / 2**30
        available = report.probe.get("host_available_GiB", float("inf"))
        if needed > available:
            why = f"FSDP2's host state needs {needed:.0f} GiB, {available:.0f} GiB available"
            return _record_row(stage, report, {"variant": bench_step.FSDP2_OFFLOAD, "skipped": why})
    run_args = argparse.Namespace(
        steps=stage.steps,
        warmup=stage.warmup,
        no_profile=not stage.profile,
        # Our rows clock their phases (free); the profiled ones also split their idle time.
        idle_gaps=True,
    )
    flags = list(stage.flags)
    if report.attention_file.exists():  # the kernels' timings: the engine runs the fastest
        flags += ["--device_spec_file", str(report.attention_file)]
    row = bench_step.run_row(stage.row, flags, run_args, timeout)
    return _record_row(stage, report, row)


def _record_row(stage: Stage, report: Report, row: dict) -> dict:
    row.pop("ratio", None)  # against itself: each row ran alone
    row.update(stage=stage.name, key=stage.row, flags=list(stage.flags))
    report.rows.append(row)
    return {"ok": "error" not in row}


def run_stage(stage: Stage, report: Report, timeout: float, quick: bool) -> dict:
    if stage.kind == "probe":
        return run_probe(stage, report, timeout)
    if stage.kind == "checks":
        return run_checks(stage, report, timeout, quick)
    if stage.kind == "calibration":
        return run_calibration(stage, report, timeout, quick)
    if stage.kind == "attention":
        return run_attention(stage, report, timeout)
    return run_row(stage, report, timeout)


def parity_verdict(rows: list[dict]) -> dict:
    """The parity stage as one check: each baseline's first loss against ours."""
    parity = {r["key"]: r for r in rows if r["stage"].startswith("parity:")}
    ours = parity.get("ours", {}).get("first_loss")
    others = {k: r["first_loss"] for k, r in parity.items() if k != "ours" and "first_loss" in r}
    if ours is None or not others:
        return {"check": "parity: first losses", "ok": None, "detail": "not enough rows ran"}
    worst = max(abs(loss - ours) for loss in others.values())
    detail = f"max |first loss - ours| {worst:.1e} over {', '.join(others)} (tolerance 1e-4)"
    return {"check": "parity: first losses", "ok": worst <= PARITY_TOLERANCE, "detail": detail}


def results_path(args: argparse.Namespace, probe: dict) -> Path:
    """``--json``, or ``<results_dir>/<date>-<device name>.json``."""
    if args.json:
        return Path(args.json)
    name = device_slug(probe.get("name", args.device))
    return Path(args.results_dir) / f"{datetime.date.today().isoformat()}-{name}.json"


def check_results_files(flag: str, path: Path) -> None:
    """Every file a run writes beside its results, checked before the stages spend minutes of
    a lent device: a folder or a read-only file in the way is one line, not a lost run."""
    beside = (".spec.json", ".checks.jsonl", ".attention.json")
    for file in (path, *(path.with_suffix(suffix) for suffix in beside)):
        check_output_file(flag, file)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="the results file (default: in --results_dir)")
    parser.add_argument(
        "--results_dir",
        default=str(HERE / "results"),
        help="where <date>-<device>.json and .spec.json go without --json",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument(
        "--budget_s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds the stages may take in all (stages that do not fit are skipped)",
    )
    stages_help = "run only these stages (and the probe), e.g. calibration row:1.3B-eager"
    parser.add_argument("--stages", nargs="+", metavar="STAGE", help=stages_help)
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget_s must be a positive number of seconds")
    try:
        plan = stages(args.device, args.quick)
    except ValueError as err:  # the priced plan is missing or is of other stages
        parser.error(
            f"{err}; price the stages with python -m benchmarks.estimate_rows --plan --write"
        )
    unknown = sorted(set(args.stages or ()) - {s.name for s in plan})
    if unknown:
        names = " ".join(s.name for s in plan)
        parser.error(f"--stages: no stage {', '.join(unknown)} (the stages: {names})")
    plan = [s for s in plan if s.kind == "probe" or not args.stages or s.name in args.stages]
    if args.json:
        check_results_files("--json", Path(args.json))
    else:
        check_output_folder("--results_dir", args.results_dir)
        if not Path(args.results_dir).is_dir():
            parser.error(f"--results_dir {args.results_dir}: no such folder")
    report = Report(Path(os.devnull), args.device, args.budget_s)
    for n, stage in enumerate(plan):
        left = args.budget_s - report.elapsed()
        later = sum(s.need_s for s in plan[n + 1 :] if s.planned)
        why = None if stage.kind == "probe" else why_skipped(stage, report.probe, left, later)
        if why:  # the probe names the results, so it always runs
            outcome = {"skipped": why}
            if stage.row:
                row = {"variant": bench_step.VARIANTS[stage.row].label, "skipped": why}
                _record_row(stage, report, row)
        else:
            # A stage the budget did not plan takes no planned stage's time.
            floor = stage.need_s if stage.planned else 0
            timeout = min(stage.limit_s, max(floor, left - later, 0), max(left, 0))
            if stage.kind == "probe":
                timeout = stage.limit_s
            started = time.perf_counter()
            try:
                outcome = run_stage(stage, report, timeout, args.quick)
            except Exception as err:  # reading a stage's output: the stages after it still run
                outcome = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                outcome["traceback"] = traceback.format_exc()
            outcome["seconds"] = time.perf_counter() - started
        if stage.kind == "probe":
            report.path = results_path(args, report.probe)
            if not args.json:  # the name waited for the device's: checked before any stage
                check_results_files("--results_dir", report.path)
        report.stages[stage.name] = outcome
        if stage.kind == "probe" and not outcome.get("ok"):
            report.write()  # what the probe printed is the one thing to read
            why = outcome.get("error", outcome.get("skipped"))
            message = f"the {args.device} device cannot be used: {why}"
            exit_for_bad_input("benchmarks.gpu_first_run", message)
        print(
            f"== {stage.name}: {_outcome_line(outcome)} (elapsed {report.elapsed():.0f} s "
            f"of {args.budget_s:.0f} s)",
            flush=True,
        )
        if stage.row and report.rows and report.rows[-1].get("setup_s"):
            print(setup_line(report.rows[-1]), flush=True)
        if stage.name == "parity:fsdp2":
            report.checks.append(parity_verdict(report.rows))
        report.write()

    print(bench_step.format_table(report.rows))
    print("\n".join(run_lines(report.path, {"probe": report.probe, "rows": report.rows})))
    failed = [c["check"] for c in report.checks if c["ok"] is False]
    print(f"checks failed: {', '.join(failed)}" if failed else "checks: none failed")
    spec = f" and {report.spec_file.name}" if report.spec_file.exists() else ""
    print(f"total {report.elapsed():.0f} s; written: {report.path}{spec}")
    return 1 if failed else 0


def why_skipped(stage: Stage, probe: dict, left: float, later: float) -> str | None:
    """Why ``stage`` does not start with ``left`` seconds of the budget, ``later`` of them
    planned for the stages after it; None: it starts."""
    if stage.skip:  # the dry run of its plan says it cannot run here
        return stage.skip
    if stage.planned and left < stage.need_s:
        return f"{left:.0f} s of the budget left, it needs {stage.need_s:.0f} s"
    if not stage.planned and left - later < stage.need_s:
        return (
            f"not in the budget's plan, and {left:.0f} s left less the planned stages' "
            f"{later:.0f} s is under the {stage.need_s:.0f} s it needs"
        )
    available = probe.get("host_available_GiB")
    if stage.host_GiB and available and not host_fits(stage.host_GiB, available):
        return (
            f"its plan holds {stage.host_GiB:.1f} GiB of host memory; the host has "
            f"{available:.1f} GiB available, of which a plan may take 90%"
        )
    return None


def setup_line(row: dict) -> str:
    """A row's set-up as the engine timed it: the goal is an 8B model drawn within a minute."""
    setup = row["setup_s"]
    host = row.get("host_peak_GiB")
    return (
        f"   set-up: buffers {setup['buffers']:.1f} s (host pages allocated and registered), "
        f"weights drawn {setup['weights']:.1f} s; host peak {host or 0:.1f} GiB"
    )


def _outcome_line(outcome: dict) -> str:
    if "skipped" in outcome:
        return f"skipped: {outcome['skipped']}"
    verdict = "ok" if outcome.get("ok") else f"FAILED {outcome.get('error', '')}".strip()
    return f"{verdict}, {outcome['seconds']:.0f} s"


if __name__ == "__main__":
    exit_on_bad_input(lambda: sys.exit(main()), "benchmarks.gpu_first_run")

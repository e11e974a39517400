"""The dry run of exactly the plans a first run's rows ran, priced with its calibrated spec.

    python benchmarks/estimate_rows.py benchmarks/results/2026-11-26-nvidia-h100-80gb-hbm3.json
    python benchmarks/estimate_rows.py RESULTS --update      # also writes the estimates into it

Runs on any CPU, so that a lent GPU's minutes go to measuring (gpu_first_run.py). Each of our
rows recorded the plan it ran (passes, each state's placement, recompute, micro-batch) and the
memory budget it planned against; the dry run is given all of them as flags, so it prices that
plan and not one it would choose itself, and says if its plan still differs. The baselines'
rows (the plain loop, FSDP2) have no plan of ours to price and are listed without an estimate.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import VARIANTS
from command_line import check_output_file, exit_on_bad_input

from config.errors import ConfigError
from config.loading import OneLineParser, parse_config
from execution.checkpoint.files import write_atomic
from execution.planning.dry_run import dry_run
from execution.planning.run_shape import RunShape


def pinned_flags(plan: dict) -> list[str]:
    """Flags that make the planner take ``plan`` (a row's ``plan``) as it ran."""
    placement = plan["placement"]
    flags = ["--passes", str(plan["passes"]), "--recompute", plan["recompute"]]
    for state in ("weights", "grads", "activations"):
        flags += [f"--{state}_placement", placement[state]]
    flags += ["--micro_batch_size", str(plan["micro_batch_size"])]
    if plan.get("budget_device_GiB") is not None:
        flags += ["--device_memory_gb", f"{plan['budget_device_GiB']:.6f}"]
    flags += ["--host_memory_gb", f"{plan['budget_host_GiB']:.6f}"]
    return flags


def estimate(row: dict, spec_file: Path) -> dict:
    """The dry run of ``row``'s plan: step time, MFU, and whether it priced the same plan."""
    flags = [*row["flags"], *VARIANTS[row["key"]].flags, *pinned_flags(row["plan"])]
    config, _ = parse_config([*flags, "--dry_run", "--device_spec_file", str(spec_file)])
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        rank = dry_run(RunShape.of(config), Path(tmp))["ranks"][0]
    ran, priced = row["plan"], rank["plan"]
    same = (
        priced["passes"] == ran["passes"]
        and priced["recompute"] == ran["recompute"]
        and dict(priced["placement"]) == ran["placement"]
    )
    return {
        "step_s": rank["step_time_s"],
        "host_s": rank["overhead_s"],
        "host_wait_s": rank["host_wait_s"],
        "mfu": rank["mfu"],
        "ratio": rank["step_time_s"] / row["step_s"],
        "same_plan": same,
        "fits": rank["fits"],
        "by_kind": rank["by_kind"],
        "spec": spec_file.name,
    }


def estimates(results: dict, spec_file: Path) -> list[dict]:
    """Each measured row of ours with its ``estimate`` added; the others unchanged."""
    for row in results["rows"]:
        if "plan" in row and "step_s" in row:
            row["estimate"] = estimate(row, spec_file)
    return results["rows"]


def host_note(spec_file: Path) -> str | None:
    """The line that says a calibration holds no host time per phase, or None where it does."""
    spec = json.loads(spec_file.read_text())["device_spec"]
    if spec.get("host_phase_us"):
        return None
    return (
        f"{spec_file.name} holds no measured host time per phase (host_phase_us): each phase's "
        "host is priced as its kernels x launch_overhead_us + phase_overhead_us, the "
        "calibration's fit (calibrate.py on the GPU's host measures it)"
    )


def table(rows: list[dict]) -> str:
    head = (
        f"{'stage':<16} {'row':<30} {'meas. s':>8} {'est. s':>8} {'est/meas':>8} {'MFU':>6}"
        f" {'host s':>7} {'waits s':>7}"
    )
    lines = [head]
    for row in rows:
        label = f"{row.get('stage', ''):<16} {row['variant']:<30}"
        if "step_s" not in row:
            lines.append(f"{label} {row.get('skipped') or row.get('error', '')}")
            continue
        est = row.get("estimate")
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-"
        priced = f"{est['step_s']:8.3f} {est['ratio']:8.2f}" if est else f"{'-':>8} {'-':>8}"
        host = f" {est['host_s']:7.3f} {est['host_wait_s']:7.3f}" if est else ""
        note = "" if not est or est["same_plan"] else "  (the dry run priced another plan)"
        lines.append(f"{label} {row['step_s']:8.3f} {priced} {mfu:>6}{host}{note}")
        if est and row.get("phase_clock"):
            lines += by_kind_lines(row["phase_clock"], est["by_kind"])
    return "\n".join(lines)


def by_kind_lines(clock: dict, priced: dict) -> list[str]:
    """Each kind of phase of a row whose last timed step clocked its phases (bench_step.py
    --idle_gaps): the device's time and the host's against the dry run's (its optimizer
    window is what follows the phases)."""
    lines = [f"{'':<16} {'  kind':<30} {'device s':>8} {'est. s':>8} {'host s':>8}"]
    for kind, times in clock.items():
        est = priced.get("optimizer" if kind == "after phases" else kind)
        device = times.get("device_s")
        cells = [
            f"{device:8.3f}" if device is not None else f"{'-':>8}",
            f"{est:8.3f}" if est is not None else f"{'-':>8}",
            f"{times['host_s']:8.3f}",
        ]
        lines.append(f"{'':<16} {'  ' + kind:<30} {' '.join(cells)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results file of gpu_first_run.py")
    spec_help = "device spec file (default: the results file's name, ending .spec.json)"
    parser.add_argument("--spec", type=Path, help=spec_help)
    parser.add_argument("--update", action="store_true", help="write the estimates into it")
    args = parser.parse_args(argv)
    if args.update:
        check_output_file("--update", args.results)
    try:
        results = json.loads(args.results.read_text())
        rows = results["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"{args.results}: not a results file of gpu_first_run.py ({err})")
    spec = args.spec or args.results.with_suffix(".spec.json")
    if not spec.is_file():
        parser.error(f"{spec}: no device spec file (the calibration did not run? use --spec)")
    try:
        estimates(results, spec)
    except ConfigError as err:
        parser.error(str(err))
    print(table(rows))
    print("host s: the host's time in the estimated step; waits s: the device's wait for it")
    if note := host_note(spec):
        print(note)
    if args.update:
        write_atomic(args.results, json.dumps(results, indent=1))
        print(f"written: {args.results}")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(lambda: sys.exit(main()), "estimate_rows.py")

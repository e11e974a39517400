"""The dry run of exactly the plans a first run's rows ran, priced with its calibrated spec;
and, before a run, the price of every stage it will run.

    python -m benchmarks.estimate_rows benchmarks/results/2026-11-26-nvidia-h100-80gb-hbm3.json
    python -m benchmarks.estimate_rows RESULTS --update      # also writes the estimates into it
    python -m benchmarks.estimate_rows --plan [--write]      # the next run's stages priced

``--plan`` prices each stage of gpu_first_run.py's next run on a GPU (stage_prices.py: its
rows' dry runs on the newest committed calibration, a targeted row's batch chosen, the other
costs read off the committed results), marks the budget's plan and, with ``--write``, writes
it to ``benchmarks/first_run_plan.json``, which that run sizes its stages by.

Runs on any CPU, so that a lent GPU's minutes go to measuring (gpu_first_run.py). Each of our
rows recorded the plan it ran (passes, each state's placement, recompute, micro-batch) and the
memory budget it planned against; the dry run is given all of them as flags, so it prices that
plan and not one it would choose itself, and says if its plan still differs. The baselines'
rows (the plain loop, FSDP2) have no plan of ours to price and are listed without an estimate.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_step import VARIANTS
from benchmarks.first_run_stages import DEFAULT_BUDGET_S, PLAN_FILE
from benchmarks.gpu_table import RESULTS, result_files
from benchmarks.stage_prices import price_stages
from config.command_line import check_output_file, exit_on_bad_input
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
        if row.get("update_behind"):
            lines.append(f"{'':<16}   {update_behind_line(row['update_behind'])}")
    return "\n".join(lines)


def update_behind_line(rows: list[dict]) -> str:
    """The clocked step's waits for the host update behind it (bench_step.py --idle_gaps), in
    one line: in all, the longest, and when the update wrote its last row."""
    waits = [(r["waited_s"], f"{r['part']} {r['row']}") for r in rows]
    longest = max(waits)
    ends = [r["written_s"] for r in rows if r["written_s"] is not None]
    last = f"{max(ends):.3f} s" if ends else "never"
    return (
        f"loads waited {sum(w for w, _ in waits):.3f} s for the host update behind the step "
        f"(longest {longest[0]:.3f} s, {longest[1]}); its last row written at {last}"
    )


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


def plan_table(plan: dict) -> str:
    """The priced stages: each one's price, whether the budget plans it, and why."""
    lines = [
        f"{'stage':<22} {'batch':>5} {'tokens/step':>11} {'step s':>7} {'host GiB':>8} "
        f"{'dev GiB':>7} {'stage s':>7}  plan"
    ]
    for s in plan["stages"]:
        figures = [
            f"{s['batch'] or '-':>5}" if "batch" in s else f"{'':>5}",
            f"{s['tokens_per_step']:>11,}" if s.get("tokens_per_step") else f"{'':>11}",
            f"{s['predicted_step_s']:>7.1f}" if s.get("predicted_step_s") else f"{'':>7}",
            f"{s['host_GiB']:>8.1f}" if s.get("host_GiB") else f"{'':>8}",
            f"{s['device_GiB']:>7.1f}" if s.get("device_GiB") else f"{'':>7}",
            f"{s['est_s']:>7.1f}",
        ]
        verdict = "skipped" if s.get("skip") else "planned" if s["planned"] else "if time is left"
        why = s.get("skip") or s.get("note", "")
        lines.append(
            f"{s['name']:<22} {' '.join(figures)}  {verdict}" + (f": {why}" if why else "")
        )
    room = plan["budget_s"] * (1 - plan["margin"])
    lines.append(
        f"planned: {plan['planned_s']:.0f} s of the {plan['budget_s']:.0f} s budget less its "
        f"{plan['margin']:.0%} margin ({room:.0f} s); prices on {plan['spec']}"
    )
    return "\n".join(lines)


def newest_spec(folder: Path) -> Path | None:
    """The calibration of the newest committed run (gpu_table.py's order)."""
    specs = [p.with_suffix(".spec.json") for p in result_files(folder)]
    specs = [p for p in specs if p.is_file()]
    return specs[-1] if specs else None


def main_plan(args: argparse.Namespace, parser) -> int:
    results = [json.loads(p.read_text()) for p in result_files(args.results_dir)]
    spec = args.spec or newest_spec(args.results_dir)
    if not results or spec is None:
        parser.error(f"{args.results_dir}: no committed first run to price the stages from")
    plan = price_stages(results, spec, args.budget_s)
    print(plan_table(plan))
    if args.write:
        write_atomic(PLAN_FILE, json.dumps(plan, indent=1) + "\n")
        print(f"written: {PLAN_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", help="a results file of gpu_first_run.py")
    spec_help = "device spec file (default: the results file's name, ending .spec.json)"
    parser.add_argument("--spec", type=Path, help=spec_help)
    parser.add_argument("--update", action="store_true", help="write the estimates into it")
    parser.add_argument("--plan", action="store_true", help="price the next run's stages")
    parser.add_argument("--write", action="store_true", help="--plan: write its plan file")
    parser.add_argument("--budget_s", type=float, default=DEFAULT_BUDGET_S, help="--plan's budget")
    parser.add_argument("--results_dir", type=Path, default=RESULTS, help="committed runs")
    args = parser.parse_args(argv)
    if args.plan:
        if args.results or args.update:
            parser.error("--plan prices the next run: give no results file and no --update")
        if args.budget_s <= 0:
            parser.error("--budget_s must be a positive number of seconds")
        return main_plan(args, parser)
    if args.results is None:
        parser.error("give a results file of gpu_first_run.py, or --plan")
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
    exit_on_bad_input(lambda: sys.exit(main()), "benchmarks.estimate_rows")

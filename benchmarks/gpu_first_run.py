"""The first run on a GPU, in one command: checks, calibration, step rows, estimates beside them.

    python benchmarks/gpu_first_run.py --json out.json          # one H100: at most 20 minutes
    python benchmarks/gpu_first_run.py --device cpu --quick --json out.json   # tiny, for tests

Stages, in order, each timed and written to ``--json`` as it ends (rows one by one):

1. checks: gpu_check.py's correctness checks (remote, host activations, host gradients and
   bfloat16 host weights against resident; GPU against CPU; NCCL; pinned prefetch; the
   baselines' first loss) -- on a CPU, those that need no GPU;
2. calibration: calibrate.py's constants, written as ``<json stem>.spec.json``, the device spec
   file the estimates read;
3. rows: bench_step.py rows, each in a process of its own (:data:`BUDGET` lists them): ours
   with gpt3_1.3B resident, the plain PyTorch loop at the same size, ours with gpt3_6.7B's
   weights streamed, and FSDP2 with CPU offload at the largest size whose host state fits this
   machine's free memory (with ours streamed at that size too when it is smaller than 6.7B);
4. estimates: the dry run of each row's run with the calibrated spec, beside the measured
   step. The baselines are estimated as ours with the nearest flags (resident or remote, every
   layer recomputed), since the dry run models only our engine.

The 20 minutes are budgeted: each row has a time limit, cut to what is left of the budget
after a reserve for the estimates, so a slow row ends as "timed out" rather than running over.
Global batches are cut (64 sequences) so that a row fits its minutes; the estimates are of the
same reduced runs, and at the presets' batches the per-step AdamW and weight loads weigh less.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import calibrate
import gpu_check
from baselines import fsdp2_host_bytes

from config.loading import parse_config
from execution.planning.dry_run import dry_run

BUDGET_S = 20 * 60
ESTIMATE_RESERVE_S = 150  # the dry runs of stage 4, on the GPU machine's host CPU
CHECK_STEPS = 2  # the second step's loss shows the first update's gradients
FSDP2_CANDIDATES = ("gpt3_6.7B", "gpt3_2.7B", "gpt3_1.3B")
HOST_HEADROOM = 1.15  # Python, CUDA context, batches and the allocator's slack beside FSDP2's
REDUCED_BATCH = ("--global_batch_size", "64")
QUICK = shlex.split(
    "--config tiny --hidden_size 32 --sequence_length 32 --max_positional_length 32 "
    "--global_batch_size 4 --micro_batch_size 2"
)
# How the dry run estimates each kind of row: ours by its own flags, a baseline as ours with
# the nearest placement and every layer recomputed (as the baselines checkpoint each layer).
ESTIMATE_AS = {
    "plain": ("--placement", "resident", "--recompute", "full"),
    "fsdp2": ("--placement", "remote", "--recompute", "full"),
}


@dataclass(frozen=True)
class Row:
    """One bench_step row of stage 3 and how long it may take."""

    key: str  # bench_step.VARIANTS
    flags: tuple[str, ...]  # preset and sizes
    warmup: int
    steps: int
    profile: bool
    limit_s: float

    @property
    def preset(self) -> str:
        return self.flags[self.flags.index("--config") + 1]


@dataclass
class Report:
    """What --json holds, rewritten as each stage and row ends."""

    path: Path | None
    device: str
    started: float = field(default_factory=time.perf_counter)
    stages_s: dict[str, float] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def write(self) -> None:
        if self.path is not None:
            data = {k: v for k, v in asdict(self).items() if k not in ("path", "started")}
            self.path.write_text(json.dumps(data, indent=1))

    def stage_done(self, name: str, since: float) -> None:
        if torch.cuda.is_available():  # leave the rows' processes the whole GPU
            torch.cuda.empty_cache()
        self.stages_s[name] = time.perf_counter() - since
        print(
            f"== stage {name}: {self.stages_s[name]:.0f} s (elapsed {self.elapsed():.0f} s "
            f"of {BUDGET_S} s)",
            flush=True,
        )
        self.write()


def free_host_bytes() -> int:
    """MemAvailable: what the rows' processes may still take (none of ours is alive then)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def fsdp2_preset(available: int) -> str:
    """The largest candidate whose FSDP2 host state (with headroom) fits ``available`` bytes."""
    for preset in FSDP2_CANDIDATES:
        config, _ = parse_config(["--config", preset])
        if fsdp2_host_bytes(config) * HOST_HEADROOM <= available:
            return preset
    return FSDP2_CANDIDATES[-1]  # it will fail and say so, as its row's result


def budget(device: str, quick: bool) -> list[Row]:
    """Stage 3's rows with their steps and limits (the real run's fit its 20 minutes)."""
    if quick:
        small = (*QUICK, "--device", device)
        keys = ("resident", "plain", "streamed", "fsdp2")
        return [Row(key, small, 0, 1, False, 120) for key in keys]
    on = ("--device", device, *REDUCED_BATCH)
    size = fsdp2_preset(free_host_bytes())
    rows = [
        Row("resident", ("--config", "gpt3_1.3B", *on), 1, 3, True, 210),
        Row("plain", ("--config", "gpt3_1.3B", *on), 1, 3, True, 210),
        Row("streamed", ("--config", "gpt3_6.7B", *on), 1, 2, True, 300),
    ]
    if size != "gpt3_6.7B":  # the 2x comparison is at equal size
        rows.append(Row("streamed", ("--config", size, *on), 1, 2, False, 200))
    rows.append(Row("fsdp2", ("--config", size, *on), 1, 2, False, 300))
    return rows


def run_bench_row(row: Row, report: Report) -> dict:
    left = BUDGET_S - ESTIMATE_RESERVE_S - report.elapsed()
    if left < 30:
        return {"variant": row.key, "skipped": "the 20-minute budget is spent"}
    if row.key == "fsdp2" and report.device == "cpu":  # no process to start for it
        return {"variant": bench_step.FSDP2_OFFLOAD, "skipped": bench_step.FSDP2_NEEDS_CUDA}
    args = argparse.Namespace(steps=row.steps, warmup=row.warmup, no_profile=not row.profile)
    return bench_step.run_row(row.key, list(row.flags), args, timeout=min(row.limit_s, left))


def estimate_row(row: Row, spec_file: Path) -> dict:
    """The dry run of the row's run with the calibrated spec: its step time and MFU."""
    flags = ESTIMATE_AS.get(row.key, bench_step.VARIANTS[row.key].flags)
    argv = [*row.flags, *flags, "--dry_run", "--device_spec_file", str(spec_file)]
    config, _ = parse_config(argv)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        rank = dry_run(config, Path(tmp))["ranks"][0]
    return {"estimated_step_s": rank["step_time_s"], "estimated_mfu": rank["mfu"]}


def table(rows: list[dict]) -> str:
    head = f"{'row':<34} {'preset':<10} {'step s':>8} {'est. s':>8} {'est/meas':>8} {'MFU':>6}"
    lines = [head]
    for row in rows:
        if "step_s" not in row:
            lines.append(f"{row['variant']:<34} {row['preset']:<10} {row.get('why', '')}")
            continue
        est = row.get("estimated_step_s")
        ratio = f"{est / row['step_s']:.2f}" if est else "-"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-"
        lines.append(
            f"{row['variant']:<34} {row['preset']:<10} {row['step_s']:8.3f} "
            f"{est if est is not None else float('nan'):8.3f} {ratio:>8} {mfu:>6}"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, read off the rows that ran."""
    got = {(r["key"], r["preset"]): r for r in rows if "step_s" in r}
    lines = []
    resident = got.get(("resident", "gpt3_1.3B"))
    if resident and resident.get("mfu") is not None:
        lines.append(f"1.3B resident MFU {resident['mfu']:.1%} (target >= 55%)")
    streamed = got.get(("streamed", "gpt3_6.7B"))
    if streamed and streamed.get("mfu") is not None:
        lines.append(f"6.7B streamed MFU {streamed['mfu']:.1%} (target >= 45%)")
    for (key, preset), fsdp in got.items():
        ours = got.get(("streamed", preset))
        if key == "fsdp2" and ours:
            ratio = ours["tokens_per_s"] / fsdp["tokens_per_s"]
            lines.append(f"{preset} streamed vs FSDP2 offload: {ratio:.2f}x (target >= 2x)")
    for r in got.values():
        if r["key"] not in ESTIMATE_AS and r.get("estimated_step_s"):
            off = r["estimated_step_s"] / r["step_s"] - 1
            lines.append(
                f"dry run vs measured, {r['variant']} {r['preset']}: {off:+.1%} (target within 10%)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write everything measured here, stage by stage")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (try --device cpu --quick)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    out = Path(args.json) if args.json else None
    report = Report(out, args.device)
    spec_file = (out or Path(tempfile.mkdtemp()) / "run.json").with_suffix(".spec.json")

    since = time.perf_counter()
    extra = QUICK[2:] if args.quick else []
    report.checks = gpu_check.run_checks(device, CHECK_STEPS, extra)
    report.stage_done("checks", since)

    since = time.perf_counter()
    cal = [
        "--device",
        args.device,
        "--output",
        str(spec_file),
        *(["--quick"] if args.quick else []),
    ]
    report.calibration = calibrate.main(cal)["device_spec"]
    report.stage_done("calibration", since)

    since = time.perf_counter()
    rows = budget(args.device, args.quick)
    for row in rows:
        started = time.perf_counter()
        result = run_bench_row(row, report)
        result.update(key=row.key, preset=row.preset, flags=list(row.flags))
        result["seconds"] = time.perf_counter() - started
        report.rows.append(result)
        print(f"row {result['variant']} {row.preset}: {result['seconds']:.0f} s", flush=True)
        report.write()
    report.stage_done("rows", since)

    since = time.perf_counter()
    for row, result in zip(rows, report.rows, strict=True):
        if "step_s" in result and report.elapsed() > BUDGET_S:
            result["why"] = "not estimated: the 20-minute budget is spent"
        elif "step_s" in result:
            result.update(estimate_row(row, spec_file))
        else:
            result["why"] = result.get("error") or f"skipped: {result.get('skipped')}"
        report.write()
    report.stage_done("estimates", since)

    print(table(report.rows))
    print("\n".join(targets(report.rows)))
    failed = [c["check"] for c in report.checks if c["ok"] is False]
    print(f"checks failed: {', '.join(failed)}" if failed else "checks: none failed")
    print(f"total {report.elapsed():.0f} s" + (f"; written: {out}" if out else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

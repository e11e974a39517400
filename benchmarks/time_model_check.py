"""The dry run's step time against measured steps on this machine, run by run.

    python benchmarks/time_model_check.py [--runs NAME ...] [--steps 6] [--spec_dir DIR]

For each run: calibrates this machine once per thread count its runs use
(``benchmarks/calibrate.py --device cpu --threads N``: one process alone has every core,
torchrun gives each of its ranks one), trains ``--steps`` steps with ``run_pretraining.py`` on
the shipped sample (torchrun for two ranks), takes the median step time from step 3 onward out
of ``metrics.jsonl``, and runs the same flags with ``--dry_run --device_spec_file``; the
estimate is the slowest rank kind's step. Prints measured against estimated with the ratio,
and writes the rows as JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (processes, flags). One process: tiny and test, passes 1 and 4, resident and remote,
# each recompute mode; two ranks: each parallel axis on its own.
TEST = "--config test --global_batch_size 8 --micro_batch_size 2"
RUNS = {
    "tiny p1 resident none": (1, "--config tiny --passes 1 --placement resident --recompute none"),
    "tiny p4 remote full": (
        1,
        "--config tiny --micro_batch_size 1 --passes 4 --placement remote --recompute full",
    ),
    "tiny p1 remote selective": (
        1,
        "--config tiny --passes 1 --placement remote --recompute selective",
    ),
    "tiny p4 resident selective": (
        1,
        "--config tiny --micro_batch_size 1 --passes 4 --placement resident --recompute selective",
    ),
    "test p1 resident full": (1, f"{TEST} --passes 1 --placement resident --recompute full"),
    "test p4 remote none": (1, f"{TEST} --passes 4 --placement remote --recompute none"),
    "test p1 remote selective": (
        1,
        f"{TEST} --passes 1 --placement remote --recompute selective",
    ),
    "tiny dp 2": (2, "--config tiny --data_parallel 2 --placement resident --passes 1"),
    "tiny tp1 2": (2, "--config tiny --tensor_parallel_1 2 --placement resident --passes 1"),
    "tiny tp2 2": (2, "--config tiny --tensor_parallel_2 2 --placement resident --passes 1"),
    "tiny pp 2": (
        2,
        "--config tiny --pipeline_parallel 2 --micro_batch_size 1 --placement resident --passes 4",
    ),
    "tiny cp 2": (2, "--config tiny --context_parallel 2 --placement resident --passes 1"),
}
COMMON = "--dropout_prob 0 --precision float32 --eval_every 0 --seed 1"


def spec_file(threads: int, spec_dir: Path) -> Path:
    """This machine's calibration for ranks of ``threads`` threads (made once, then reused)."""
    path = spec_dir / f"cpu_threads{threads}.json"
    if not path.exists():
        command = [sys.executable, "benchmarks/calibrate.py", "--device", "cpu"]
        command += ["--threads", str(threads), "--output", str(path)]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return path


def measured_step(processes: int, flags: list[str], steps: int, folder: Path) -> float:
    """Median step time from step 3 on of a real run."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(processes)]
    command = [*launcher, "run_pretraining.py", *flags, "--steps", str(steps)]
    command += ["--output_dir", str(folder)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time"] for r in rows if "step_time" in r and r["step"] >= 3)


def estimated_step(flags: list[str], spec: Path, folder: Path) -> dict:
    """The dry run's estimate: the slowest kind of rank (every rank waits for it)."""
    command = [sys.executable, "run_pretraining.py", *flags, "--dry_run"]
    command += ["--device_spec_file", str(spec), "--output_dir", str(folder)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    ranks = json.loads((folder / "plan.json").read_text())["ranks"]
    return max(ranks, key=lambda r: r["step_time_s"])


def check(name: str, steps: int, spec_dir: Path) -> dict:
    processes, flags = RUNS[name]
    flags = [*shlex.split(flags), *shlex.split(COMMON)]
    threads = (os.cpu_count() or 1) if processes == 1 else 1
    spec = spec_file(threads, spec_dir)
    with tempfile.TemporaryDirectory() as folder:
        measured = measured_step(processes, flags, steps, Path(folder) / "run")
        estimate = estimated_step(flags, spec, Path(folder) / "dry")
    keys = ("compute_s", "memory_bound_s", "overhead_s", "host_optimizer_s", "copies_s")
    keys += ("collectives_s", "exposed_comm_s", "bubble_s")
    return {
        "run": name,
        "processes": processes,
        "measured_s": measured,
        "estimated_s": estimate["step_time_s"],
        "ratio": estimate["step_time_s"] / measured,
        **{key: estimate[key] for key in keys},
    }


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'run':<28}{'ranks':>6}{'measured s':>12}{'estimated s':>13}{'ratio':>7}"
        f"{'compute':>9}{'memory':>8}{'overhead':>9}{'copies':>8}{'comm':>7}{'bubble':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['run']:<28}{r['processes']:>6}{r['measured_s']:>12.3f}{r['estimated_s']:>13.3f}"
            f"{r['ratio']:>7.2f}{r['compute_s']:>9.3f}{r['memory_bound_s']:>8.3f}"
            f"{r['overhead_s']:>9.3f}{r['copies_s']:>8.3f}{r['collectives_s']:>7.3f}"
            f"{r['bubble_s']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--spec_dir", type=Path, help="calibrations to reuse (else made anew)")
    parser.add_argument("--output", type=Path, help="rows as JSON")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (steps 3 on are timed)")
    with tempfile.TemporaryDirectory() as scratch:
        spec_dir = args.spec_dir or Path(scratch)
        spec_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in args.runs:
            rows.append(check(name, args.steps, spec_dir))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

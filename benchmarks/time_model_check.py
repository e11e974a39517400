"""The dry run's step time against measured steps on this machine, run by run, and the
ranking ``--plan_for`` gives 2-rank layouts against their measured order.

    python -m benchmarks.time_model_check [--runs NAME ...] [--steps 6] [--rounds 2]
        [--spec_dir DIR] [--skip_ranking] [--output rows.json]

Works in ``--rounds`` rounds over all runs (a shared machine's speed drifts over minutes; each
side of the comparison then sees several stretches of it). Each round calibrates this machine
once per thread count its runs use (``python -m benchmarks.calibrate --device cpu --threads N``: one
process alone has every core, torchrun gives each of its ranks one), takes each run's dry run
on that calibration (``--dry_run --device_spec_file``; the slowest kind of rank, of a pipeline
the stage that sets its pace) and trains each run on the shipped sample (torchrun for two
ranks). A run's estimate is the mean of its rounds' dry runs, its measured step the median of
every round's steps from step 3 on. Then ``--plan_for 2`` of ``tiny`` on the first round's
calibration: each layout it lists trained as it chose it, its order against the measured one.
Prints both tables and writes them as JSON (``--output``).
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

from config.command_line import check_output_file, check_output_folder, exit_on_bad_input

ROOT = Path(__file__).resolve().parents[1]

# name: (processes, flags). One process: tiny and test, passes 1 and 4, resident and remote,
# each recompute mode; two ranks: each parallel axis on its own.
TEST = "--config test --global_batch_size 8 --micro_batch_size 2"
WIDE = "--config tiny --layers 4 --hidden_size 256 --heads 8 --sequence_length 64 --global_batch_size 16"
LONG = (
    "--config tiny --layers 3 --hidden_size 192 --heads 6 --sequence_length 256 "
    "--max_positional_length 256 --recompute selective"
)
# Host-bound: narrow layers, many micro-batches of one short sequence; the host's time per
# phase and micro-batch is most of the step (the head's vocabulary matmuls the rest).
HOST = (
    "--config tiny --layers 8 --hidden_size 32 --heads 2 --sequence_length 8 "
    "--max_positional_length 8 --micro_batch_size 1 --global_batch_size 32"
)
NARROW = (
    "--config tiny --layers 4 --hidden_size 64 --heads 4 --sequence_length 16 "
    "--max_positional_length 16 --micro_batch_size 1"
)
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
    # Sizes the model was never tuned on: other layer counts, widths, sequences, micro-batches.
    "held p1 L4 h256 s64": (1, f"{WIDE} --micro_batch_size 8 --passes 1 --placement resident"),
    "held p2 L3 h192 s256": (1, f"{LONG} --micro_batch_size 2 --passes 2 --placement remote"),
    "held dp 2 L4 h256 s64": (2, f"{WIDE} --data_parallel 2 --micro_batch_size 4 --passes 2"),
    "held dp 2 L3 h192 s256": (2, f"{LONG} --data_parallel 2 --micro_batch_size 1 --passes 2"),
    "held pp 2 L4 h256 s64": (
        2,
        f"{WIDE} --pipeline_parallel 2 --micro_batch_size 2 --passes 4 --placement resident",
    ),
    "held pp 2 L6 h192 s256": (
        2,
        f"{LONG} --layers 6 --pipeline_parallel 2 --micro_batch_size 1 --passes 4 "
        "--placement resident",
    ),
    # Compiled parts (--compile): the dry run prices their fused kernels' bytes.
    "compiled tiny p1 resident none": (
        1,
        "--config tiny --passes 1 --placement resident --recompute none --compile true",
    ),
    "compiled test p1 resident full": (
        1,
        f"{TEST} --passes 1 --placement resident --recompute full --compile true",
    ),
    "compiled test p4 remote selective": (
        1,
        f"{TEST} --passes 4 --placement remote --recompute selective --compile true",
    ),
    "compiled held p1 L4 h256 s64": (
        1,
        f"{WIDE} --micro_batch_size 8 --passes 1 --placement resident --compile true",
    ),
    # Host-bound (the host's time per phase and micro-batch, calibrate.py's host_phase_us).
    "host p1 L8 h32 mb32 selective": (
        1,
        f"{HOST} --passes 1 --placement resident --recompute selective",
    ),
    "compiled host p1 L8 h32 mb32 full": (
        1,
        f"{HOST} --passes 1 --placement resident --recompute full --compile true",
    ),
    "host p4 L4 h64 mb24 remote full": (
        1,
        f"{NARROW} --global_batch_size 24 --passes 4 --placement remote --recompute full",
    ),
    "compiled host p2 L4 h64 mb16 none": (
        1,
        f"{NARROW} --global_batch_size 16 --passes 2 --placement resident --recompute none "
        "--compile true",
    ),
    "host dp 2 L8 h32 mb32 none": (
        2,
        f"{HOST} --data_parallel 2 --passes 1 --placement resident --recompute none",
    ),
    "host pp 2 L8 h32 mb32 full": (
        2,
        f"{HOST} --pipeline_parallel 2 --passes 8 --placement resident --recompute full",
    ),
    # Sizes picked after the model was last changed, as a reviewer would pick them: other
    # widths, sequences, micro-batches and passes, each axis at 2.
    "other p2 L6 h96 s32 remote selective": (
        1,
        "--config tiny --layers 6 --hidden_size 96 --heads 3 --sequence_length 32 "
        "--max_positional_length 32 --micro_batch_size 2 --global_batch_size 16 --passes 2 "
        "--placement remote --recompute selective",
    ),
    "other test L6 mb4 remote full": (
        1,
        "--config test --layers 6 --global_batch_size 8 --micro_batch_size 4 --passes 1 "
        "--placement remote --recompute full",
    ),
    "other dp 2 L3 h192 p2 remote": (
        2,
        "--config tiny --layers 3 --hidden_size 192 --heads 6 --data_parallel 2 "
        "--micro_batch_size 2 --global_batch_size 8 --passes 2 --placement remote",
    ),
    "other tp2 2 L4 h256 s64": (
        2,
        "--config tiny --layers 4 --hidden_size 256 --heads 8 --sequence_length 64 "
        "--max_positional_length 64 --tensor_parallel_2 2 --global_batch_size 8 "
        "--micro_batch_size 4 --placement resident --passes 1",
    ),
    "other cp 2 s256 mb2": (
        2,
        "--config tiny --layers 2 --sequence_length 256 --max_positional_length 256 "
        "--context_parallel 2 --micro_batch_size 2 --global_batch_size 4 --placement resident "
        "--passes 1",
    ),
    # With dropout: a CPU's generator draws each mask's numbers at a few nanoseconds each.
    "dropout test p1 resident full": (
        1,
        f"{TEST} --passes 1 --placement resident --recompute full --dropout_prob 0.1",
    ),
    "dropout compiled tiny p1 resident none": (
        1,
        "--config tiny --passes 1 --placement resident --recompute none --compile true "
        "--dropout_prob 0.1",
    ),
    "other tp1 2 L3 h192 s64": (
        2,
        "--config tiny --layers 3 --hidden_size 192 --heads 6 --sequence_length 64 "
        "--max_positional_length 64 --tensor_parallel_1 2 --micro_batch_size 4 "
        "--global_batch_size 8 --placement resident --passes 1",
    ),
}
# The layout axes --plan_for weighs, by flag.
AXES = {
    "data_parallel": "dp",
    "pipeline_parallel": "pp",
    "context_parallel": "cp",
    "tensor_parallel_1": "tp1",
    "tensor_parallel_2": "tp2",
}
COMMON = "--precision float32 --eval_every 0 --seed 1"
MODEL = ["--config", "tiny", "--dropout_prob", "0", *shlex.split(COMMON)]  # the ranking check's


def run_flags(flags: str) -> list[str]:
    """A run's flags with the common ones; without dropout unless it sets its own."""
    dropout = [] if "--dropout_prob" in flags else ["--dropout_prob", "0"]
    return [*shlex.split(flags), *dropout, *shlex.split(COMMON)]


def _run(command: list[str]) -> None:
    """Runs ``command`` quietly (torchrun prints a banner per launch); its stderr if it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {shlex.join(command)}\n{done.stderr[-3000:]}")


def spec_file(threads: int, spec_dir: Path, round_: int = 0) -> Path:
    """This machine's calibration for ranks of ``threads`` threads in round ``round_`` (made
    once, then reused)."""
    path = spec_dir / f"cpu_threads{threads}_round{round_ + 1}.json"
    if not path.exists():
        command = [sys.executable, "-m", "benchmarks.calibrate", "--device", "cpu"]
        command += ["--threads", str(threads), "--output", str(path)]
        command += ["--host_dropout", "0", "0.1"]  # the runs' (RUNS)
        _run(command)
    return path


def step_times(processes: int, flags: list[str], steps: int) -> list[float]:
    """Step times from step 3 on of a real run."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(processes)]
    with tempfile.TemporaryDirectory() as folder:
        command = [*launcher, "run_pretraining.py", *flags, "--steps", str(steps)]
        _run([*command, "--output_dir", folder])
        lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r["step_time"] for r in rows if "step_time" in r and r["step"] >= 3]


def estimated_step(flags: list[str], spec: Path) -> dict:
    """The dry run's estimate. Every rank waits for the slowest kind; of a pipeline, whose
    ranks all report its step, the stage that sets its pace (least idle)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "run_pretraining.py", *flags, "--dry_run"]
        _run([*command, "--device_spec_file", str(spec), "--output_dir", folder])
        ranks = json.loads((Path(folder) / "plan.json").read_text())["ranks"]
    return max(ranks, key=lambda r: (r["step_time_s"], -r["bubble_s"]))


def threads_of(processes: int) -> int:
    """One process alone has every core; torchrun gives each of its ranks one thread."""
    return (os.cpu_count() or 1) if processes == 1 else 1


def ranking_layouts(spec_dir: Path) -> list[dict]:
    """``--plan_for 2`` of ``tiny`` on this machine's one-thread calibration: each 2-rank layout
    it lists, fastest first, with the flags of what it chose (micro-batch, passes, placement,
    recompute) and its estimate."""
    from config.loading import parse_config
    from execution.planning.plan_search import search
    from execution.planning.plan_table import layout_rows
    from execution.planning.run_shape import RunShape

    spec = spec_file(1, spec_dir)
    config, _ = parse_config([*MODEL, "--plan_for", "2", "--device_spec_file", str(spec)])
    out = []
    for row in layout_rows(search(RunShape.of(config), 2)[0]):
        run, plan = row["run"], row["plan"]
        layout = {flag: getattr(run.mesh, axis) for flag, axis in AXES.items()}
        chosen = {"micro_batch_size": run.micro_batch_size, "passes": plan.passes}
        chosen |= {f"{state}_placement": where for state, where in vars(plan.placement).items()}
        chosen["recompute"] = plan.recompute
        out.append(
            {
                "layout": run.mesh.describe(split_only=True),
                "chosen": " ".join(f"--{k} {v}" for k, v in chosen.items()),
                "flags": [f"--{k}={v}" for k, v in (layout | chosen).items()],
                "estimated_s": row["step_time_s"],
            }
        )
    return out


def ranking_verdict(rows: list[dict]) -> dict:
    """Whether the search ranks the layouts in their measured order, or puts first one that
    measures within 5% of the measured fastest."""
    measured_fastest = min(rows, key=lambda r: r["measured_s"])
    measured_order = [r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    same_order = measured_order == [r["layout"] for r in rows]
    gap = rows[0]["measured_s"] / measured_fastest["measured_s"] - 1
    return {
        "rows": rows,
        "same_order": same_order,
        "fastest_gap": gap,
        "holds": same_order or gap <= 0.05,
    }


def format_ranking(check: dict) -> str:
    lines = [f"{'--plan_for 2 (tiny)':<22}{'estimated s':>12}{'measured s':>12}  as chosen"]
    for r in check["rows"]:
        lines.append(
            f"{r['layout']:<22}{r['estimated_s']:>12.3f}{r['measured_s']:>12.3f}  {r['chosen']}"
        )
    order = "in the measured order" if check["same_order"] else "not in the measured order"
    lines.append(
        f"ranked {order}; its fastest measures {check['fastest_gap']:+.1%} against the "
        f"measured fastest (holds: {check['holds']})"
    )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--steps", type=int, default=6)
    rounds_help = "rounds over all runs, each calibrating, estimating and training each run"
    parser.add_argument("--rounds", type=int, default=2, help=rounds_help)
    parser.add_argument("--spec_dir", type=Path, help="calibrations to reuse (else made anew)")
    parser.add_argument("--output", type=Path, help="rows as JSON")
    parser.add_argument(
        "--skip_ranking", action="store_true", help="leave out the --plan_for 2 ranking check"
    )
    args = parser.parse_args(argv)
    if args.steps < 4 or args.rounds < 1:
        parser.error("--steps must be at least 4 (steps 3 on are timed), --rounds at least 1")
    if args.output:  # written after the rounds' minutes
        check_output_file("--output", args.output)
    if args.spec_dir:
        check_output_folder("--spec_dir", args.spec_dir)
    runs = {}
    for name in args.runs:
        processes, flags = RUNS[name]
        runs[name] = (processes, run_flags(flags))
    keys = ("step_time_s", "compute_s", "memory_bound_s", "overhead_s", "host_optimizer_s")
    keys += ("copies_s", "collectives_s", "exposed_comm_s", "bubble_s")
    estimates: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as scratch:
        spec_dir = args.spec_dir or Path(scratch)
        spec_dir.mkdir(parents=True, exist_ok=True)
        ranking = [] if args.skip_ranking else ranking_layouts(spec_dir)
        times: dict[str, list[float]] = {
            name: [] for name in [*runs, *(r["layout"] for r in ranking)]
        }
        for round_ in range(args.rounds):
            for name, (processes, flags) in runs.items():
                spec = spec_file(threads_of(processes), spec_dir, round_)
                estimate = estimated_step(flags, spec)
                estimates[name].append({key: estimate[key] for key in keys})
                times[name] += step_times(processes, flags, args.steps)
                print(
                    f"round {round_ + 1}: {name} {statistics.median(times[name]):.3f} s "
                    f"(estimated {estimate['step_time_s']:.3f} s)",
                    flush=True,
                )
            for r in ranking:
                times[r["layout"]] += step_times(2, [*MODEL, *r["flags"]], args.steps)
    rows = []
    for name, (processes, _) in runs.items():
        measured = statistics.median(times[name])
        estimate = {key: statistics.mean(e[key] for e in estimates[name]) for key in keys}
        rows.append(
            {
                "run": name,
                "processes": processes,
                "measured_s": measured,
                "estimated_s": estimate["step_time_s"],
                "ratio": estimate["step_time_s"] / measured,
                **{key: estimate[key] for key in keys[1:]},
            }
        )
    print(format_rows(rows))
    verdict = None
    if ranking:
        for r in ranking:
            r["measured_s"] = statistics.median(times[r["layout"]])
        verdict = ranking_verdict(ranking)
        print(format_ranking(verdict))
    if args.output:
        args.output.write_text(json.dumps({"runs": rows, "ranking": verdict}, indent=1))
    return {"runs": rows, "ranking": verdict}


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.time_model_check")

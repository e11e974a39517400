"""``--compile`` on this machine: our engine compiled, the plain PyTorch loop compiled (its
blocks, as torchtitan compiles them) and our engine eager, in turn, round after round.

    python -m benchmarks.compile_compare --config test --global_batch_size 8 \\
        --micro_batch_size 2 --recompute full --rounds 3 --steps 5
    python -m benchmarks.compile_compare --config tiny --recompute none --rounds 3 --steps 10

Each round runs the three as ``bench_step.py`` rows, each in a process of its own (one
process holding three engines slows them unequally: their thread pools share two cores), on
the same batches from the same initial weights, each row's compile in its warm-up steps.
Rounds alternate the three, so a drift in this shared machine's speed meets all of them; a
ratio is taken within a round (ours compiled over the row), and the table gives each row's
median step over the rounds and the ratios' min, median and max (below 1: ours compiled is
faster). The plain loop recomputes every layer unless ``--recompute none``, as ours is told
to; the other flags are ``run_pretraining.py``'s (``--compile`` is the rows': true, but
``false`` for ours eager).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.bench_step import row_label, run_row
from config.command_line import exit_on_bad_input
from config.loading import parse_config
from execution.engine.phases.compiled import compile_unavailable

ROWS = ("ours", "plain", "eager")  # bench_step.VARIANTS: "eager" is ours with --compile false


def compare(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each row runs, in turn")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of a row (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    args, flags = parser.parse_known_args(argv)
    flags = [*flags, "--device", "cpu", "--compile", "true"]
    config, _ = parse_config(flags)
    reason = compile_unavailable("cpu")
    if reason is not None:
        sys.exit(f"benchmarks.compile_compare: torch.compile cannot run here ({reason})")
    row_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, no_profile=True)
    seconds: dict[str, list[float]] = {key: [] for key in ROWS}
    for round_ in range(args.rounds):
        for key in ROWS:
            row = run_row(key, flags, row_args, timeout=None)
            if "error" in row:
                sys.exit(f"benchmarks.compile_compare: {row_label(key, config)}: {row['error']}")
            seconds[key].append(row["step_s"])
            print(f"round {round_ + 1}: {row_label(key, config)} {row['step_s']:.3f} s", flush=True)
    ours = seconds["ours"]
    print(
        f"{' '.join(flags)}: {args.rounds} rounds, each row's median of {args.steps} steps after "
        f"{args.warmup} warm-up; ratio: ours compiled / the row, round by round"
    )
    print(f"{'row':<36} {'step s':>8} {'ratio min':>10} {'median':>8} {'max':>8}")
    rows = {}
    for key, times in seconds.items():
        label = row_label(key, config) + (", compiled" if key != "eager" else "")
        ratios = [a / b for a, b in zip(ours, times, strict=True)]
        rows[label] = {"step_s": statistics.median(times), "ratio": statistics.median(ratios)}
        print(
            f"{label:<36} {statistics.median(times):8.3f} {min(ratios):10.3f} "
            f"{statistics.median(ratios):8.3f} {max(ratios):8.3f}"
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    rows: dict = {}
    exit_on_bad_input(lambda: rows.update(compare(argv)), "benchmarks.compile_compare")
    return rows


if __name__ == "__main__":
    main()

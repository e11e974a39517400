"""Measures the device constants the time model uses and writes them as a device spec file.

    python -m benchmarks.calibrate --device cuda --output spec.json [--base h100_sxm]
    python run_pretraining.py --config gpt3_1.3B --dry_run --device_spec_file spec.json

What it measures and how each measurement becomes a field of the spec:
execution/planning/calibration/calibrate.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from config.command_line import check_output_file, exit_on_bad_input
from config.loading import OneLineParser
from execution.parallel.launch import select_device
from execution.planning.calibration.calibrate import FULL, QUICK, calibrate, summary
from execution.planning.device_specs import SPECS
from utils.sample_clock import load_warning, raised_priority


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--output", required=True, help="device spec file to write (JSON)")
    base_help = "data-sheet entry whose fields the measurements do not cover (network, storage)"
    parser.add_argument("--base", choices=sorted(SPECS), default="h100_sxm", help=base_help)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    threads_help = (
        "CPU threads per rank (a CPU spec describes one rank: torchrun starts each of N ranks "
        "with OMP_NUM_THREADS=1, one process alone uses every core); default: torch's"
    )
    parser.add_argument("--threads", type=int, default=0, help=threads_help)
    dropout_help = "dropout probabilities whose host time per phase is measured (default: 0, 0.1)"
    parser.add_argument("--host_dropout", type=float, nargs="+", help=dropout_help)
    args = parser.parse_args(argv)
    check_output_file("--output", args.output)  # written after minutes of measuring
    if args.threads < 0:
        parser.error("--threads must be 0 (torch's default) or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    # Before any thread or rank starts: they run at the priority of the thread that starts them.
    # The device as a run selects it (on a CPU: freed blocks kept, as the engine's process has).
    device = select_device(args.device, 0)
    sizes = QUICK if args.quick else FULL[device.type]
    if args.host_dropout:
        if not all(0 <= p < 1 for p in args.host_dropout):
            parser.error("--host_dropout takes probabilities in [0, 1)")
        runs = {(c, r) for c, r, _ in sizes.host_runs}
        ways = tuple((c, r, p) for c, r in sorted(runs) for p in args.host_dropout)
        sizes = dataclasses.replace(sizes, host_runs=ways)
    # Raised before any thread or rank starts: they run at the priority of their starter.
    with raised_priority() as prioritised:
        result = calibrate(device, sizes, args.base, prioritised)
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(summary(result))
    if warning := load_warning(result):
        print(warning, file=sys.stderr)
    print(f"written: {args.output} (use it with --device_spec_file)")
    return result


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.calibrate")

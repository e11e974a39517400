"""The host's own time per phase: the engine's real phases on kernels that cost nothing, as a
table (the measuring: execution/planning/calibration/host_phases.py).

    python -m benchmarks.host_time [--widths gpt3_1.3B llama3_8B] [--compile false true]
        [--recompute full selective none] [--device cpu] [--steps 5] [--json rows.json]

Prints microseconds per layer forward and backward per micro-batch and per update, eager and
compiled. The calibration (``benchmarks.calibrate``) takes the same measurement at its own
model and writes it into the device spec (``host_phase_us``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from config.command_line import check_output_file, exit_on_bad_input
from execution.engine.phases.recompute import MODES
from execution.parallel.launch import select_device
from execution.planning.calibration.host_phases import UPDATE, measure, shrunk_flags


def layer_micro_batch_us(kinds: dict, kind: str, micro_batches: int) -> float:
    """A layer phase's host time per micro-batch at ``micro_batches`` a phase (its own time
    shared among them)."""
    row = kinds[kind]
    return row["per_unit_us"] + row["per_phase_us"] / micro_batches


def table(rows: list[dict], micro_batches: int) -> str:
    head = (
        f"{'width of':<12}{'compile':<9}{'recompute':<11}{'fwd us/mb':>10}{'bwd us/mb':>10}"
        f"{'fwd us/phase':>13}{'bwd us/phase':>13}{'update us':>10}{'us/row':>8}"
    )
    lines = [f"host time per layer and micro-batch at {micro_batches} a phase", head]
    for r in rows:
        k = r["kinds"]
        update = k[UPDATE]
        lines.append(
            f"{r['width']:<12}{r['compile']:<9}{r['recompute']:<11}"
            f"{layer_micro_batch_us(k, 'layer_forward', micro_batches):>10.0f}"
            f"{layer_micro_batch_us(k, 'layer_backward', micro_batches):>10.0f}"
            f"{k['layer_forward']['per_phase_us']:>13.0f}{k['layer_backward']['per_phase_us']:>13.0f}"
            f"{update['per_phase_us'] + 4 * update['per_unit_us']:>10.0f}"
            f"{update['per_unit_us']:>8.0f}"
        )
    lines.append("update us: norm, clipping and AdamW of a model of 2 layers (4 rows)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", nargs="+", default=["gpt3_1.3B", "llama3_8B"])
    parser.add_argument(
        "--compile", nargs="+", choices=("false", "true"), default=["false", "true"]
    )
    parser.add_argument("--recompute", nargs="+", choices=MODES, default=["full"])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each shape")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (a host's Python: 1)")
    parser.add_argument("--micro_batches", type=int, default=4, help="a phase's, for the table")
    parser.add_argument("--json", type=Path, help="rows as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1 or args.micro_batches < 1:
        parser.error("--steps, --threads and --micro_batches must be at least 1")
    if args.json:
        check_output_file("--json", args.json)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    device = select_device(args.device, 0)
    rows = []
    for width in args.widths:
        flags = shrunk_flags(width, device.type)
        for compiled in args.compile:
            for recompute in args.recompute:
                kinds = measure(flags, device, args.steps, compiled == "true", recompute)
                rows.append(
                    {"width": width, "compile": compiled, "recompute": recompute, "kinds": kinds}
                )
                print(f"measured: {width} compile {compiled} recompute {recompute}", flush=True)
    print(table(rows, args.micro_batches))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.host_time")

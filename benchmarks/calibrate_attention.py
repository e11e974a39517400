"""Times each fused attention kernel on the device and writes the timings as a device spec file
(the measuring: execution/planning/calibration/attention.py).

    python -m benchmarks.calibrate_attention --device cuda --output attention.json
    python -m benchmarks.calibrate_attention --device cuda --output attention.json \\
        --shapes 4x16x2048x128 1x32x2048x128 --dropout 0 0.1 --dtype bfloat16

The calibration (``benchmarks.calibrate``) runs it as one of its measurements. Alone it writes
a device spec file holding the timings only (``--device_spec_file`` keeps every other field of
``--device_spec``): the first GPU run's ``attention`` stage, whose file its rows then run
with. A CPU has one kernel per case and nothing to time: its file holds no timings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from config.command_line import check_output_file, exit_on_bad_input
from config.loading import OneLineParser
from execution.engine.storage.buffers import DTYPES
from execution.planning.calibration.attention import (
    DROPOUTS,
    SHAPES,
    kernel_timings,
    measure_attention_kernels,
    summary,
)


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text}: a shape is 4 positive integers joined by x (4x16x2048x128)")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--output", required=True, help="device spec file to write (JSON)")
    parser.add_argument("--shapes", nargs="+", default=None, help="BxHxSxD calls to time")
    parser.add_argument("--dropout", nargs="+", type=float, default=list(DROPOUTS))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    check_output_file("--output", args.output)
    try:
        shapes = [_shape(s) for s in args.shapes] if args.shapes else list(SHAPES)
    except ValueError as err:
        parser.error(f"--shapes {err}")
    if not all(0 <= p < 1 for p in args.dropout):
        parser.error("--dropout: each probability must be in [0, 1)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    measured = measure_attention_kernels(
        device, shapes=shapes, dropouts=args.dropout, dtype=DTYPES[args.dtype]
    )
    result = {
        "device_spec": {"attention_kernel_seconds": kernel_timings(measured)},
        "measurements": {"attention_kernels": measured},
    }
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(summary(measured))
    print(f"written: {args.output} (use it with --device_spec_file)")
    return result


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.calibrate_attention")

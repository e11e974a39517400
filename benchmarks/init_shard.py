"""Time and peak memory of initialising one rank's shard of a decoder layer vs the whole layer.

    python -m benchmarks.init_shard [--hidden 12288] [--heads 96] [--tp1 8] [--tp2 8]

Defaults are a gpt3_175B decoder layer (12 h^2 + 13 h = 1.8e9 parameters, 7.2 GB in float32)
at the pod256 tensor-parallel layout. Each measurement runs in a fresh process: its peak
resident memory is reset (``/proc/self/clear_refs``) after importing torch and read back from
``VmHWM`` afterwards, so "peak extra" is what the initialisation itself added, result included
(torch's allocations are invisible to tracemalloc). "drawn" counts the elements of every tile
the call draws, "held" those it returns. When the machine has too little free memory for the
whole layer, that row is measured at the largest hidden size that fits and says so.

    python -m benchmarks.init_shard --model gpt3_6.7B [--model_layers 2] [--workers 1 2]

instead times drawing a preset's whole model for one device (``init_full_part`` of the
embedding, the first ``--model_layers`` decoder layers and the head, each dropped before the
next) with each number of tile-drawing threads, and extrapolates to every layer. Every worker
count draws the same numbers (tests/modelling/test_weight_drawing.py); "peak extra" minus "largest part"
is what the drawing held beyond its result: about one tile per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from config.loading import parse_config
from execution.parallel.sharding import init_part_shard, shard_index
from modelling.gpt import (
    EMBEDDING,
    HEAD,
    LAYERS,
    GPTShapes,
    init_full_part,
    part_inits,
)
from modelling.tiles import INIT_TILE, tile_groups

SEED, INIT_STD = 1234, 0.006
# gpt3_175B's depth, vocabulary and context; the width, heads and tensor layout are flags.
FIXED_SHAPE = dict(layers=96, vocab=50257, positions=2048, dropout_prob=0.0, layer_norm_eps=1e-5)


def _shapes(args: argparse.Namespace, hidden: int) -> GPTShapes:
    return GPTShapes(**FIXED_SHAPE, hidden=hidden, heads=args.heads, tp1=args.tp1, tp2=args.tp2)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(args: argparse.Namespace) -> None:
    """Child process: one initialisation, then a JSON line with its time and memory."""
    torch.set_num_threads(args.threads)
    shapes = _shapes(args, args.hidden)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current resident size
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if args.measure == "shard":
        out = init_part_shard(shapes, LAYERS, 0, SEED, INIT_STD, args.tp1 - 1, args.tp2 - 1)
    else:
        out = init_full_part(shapes, LAYERS, 0, SEED, INIT_STD)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    held = sum(t.numel() for t in out.values())
    print(json.dumps({"seconds": seconds, "peak_extra_kib": peak - before, "held": held}))


def _measure_model(args: argparse.Namespace) -> None:
    """Child process: the embedding, ``--model_layers`` layers and the head drawn whole by
    ``--workers`` threads, one part at a time; a JSON line of seconds per part and memory."""
    torch.set_num_threads(args.threads)
    config, _ = parse_config(["--config", args.model])
    shapes = GPTShapes.from_config(config.model)
    seed, std = config.training.seed, config.model.init_std
    parts = [(EMBEDDING, 0), *((LAYERS, n) for n in range(args.model_layers)), (HEAD, 0)]
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status_kib("VmRSS")
    seconds, largest = {EMBEDDING: 0.0, LAYERS: 0.0, HEAD: 0.0}, 0
    for part, row in parts:
        start = time.perf_counter()
        out = init_full_part(shapes, part, row, seed, std, args.workers[0])
        seconds[part] += time.perf_counter() - start
        largest = max(largest, sum(t.numel() * t.element_size() for t in out.values()))
        del out
    peak = _status_kib("VmHWM")
    result = {"seconds": seconds, "peak_extra_kib": peak - before, "largest_kib": largest / 1024}
    print(json.dumps({**result, "layers": shapes.layers}))


def _model_table(args: argparse.Namespace) -> None:
    """The whole-model table: one child process per worker count."""
    print(
        f"{args.model}: initial weights drawn whole (init_full_part), embedding + "
        f"{args.model_layers} layer(s) + head timed, layers extrapolated to all; "
        f"{args.threads} torch thread(s), {os.cpu_count()} core(s) visible"
    )
    header = f"{'workers':>7} {'embedding s':>11} {'per layer s':>11} {'head s':>7} "
    print(
        header
        + f"{'whole model s':>13} {'speed-up':>8} {'peak extra MiB':>14} {'largest part MiB':>16}"
    )
    first = None
    for workers in args.workers:
        flags = ["--measure", "model", "--model", args.model, "--workers", str(workers)]
        flags += ["--model_layers", str(args.model_layers), "--threads", str(args.threads)]
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.init_shard", *flags],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        seconds = result["seconds"]
        per_layer = seconds[LAYERS] / args.model_layers
        whole = seconds[EMBEDDING] + result["layers"] * per_layer + seconds[HEAD]
        first = first or whole
        cost = f"{workers:>7} {seconds[EMBEDDING]:>11.2f} {per_layer:>11.2f} {seconds[HEAD]:>7.3f} "
        memory = f"{result['peak_extra_kib'] / 1024:>14,.0f} {result['largest_kib'] / 1024:>16,.0f}"
        print(cost + f"{whole:>13.1f} {first / whole:>8.2f} " + memory)


def _drawn(shapes: GPTShapes, which: str, i: int, j: int) -> int:
    """Elements of the tiles a call draws: every tile its per-dim indices touch."""
    if which == "shard":
        index = shard_index(LAYERS, shapes, i, j)
    else:
        inits = part_inits(shapes, LAYERS)
        index = {name: tuple(torch.arange(n) for n in p.shape) for name, p in inits.items()}
    total = 0
    for name, init in part_inits(shapes, LAYERS).items():
        if init.fill != "normal":
            continue
        tiles = [
            [(t, min(INIT_TILE, n - t * INIT_TILE)) for t, _, _ in tile_groups(p)]
            for p, n in zip(index[name], init.shape, strict=True)
        ]
        total += sum(r for _, r in tiles[0]) * sum(c for _, c in tiles[1])
    return total


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(args: argparse.Namespace, which: str, hidden: int) -> dict:
    flags = {
        "--measure": which,
        "--hidden": hidden,
        "--heads": args.heads,
        "--tp1": args.tp1,
        "--tp2": args.tp2,
        "--threads": args.threads,
    }
    command = [sys.executable, "-m", "benchmarks.init_shard"]
    for flag, value in flags.items():
        command += [flag, str(value)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--tp1", type=int, default=8)
    parser.add_argument("--tp2", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    parser.add_argument("--model", help="a preset: time drawing its whole model instead")
    parser.add_argument("--model_layers", type=int, default=2, help="layers timed (--model)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2], help="tile-drawing threads (--model)"
    )
    parser.add_argument("--measure", choices=["shard", "full", "model"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure == "model":
        _measure_model(args)
        return
    if args.measure:
        _measure(args)
        return
    if args.model:
        _model_table(args)
        return

    full_hidden = args.hidden
    # The whole layer needs its 4 * 12 h^2 bytes plus head-room for the rest of the machine.
    while 4 * 12 * full_hidden**2 * 1.5 > _available_bytes() and full_hidden > args.heads:
        full_hidden //= 2
    rows = [("shard", args.hidden), ("full", full_hidden)]
    rank = f"rank ({args.tp1 - 1}, {args.tp2 - 1})"
    tile = f"tile {INIT_TILE}x{INIT_TILE}"
    threads = f"{args.threads} torch thread(s), {os.cpu_count()} core(s) visible"
    print(f"decoder layer init, tp1={args.tp1} tp2={args.tp2}, {rank}, {tile}, {threads}")
    header = f"{'what':<38} {'hidden':>6} {'seconds':>8} {'peak extra MiB':>14} "
    print(header + f"{'drawn':>14} {'held':>14} {'drawn/held':>10}")
    for which, hidden in rows:
        shapes = _shapes(args, hidden)
        result = _run(args, which, hidden)
        drawn = _drawn(shapes, which, args.tp1 - 1, args.tp2 - 1)
        label = (
            "one rank's shard (init_part_shard)"
            if which == "shard"
            else "whole layer (init_full_part)"
            + ("" if hidden == args.hidden else " [reduced: memory]")
        )
        held, peak_mib = result["held"], result["peak_extra_kib"] / 1024
        cost = f"{label:<38} {hidden:>6} {result['seconds']:>8.2f} {peak_mib:>14,.0f} "
        print(cost + f"{drawn:>14,} {held:>14,} {drawn / held:>10.3f}")


if __name__ == "__main__":
    main()

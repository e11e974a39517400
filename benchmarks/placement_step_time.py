"""Step time of remote (phased, host buffers) versus resident placement, on this machine.

    python -m benchmarks.placement_step_time [--config tiny] [--steps 5] [extra flags...]

Runs the same preset in both placements on the shipped sample data (first step is warm-up and
not timed) and prints a table of median step time, tokens/s and buffer memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from config.loading import parse_config
from data.loader import training_loader
from execution.parallel.launch import select_device
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape


def measure(flags: list[str], placement: str, steps: int) -> dict:
    config, _ = parse_config([*flags, "--placement", placement])
    device = select_device(config.execution.device, 0, 1)
    engine = planned_engine(RunShape.of(config), ParallelLayout.single(device))
    loader = training_loader(config, dp_rank=0, dp_size=1)  # one data-parallel replica
    times, losses = [], []
    for step in range(steps + 1):
        batch = loader.next_batch()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(engine.train_step(batch, step, 1e-4).loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "placement": placement,
        "device": str(device),
        "step_s": median,
        "tokens_per_s": config.tokens_per_step / median,
        "buffers_MiB": sum(engine.buffer_bytes().values()) / 2**20,
        "last_loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    args, extra = parser.parse_known_args()
    flags = ["--config", args.config, *extra]
    rows = [measure(flags, p, args.steps) for p in ("remote", "resident")]
    print(f"preset {args.config} {' '.join(extra)}; median of {args.steps} steps after warm-up")
    header = f"{'placement':<10} {'device':<8} {'step (s)':>9} {'tokens/s':>10}"
    print(f"{header} {'buffers MiB':>12} {'last loss':>10}")
    for r in rows:
        where = f"{r['placement']:<10} {r['device']:<8}"
        speed = f"{r['step_s']:>9.3f} {r['tokens_per_s']:>10,.0f}"
        print(f"{where} {speed} {r['buffers_MiB']:>12.1f} {r['last_loss']:>10.4f}")
    print(f"remote / resident step time: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")


if __name__ == "__main__":
    main()

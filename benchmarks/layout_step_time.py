"""Step time, per-rank buffer memory and loss curve of several (dp, tp1, tp2) layouts on CPU.

    python -m benchmarks.layout_step_time [--layouts 1x1x1 2x1x1 2x2x2] [--steps 3] [flags...]

Each layout runs as dp x tp1 x tp2 forked gloo processes on this machine (a ``file://``
rendezvous, no port) over the shipped sample data, with the preset's flags plus ``flags``. The
first step is warm-up and not timed. With ``--dropout_prob 0 --precision float32`` every layout
prints the same losses (up to float rounding): the global batch of a step does not depend on
the layout. On a machine with fewer cores than processes the step time measures the
oversubscription as much as the layout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from config.loading import parse_config
from data.loader import training_loader
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape
from execution.training.lr_schedule import learning_rate

DEFAULT_LAYOUTS = ["1x1x1", "2x1x1", "1x2x1", "1x1x2", "2x2x2"]  # dp x tp1 x tp2


def _rank(rank: int, world_size: int, flags: list[str], steps: int, folder: str) -> None:
    """One process: join the job, train ``steps + 1`` steps, rank 0 writes the timings."""
    torch.set_num_threads(1)  # one core's worth per process; the machine is shared
    store, timeout = f"file://{folder}/store", datetime.timedelta(minutes=10)
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world_size, timeout=timeout
    )
    config, _ = parse_config(flags)
    ex, t = config.execution, config.training
    sizes = (ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2)
    layout = ParallelLayout.build(*sizes, torch.device("cpu"))
    engine = planned_engine(RunShape.of(config), layout)
    loader = training_loader(config, layout.dp.rank, layout.dp.size)
    times, losses = [], []
    for step in range(steps + 1):
        batch = loader.next_batch()
        lr = learning_rate(step, t.optimizer, config.tokens_per_step, t.steps)
        dist.barrier()  # time the step, not the stragglers of the previous one
        start = time.perf_counter()
        losses.append(engine.train_step(batch, step, lr).loss)
        if step:
            times.append(time.perf_counter() - start)
    if layout.is_main:
        result = {
            "step_s": statistics.median(times),
            "losses": losses,
            "buffers_MiB": sum(engine.buffer_bytes().values()) / 2**20,
        }
        Path(folder, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(flags: list[str], layout: tuple[int, int, int], steps: int) -> dict:
    dp, tp1, tp2 = (str(n) for n in layout)
    sizes = ["--data_parallel", dp, "--tensor_parallel_1", tp1, "--tensor_parallel_2", tp2]
    flags = [*flags, *sizes, "--device", "cpu"]
    parse_config(flags)  # a bad layout fails here, with its one-line message
    world = math.prod(layout)
    with tempfile.TemporaryDirectory() as folder:
        context = multiprocessing.get_context("fork")
        procs = [
            context.Process(target=_rank, args=(r, world, flags, steps, folder))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"layout {layout}: exit codes {[p.exitcode for p in procs]}")
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    args, extra = parser.parse_known_args()
    flags = ["--config", args.config, *extra]
    config, _ = parse_config(flags)
    print(f"preset {args.config} {' '.join(extra)}; median of {args.steps} steps after warm-up")
    header = f"{'dp x tp1 x tp2':<15} {'step (s)':>9} {'tokens/s':>10}"
    print(f"{header} {'buffers MiB/rank':>17}  losses")
    for text in args.layouts:
        layout = tuple(int(v) for v in text.split("x"))
        assert len(layout) == 3, f"layout {text!r} is not DPxTP1xTP2"
        r = measure(flags, layout, args.steps)
        losses = " ".join(f"{loss:.6f}" for loss in r["losses"])
        tokens_per_s = config.tokens_per_step / r["step_s"]
        speed = f"{text:<15} {r['step_s']:>9.3f} {tokens_per_s:>10,.0f}"
        print(f"{speed} {r['buffers_MiB']:>17.2f}  {losses}", flush=True)


if __name__ == "__main__":
    main()

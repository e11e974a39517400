"""Checkpoint save and load speed, the time the training loop is held, and the extra memory.

    python -m benchmarks.checkpoint_io [--ranks 1 2 4] [--placements host device] [flags...]

Each row is one job of forked gloo processes on this machine (``file://`` rendezvous) holding a
GPT-2-small-sized model (12 layers x 768, 124M parameters: 0.5 GB of float32 weights, a 1.5 GB
checkpoint with both AdamW moments), sharded by RTS over ``--data_parallel`` = ranks. ``host``
keeps weights and moments in host buffers (``--placement remote``): the save writes them in the
background and the loop is held only if its next optimizer update comes before the last chunk is
copied out (``fence``, measured here with no step in between: the worst case). ``device`` keeps
them on the compute device (``--placement resident``; the CPU here): the save copies them off
first, and that copy is what holds the loop. Columns:

- ``save GB/s``: checkpoint bytes / the time from ``save()`` to the commit (slowest rank);
- ``held s``: ``save()``'s own time; ``fence s``: the optimizer's wait, worst case;
- ``load GB/s``: checkpoint bytes / the slowest rank's ``load_checkpoint`` (files possibly in
  the page cache: the load follows the save);
- ``save/load +MiB``: the largest rank's peak extra resident memory (high-water mark reset
  before each), beside its ``share MiB`` of the checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint

from benchmarks.bench_report import proc_status_bytes, reset_peak_memory
from config.loading import parse_config
from execution.checkpoint.dcp_plans import held_items, item_bytes
from execution.checkpoint.load import load_checkpoint
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape

MODEL = ["--layers", "12", "--hidden_size", "768", "--heads", "12", "--sequence_length", "64"]
PLACEMENTS = {"host": "remote", "device": "resident"}
CPU = torch.device("cpu")


def _extra_memory_since(base: int) -> int:
    return proc_status_bytes("VmHWM") - base


def _rank(rank: int, world: int, flags: list[str], folder: str) -> None:
    torch.set_num_threads(1)  # one core's worth per process
    store, timeout = f"file://{folder}/store", datetime.timedelta(minutes=10)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    config, _ = parse_config(flags)
    engine = planned_engine(RunShape.of(config), ParallelLayout.build(world, 1, 1, CPU))
    checkpointer = Checkpointer(Path(folder, "ckpt"), engine, config, log=lambda _: None)
    share = item_bytes(held_items(engine))

    gc.collect()
    dist.barrier()
    reset_peak_memory(CPU)
    base, started = proc_status_bytes("VmRSS"), time.perf_counter()
    checkpointer.save(1, None)
    held = time.perf_counter() - started
    fenced = time.perf_counter()
    checkpointer.wait_for_host_reads()  # what the next optimizer update does first
    fence = time.perf_counter() - fenced
    checkpointer.close()
    save_s, save_extra = time.perf_counter() - started, _extra_memory_since(base)

    gc.collect()
    dist.barrier()
    reset_peak_memory(CPU)
    base, started = proc_status_bytes("VmRSS"), time.perf_counter()
    load_checkpoint(Path(folder, "ckpt"), engine)
    load_s, load_extra = time.perf_counter() - started, _extra_memory_since(base)

    mine = {"share": share, "held": held, "fence": fence, "save_s": save_s, "load_s": load_s,
            "save_extra": save_extra, "load_extra": load_extra}  # fmt: skip
    results = [None] * world
    dist.all_gather_object(results, mine)
    if rank == 0:
        Path(folder, "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(flags: list[str], ranks: int, placement: str) -> dict:
    flags = [*flags, "--data_parallel", str(ranks), "--placement", PLACEMENTS[placement]]
    flags += ["--global_batch_size", str(ranks), "--micro_batch_size", "1", "--device", "cpu"]
    parse_config(flags)  # bad flags fail here, with their one-line message
    with tempfile.TemporaryDirectory() as folder:
        context = multiprocessing.get_context("fork")
        procs = [
            context.Process(target=_rank, args=(r, ranks, flags, folder)) for r in range(ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(
                f"{ranks} ranks, {placement}: exit codes {[p.exitcode for p in procs]}"
            )
        per_rank = json.loads(Path(folder, "result.json").read_text())
    total = sum(r["share"] for r in per_rank)
    worst = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    return {"bytes": total, **worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument(
        "--placements", nargs="+", choices=list(PLACEMENTS), default=["host", "device"]
    )
    args, extra = parser.parse_known_args()
    flags = ["--config", "tiny", *MODEL, *extra]
    print(f"tiny preset with {' '.join(MODEL + extra)}; times of the slowest rank")
    print(f"{'ranks':>5} {'state on':>8} {'ckpt GB':>8} {'save GB/s':>10} {'held s':>7} "
          f"{'fence s':>8} {'load GB/s':>10} {'share MiB':>10} {'save +MiB':>10} {'load +MiB':>10}")  # fmt: skip
    for ranks in args.ranks:
        for placement in args.placements:
            r = measure(flags, ranks, placement)
            gb, mib = r["bytes"] / 1e9, 2**20
            print(
                f"{ranks:>5} {placement:>8} {gb:>8.2f} {gb / r['save_s']:>10.2f} "
                f"{r['held']:>7.2f} {r['fence']:>8.2f} {gb / r['load_s']:>10.2f} "
                f"{r['share'] / mib:>10.0f} {r['save_extra'] / mib:>10.0f} "
                f"{r['load_extra'] / mib:>10.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""The calibration's measurements of the runtime around the kernels, as the engine runs it:
host link copies on the engine's own host memory, the engine's host AdamW, collectives between
two local ranks, and what waiting for a collective costs inside a step (see ``calibrate.py``'s
docstring; the engine's own host time per phase is ``host_phases.py``'s)."""

from __future__ import annotations

import dataclasses
import functools
import shlex
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from config.loading import parse_config
from config.schema import OptimizerConfig
from execution.engine.phases.recompute import attention_kernel
from execution.engine.storage.gradient_store import STAGING_ELEMENTS
from execution.engine.storage.host_memory import host_memory_for
from execution.engine.update.optimizer import AdamWDriver
from execution.parallel.launch import usable_cores
from execution.parallel.mesh import ParallelLayout
from execution.planning.device_specs import DeviceSpec
from execution.planning.measure import meta_step
from execution.planning.planner import planned_engine
from execution.planning.run_shape import RunShape
from execution.planning.time_model import estimate_step, phase_costs
from utils.sample_clock import (
    Sample,
    combined,
    summarise_together,
    synchronize,
    take_sample,
    timed,
)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
# The engine's own calls (execution/parallel/mesh.py): torch 2.13's names, else the older ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective_buffers(op: str, rank: int, full: torch.Tensor) -> tuple:
    """The tensors one ``op`` whose full-size tensor (the engine's payload count) is ``full``
    reads and writes, made before it is timed: a first touch of fresh memory is priced apart
    (``fresh_memory``), where the step's own allocations are counted."""
    half = full.numel() // 2
    if op == "all_gather":
        return full, full[rank * half : (rank + 1) * half].clone()
    if op == "reduce_scatter":
        return full[:half].clone(), full
    if op == "all_to_all":
        return torch.empty_like(full).fill_(0.0), full
    return (full,)


def _collective(op: str, rank: int, buffers: tuple) -> None:
    if op == "all_gather":
        all_gather_flat(*buffers)
    elif op == "reduce_scatter":
        reduce_scatter_flat(*buffers)
    elif op == "all_reduce":
        dist.all_reduce(buffers[0])
    elif op == "all_to_all":
        dist.all_to_all_single(*buffers)
    elif rank == 0:  # send: rank 0 sends the whole tensor, rank 1 receives it
        dist.send(buffers[0], 1)
    else:
        dist.recv(buffers[0], 0)


def measure_host_link(device: torch.device, sizes) -> dict:
    """Host <-> device copies as the engine makes them: on host memory allocated as its
    buffers are (:func:`host_memory_for`: pages registered with ``cudaHostRegister``, not
    ``pin_memory()``'s caching allocator) and on side streams, each direction alone and then
    both at once on two streams, as the engine loads a phase's weights while it stores
    another's gradients and activations. Absent on a CPU, where there is no link."""
    if device.type != "cuda":
        return {}
    n = sizes.link_bytes
    host = host_memory_for(device)
    loaded_from, stored_into = host.empty((n,), torch.uint8).fill_(1), host.empty((n,), torch.uint8)
    loaded_into = torch.empty(n, dtype=torch.uint8, device=device)
    stored_from = torch.ones(n, dtype=torch.uint8, device=device)
    load_stream, store_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    synchronize(device)  # the side streams do not wait for the default stream's fill

    def load() -> None:
        with torch.cuda.stream(load_stream):
            loaded_into.copy_(loaded_from, non_blocking=True)

    def store() -> None:
        with torch.cuda.stream(store_stream):
            stored_into.copy_(stored_from, non_blocking=True)

    def both() -> None:
        load()
        store()

    alone = [timed(copy, device, sizes.repeats).seconds for copy in (load, store)]
    together = timed(both, device, sizes.repeats).seconds
    return {
        "bytes": n,
        "h2d_alone_gb_per_s": n / alone[0] / 1e9,
        "d2h_alone_gb_per_s": n / alone[1] / 1e9,
        "both_seconds": together,
        # Each direction moved n bytes by the time both were done: what a phase that waits for
        # its loads and its stores sees of each, and of the two together.
        "h2d_gb_per_s": n / together / 1e9,
        "d2h_gb_per_s": n / together / 1e9,
        "both_gb_per_s": 2 * n / together / 1e9,
    }


class HostUpdateState:
    """What :meth:`AdamWDriver.update` reads of a :class:`StateStore` whose weights live on the
    host: one row of a decayed kind (``weights, grads, exp_avg, exp_avg_sq``), yielded in
    pieces of the gradient staging buffers' size (the pieces of gradients kept on the device,
    as gpt3_6.7B streamed keeps them), and its 16-bit weight copy, refreshed after each piece,
    where ``copy`` is given."""

    def __init__(self, tensors: list[torch.Tensor], copy: torch.Tensor | None):
        self.tensors, self.copy = tensors, copy
        self.places = {"weights": SimpleNamespace(remote=True)}
        self.masks = None  # dense
        self.device = torch.device("cpu")
        self.updating = None  # the driver runs it to its end (overlap off)

    def part_rows(self) -> list[tuple[str, int]]:
        return [("layers", 0)]

    def host_update_pieces(self, rows=None):
        n = self.tensors[0].numel()
        for start in range(0, n, STAGING_ELEMENTS):
            piece = slice(start, min(start + STAGING_ELEMENTS, n))
            yield "layers", "matrix", 0, piece, [t[piece] for t in self.tensors]

    def refresh_weight_copy(self, part: str, kind: str, row: int, piece: slice) -> None:
        if self.copy is not None:
            self.copy[piece].copy_(self.tensors[0][piece])


def host_update_threads(device: torch.device) -> int:
    """The threads one rank's host AdamW gets (the engine: the node's cores over its local
    ranks). A GPU machine starts a rank per GPU; a CPU spec describes one rank of the threads
    ``python -m benchmarks.calibrate --threads`` gives it."""
    if device.type == "cuda":
        return max(1, usable_cores() // max(torch.cuda.device_count(), 1))
    return max(1, min(torch.get_num_threads(), usable_cores()))


def measure_host_adamw(device: torch.device, sizes) -> dict:
    """Elements per second of the engine's host AdamW: :meth:`AdamWDriver.update` itself
    (torch's fused AdamW on its update thread, made per update with its team of cores, each
    piece's weight copy refreshed) on ``sizes.adamw_elements`` float32 elements in host
    memory allocated as the engine's buffers are. A GPU run computes in 16 bits and so keeps
    a bfloat16 copy of host weights; a CPU run (float32) keeps none. The gradients are scaled
    (clipping, a loss scale), which costs the update one multiply more than an unscaled one."""
    n = sizes.adamw_elements
    host = host_memory_for(device)
    weights, grads = (host.empty((n,), torch.float32).normal_() for _ in range(2))
    exp_avg, exp_avg_sq = (host.zeros((n,), torch.float32) for _ in range(2))
    copy = host.empty((n,), torch.bfloat16) if device.type == "cuda" else None
    threads = host_update_threads(device)
    state = HostUpdateState([weights, grads, exp_avg, exp_avg_sq], copy)
    driver = AdamWDriver(state, OptimizerConfig(), threads)
    update = functools.partial(driver.update, lr=1e-4, grad_scale=0.5)
    timing = timed(update, torch.device("cpu"), sizes.repeats)
    return {
        "elements": n,
        "threads": threads,
        "weight_copy": None if copy is None else "bfloat16",
        "seconds": timing.seconds,
        "elements_per_s": n / timing.seconds,
        "timing": timing.record(),
    }


def _has_pair(device: torch.device) -> bool:
    """Whether two ranks of this device kind can run here (not on one GPU)."""
    return device.type != "cuda" or torch.cuda.device_count() >= 2


def _pair_rank(rank: int, store: str, device_type: str, work, args: tuple, out) -> None:
    """One of two ranks: its device (a GPU each, or one CPU thread each, as torchrun starts
    two ranks), the process group (NCCL or gloo), then ``work(rank, device, *args, out)``."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=2)
    try:
        work(rank, device, *args, out)
    finally:
        dist.destroy_process_group()


def _on_pair(device: torch.device, work, *args) -> list:
    """Runs ``work`` on two local ranks of ``device``'s kind; what they append to ``out``."""
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        out = manager.list()
        store = f"file://{folder}/store"
        # A fresh interpreter per rank costs seconds of imports; a forked CPU rank sets its
        # threads before any op (the parent's OpenMP workers are not forked), and CUDA cannot
        # be forked once initialised.
        start = "spawn" if device.type == "cuda" else "fork"
        mp.start_processes(
            _pair_rank, (store, device.type, work, args, out), nprocs=2, start_method=start
        )
        return list(out)


def _time_collectives(rank: int, device: torch.device, sizes, repeats, out) -> None:
    """Times every op at every size, in rounds that take each once (a shared machine's speed
    drifts over seconds: each op and size then sees every phase of it); each rank adds its
    samples, which measure_collectives pairs."""
    fulls = {n: torch.ones(n // 4, device=device) for n in sizes}
    for attempt in range(repeats + 1):
        for op in COLLECTIVES:
            for nbytes in sizes:
                buffers = _collective_buffers(op, rank, fulls[nbytes])
                dist.barrier()
                sample = take_sample(functools.partial(_collective, op, rank, buffers), device)
                if attempt:  # the first sets up the pair's buffers
                    out.append((rank, op, nbytes, attempt, dataclasses.astuple(sample)))


def _paired(rows: list[tuple]) -> dict[tuple, list[Sample]]:
    """Both ranks' samples of each call, ``(rank, *call, attempt, sample fields)``, as one
    sample of the call, by call."""
    calls: dict[tuple, list[Sample]] = defaultdict(list)
    for _, *call, fields in rows:
        calls[tuple(call)].append(Sample(*fields))
    paired: dict[tuple, list[Sample]] = defaultdict(list)
    for (*call, _), samples in calls.items():
        paired[tuple(call)].append(combined(samples))
    return paired


def measure_collectives(device: torch.device, sizes) -> dict:
    """Payload GB/s of each op at each size between two local ranks; nothing where two ranks
    of this device kind are not available (one GPU)."""
    if not _has_pair(device):
        return {"rates": [], "why": "one GPU: no pair to measure"}
    args = (sizes.collective_bytes, sizes.collective_repeats)
    rates, timings = [], []
    for (op, nbytes), samples in _paired(_on_pair(device, _time_collectives, *args)).items():
        timing = summarise_together(samples)
        rates.append([op, nbytes, nbytes / timing.seconds / 1e9])
        timings.append({"op": op, "bytes": nbytes, "timing": timing.record()})
    order = {op: i for i, op in enumerate(COLLECTIVES)}
    rates.sort(key=lambda row: (order[row[0]], row[1]))
    return {"rates": rates, "timings": timings}


# A model whose every op is small: its step is the engine's host time and the ops' launches.
ENGINE_FLAGS = shlex.split(
    "--config tiny --hidden_size 32 --heads 2 --sequence_length 32 "
    "--max_positional_length 32 --vocab_size 512 --micro_batch_size 1 --precision float32 "
    "--dropout_prob 0 --placement resident --passes 1"
)


def _time_waited(rank: int, device: torch.device, shapes, steps, spec, out) -> None:
    """Real steps of the engine model at tensor-parallel 2 (every layer waits for all-reduces
    and all-gathers where it issues them), each shape in turn; rank 0 adds each shape's rows:
    median step, the time model's step without the wait's cost, and the waited-for calls."""
    layout = ParallelLayout.build(1, 2, 1, device)
    runs = []
    for layers, micro_batches in shapes:
        flags = [*ENGINE_FLAGS, "--layers", str(layers), "--tensor_parallel_1", "2"]
        flags += ["--global_batch_size", str(micro_batches), "--device", device.type]
        engine = planned_engine(RunShape.of(parse_config(flags)[0]), layout)
        plan = engine.plan
        row = plan.sequence_length + plan.model.label_columns
        shape = (plan.gradient_accumulation, plan.micro_batch_size, row)
        tokens = torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(0))
        runs.append((engine, tokens.to(device)))
    for step in range(steps + 2):
        for shape, (engine, tokens) in enumerate(runs):
            dist.barrier()
            train_step = functools.partial(engine.train_step, tokens, step=step, lr=1e-3)
            sample = take_sample(train_step, device)
            if step >= 2:  # the first two set up buffers and the pair's connections
                out.append((rank, shape, step, dataclasses.astuple(sample)))
    if rank == 0:
        shapes_only = ParallelLayout.shapes_only(1, 2, 1)
        kernel = attention_kernel(device.type, 0.0, torch.float32)  # ENGINE_FLAGS' precision
        for (layers, micro_batches), (engine, _) in zip(shapes, runs, strict=True):
            windows = meta_step(engine.plan, shapes_only, kernel).windows
            # The two ranks share the host's memory, as a run's do (RunShape's spec).
            pair = dataclasses.replace(spec, ranks_on_host=2)
            modelled = estimate_step(phase_costs(windows, shapes_only, pair), 1, 1, pair)
            waited = sum(
                count
                for w in windows
                for calls in w.calls.values()
                for (_, _, asynchronous), count in calls.items()
                if not asynchronous
            )
            row = {"layers": layers, "micro_batches": micro_batches, "waited_calls": waited}
            out.append(row | {"modelled_s": modelled["step_time_s"]})


def measure_waited_collectives(device: torch.device, sizes, spec: DeviceSpec) -> dict:
    """What a collective waited for where it is issued costs in a real step besides its
    payload at the op's bandwidth (the collectives measurement's fastest rate): its latency as
    a step sees it, the peer arriving late with its share of the machine's jitter, and the
    communication thread waking. Two ranks run the engine model at tensor-parallel 2 at two
    sizes; each step's excess over the time model without that cost (``spec``: this machine's
    rates and engine overhead, waited-for calls at bandwidth alone) is fitted as calls x cost
    per call, each row's residual relative to its step. Nothing where two ranks of this kind
    are not available (one GPU)."""
    if not _has_pair(device):
        return {"rows": [], "waited_us": None, "why": "one GPU: no pair to measure"}
    spec = dataclasses.replace(spec, waited_collective_us=0.0)
    out = _on_pair(device, _time_waited, sizes.waited_shapes, sizes.engine_steps, spec)
    rows = [row for row in out if isinstance(row, dict)]
    steps = _paired([sample for sample in out if not isinstance(sample, dict)])
    for shape, row in enumerate(rows):
        timing = summarise_together(steps[(shape,)])
        row |= {"step_s": timing.seconds, "timing": timing.record()}
    weights = np.array([1.0 / r["step_s"] ** 2 for r in rows])
    calls = np.array([r["waited_calls"] for r in rows], dtype=np.float64)
    excess = np.array([r["step_s"] - r["modelled_s"] for r in rows])
    per_call = float((weights * excess * calls).sum() / (weights * calls * calls).sum())
    return {"rows": rows, "waited_us": max(per_call, 0.0) * 1e6}

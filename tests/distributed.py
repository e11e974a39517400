"""Helpers for the distributed tests: forked gloo ranks, small configs and single-process runs.

Ranks are forked (start-up well under a second for 8 ranks, where ``spawn`` re-imports torch in
every rank for ~20 s on two cores). They rendezvous through a ``file://`` store in the test's
temporary folder, so no port is ever fixed, and each rank runs one intra-op thread so that eight
ranks share two cores without oversubscription. A rank that raises or hangs fails the test with
its traceback; the others are killed.

A fork copies only the forking thread, and every lock as it is at that moment. When the ranks are
forked, the pytest process also runs libgomp's intra-op worker (left by any parallel torch op,
``_warm_up`` included), OpenBLAS's server thread (numpy's; OpenBLAS stops its threads around a
fork itself) and, after some tests, idle helpers such as kineto's config thread. libgomp is not
fork-safe: a rank's libgomp still counts the parent's worker, so a parallel region of two or more
threads would wait for it forever; hence ``torch.set_num_threads(1)`` before anything else in a
rank. The process must not run torch.distributed's service threads (a TCPStore server, a gloo or
NCCL loop): a TCPStore server resolves each client's address under glibc's resolver lock, so a
rank forked meanwhile can inherit that lock held and hang when it connects. ``run_ranks``
refuses to fork while one runs: host stores inside the ranks.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from config.schema import PretrainingConfig
from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from execution.parallel.mesh import ParallelLayout
from execution.planning import planner
from execution.planning.measure import Measurements
from execution.planning.run_shape import RunShape
from tests.reference import small_config as reference_small_config

CPU = torch.device("cpu")
HOST = "127.0.0.1"  # where the ranks' rendezvous store listens
# The tests' one planning: a shape an earlier test measured is not measured again (the
# planner itself keeps nothing between plannings it is not given the same measurements for).
SESSION_MEASUREMENTS = Measurements()


def planned_engine(config: PretrainingConfig, layout: ParallelLayout) -> PhasedEngine:
    """:func:`execution.planning.planner.planned_engine` with the session's measurements."""
    return planner.planned_engine(RunShape.of(config), layout, SESSION_MEASUREMENTS)


# Losses and every unsharded weight of a float32 run must match the single-process run this
# closely (relative to the tensor's largest element; see ``relative_error``).
FLOAT32_TOLERANCE = 1e-5


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    folder: Path,
    timeout: float,
    init: bool,
    args: tuple,
) -> None:
    """Body of one forked rank: join the job, run ``fn``, save its result or its traceback."""
    try:
        # First, before any torch op: a parallel region of two or more threads would wait
        # forever for the parent's libgomp worker, which was not forked (module docstring).
        torch.set_num_threads(1)
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{folder / 'store'}",
                rank=rank,
                world_size=world_size,
                # A collective waiting longer than this means another rank died: fail, not hang.
                timeout=datetime.timedelta(seconds=timeout),
            )
            result = fn(*args)
        else:
            result = fn(rank, *args)
        torch.save(result, folder / f"result_{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        (folder / f"error_{rank}.txt").write_text(traceback.format_exc())
        # Skip interpreter clean-up inherited from the forked pytest process.
        os._exit(1)


@functools.cache
def _warm_up() -> None:
    """One single-process step in the parent, so forked ranks inherit the lazily imported
    modules (torch.func pulls in sympy: ~2.5 s per rank on two cores otherwise)."""
    config = small_config("--layers", "1", "--global_batch_size", "2")
    single_process_run(config, global_batches(config, 1))


def _distributed_service_threads() -> list[str]:
    """Names of this process's threads that torch.distributed started: a TCPStore server
    (``pt_tcpstore_uv``), a gloo loop (``gloo_tcp_loop``), NCCL watchdogs (``pt_nccl_...``)."""
    tasks = Path("/proc/self/task")  # Linux; elsewhere there is nothing to check
    names = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):  # the thread ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sorted(name for name in names if name.startswith(("pt_tcpstore", "gloo", "pt_nccl")))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    folder: Path,
    *args: Any,
    timeout: float = 120.0,
    init: bool = True,
) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` forked gloo ranks and returns each rank's result.

    Args:
        fn: Called in every rank after ``init_process_group``; its return value must be
            loadable with ``torch.load`` (tensors, numbers, lists, dicts).
        world_size: Number of ranks.
        folder: An empty folder for the rendezvous store and the results (pytest's tmp_path).
        args: Passed to ``fn`` (inherited through fork, never pickled).
        timeout: Seconds for the whole job.
        init: Join a gloo job through a file store before calling ``fn``; when False, ``fn``
            is called as ``fn(rank, *args)`` and joins (or not) by itself.

    Raises:
        AssertionError: A rank raised (its traceback is in the message), died or timed out.
    """
    _warm_up()
    service = _distributed_service_threads()
    assert not service, (
        f"run_ranks would fork while this process runs {service}; a rank forked while one of "
        "them holds a lock inherits it held and can hang (module docstring): host stores and "
        "process groups inside the ranks"
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    assert not any(folder.glob("store*")), "a job needs a fresh folder for its store"
    context = multiprocessing.get_context("fork")
    procs = [
        context.Process(target=_rank_main, args=(fn, r, world_size, folder, timeout, init, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # the others may be blocked in a collective with it: stop them
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    error_files = {r: folder / f"error_{r}.txt" for r in range(world_size)}
    errors = [f"rank {r}:\n{f.read_text()}" for r, f in error_files.items() if f.exists()]
    if errors:
        raise AssertionError("\n".join(errors))
    codes = [p.exitcode for p in procs]
    if timed_out:
        raise AssertionError(f"ranks did not finish within {timeout:.0f} s; exit codes {codes}")
    if any(code != 0 for code in codes):
        raise AssertionError(f"a rank died without a Python error; exit codes {codes}")
    return [torch.load(folder / f"result_{r}.pt", weights_only=False) for r in range(world_size)]


def host_store(folder: Path) -> dist.TCPStore:
    """Rank 0's stand-in for torchrun's agent: a rendezvous store on a free port, published in
    ``folder`` (written whole, then renamed, so no rank reads half a port). Ranks join it as
    torchrun's workers do (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0 too."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    partial = folder / "master_port.partial"
    partial.write_text(str(store.port))
    partial.replace(folder / "master_port")
    return store


def published_port(folder: Path) -> str:
    """The port rank 0 publishes. No deadline of its own: if rank 0 fails or hangs, run_ranks
    stops every rank."""
    path = folder / "master_port"
    while not path.exists():
        time.sleep(0.01)
    return path.read_text()


def small_config(*flags: str) -> PretrainingConfig:
    """The single-process tests' small config (tests/reference.py) resized, then ``flags``.

    Vocabulary 1000 and 10 positions need padding for every tensor_parallel_1 (1008, 1024 or
    1024 rows; 10 or 12 positions).

    AdamW epsilon is 1e-2. Adam divides by ``sqrt(v) + eps``, so an element whose gradient is
    about eps in size turns a float32 rounding difference of its gradient into an update
    difference ``lr / (4 eps)`` times larger, and any change of summation order (a tensor-
    parallel matmul, a sequence summed in pieces) changes that rounding. With eps 1e-6, two
    *single-process* runs that differ only in micro-batch size already disagree by 4e-6 after
    one step; with eps 1e-3, (1, 2, 2) with dropout differs from one process by 1.4e-6 and
    context parallel 2 by 2.3e-6 (on output biases). With eps 1e-2 every layout's updated
    weights stay within 1e-6 of the single process, while a layout bug (a wrong slice, a
    missing or doubled reduction, a misplaced micro-batch or dropout mask) shows up orders of
    magnitude above that: the gradients it corrupts still move every weight.

    Attention dropout is drawn head by head (``--dropout_parity``), so a layout with dropout
    draws the single process's masks; the fused kernel's draw depends on the shard's heads.
    """
    sizes = ["--vocab_size", "1000", "--sequence_length", "8", "--max_positional_length", "10"]
    parity = ["--dropout_parity", "true"]
    return reference_small_config(*sizes, "--eps", "1e-2", *parity, *flags)


def coords(rank: int, tp1: int, tp2: int) -> tuple[int, int, int]:
    """(d, i, j) of a global rank (docs/design.md, "The mesh and the rank formula"):
    ``r = d * tp1 * tp2 + i * tp2 + j``."""
    return rank // (tp1 * tp2), (rank // tp2) % tp1, rank % tp2


def layout_flags(dp: int, tp1: int, tp2: int, cp: int = 1) -> list[str]:
    sizes = {"--data_parallel": dp, "--tensor_parallel_1": tp1, "--tensor_parallel_2": tp2}
    if cp > 1:
        sizes["--context_parallel"] = cp
    return [text for flag, size in sizes.items() for text in (flag, str(size))]


def global_batches(config: PretrainingConfig, steps: int, seed: int = 0) -> torch.Tensor:
    """``[steps, global_batch, seq + 1]`` random token ids, the same for every layout."""
    shape = (steps, config.training.global_batch_size, config.model.sequence_length + 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.model.vocab_size, shape, generator=generator)


def replica_batch(config: PretrainingConfig, batch: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """Data-parallel replica ``dp_rank``'s ``[GA, mbs, seq + 1]`` share of one global batch.

    Rows ``[d * GA * mbs, (d + 1) * GA * mbs)``, as ``data.loader.PretrainingDataLoader`` does.
    """
    mbs = config.execution.micro_batch_size
    rows = config.gradient_accumulation * mbs
    return batch[dp_rank * rows : (dp_rank + 1) * rows].reshape(-1, mbs, batch.shape[-1])


def engine_batch(engine: PhasedEngine, batch: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """:func:`replica_batch` for the run an engine's plan describes."""
    mbs, plan = engine.plan.micro_batch_size, engine.plan
    rows = plan.gradient_accumulation * mbs
    return batch[dp_rank * rows : (dp_rank + 1) * rows].reshape(-1, mbs, batch.shape[-1])


def learning_rates(steps: int) -> list[float]:
    """A rising learning rate so each step's update has a different size."""
    return [2e-3 * (step + 1) for step in range(steps)]


def train_steps(engine: PhasedEngine, batches: torch.Tensor, dp_rank: int) -> list[dict]:
    """Runs one step per global batch; returns loss and grad norm of each (every rank)."""
    out = []
    for step, lr in enumerate(learning_rates(len(batches))):
        result = engine.train_step(engine_batch(engine, batches[step], dp_rank), step, lr)
        assert not result.skipped
        out.append({"loss": result.loss, "grad_norm": result.grad_norm})
    return out


def single_process_run(config: PretrainingConfig, batches: torch.Tensor) -> dict[str, Any]:
    """The reference: one process, every axis of size 1, fed each whole global batch.

    Returns:
        ``steps`` (loss and grad norm per step), the final unsharded ``weights``, the last
        step's ``grads`` and the ``engine`` itself.
    """
    single = with_execution(
        config, data_parallel=1, tensor_parallel_1=1, tensor_parallel_2=1, context_parallel=1
    )
    engine = planned_engine(single, ParallelLayout.single(CPU))
    return {
        "steps": train_steps(engine, batches, dp_rank=0),
        "weights": full_state(engine, "weights"),
        "grads": full_state(engine, "grads"),
        "engine": engine,
    }


def with_execution(config: PretrainingConfig, **execution: int) -> PretrainingConfig:
    """A deep copy of ``config`` with some execution fields replaced."""
    out = copy.deepcopy(config)
    for name, value in execution.items():
        setattr(out.execution, name, value)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |a - e| / max |e|``: error relative to the tensor's scale, so that elements that
    happen to be near zero (fresh biases) do not dominate; 0 / 0 counts as 0."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def assert_curves_close(results: list[dict], expected: dict, tolerance: float) -> None:
    """Every rank's loss and gradient norm of every step, and its validation loss
    (``eval_loss``), are within ``tolerance`` (relative) of ``expected``'s."""
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["steps"], expected["steps"], strict=True)):
            for key in ("loss", "grad_norm"):
                error = abs(got[key] - want[key]) / abs(want[key])
                assert error <= tolerance, f"rank {rank} step {step} {key}: {got} vs {want}"
        error = abs(result["eval_loss"] - expected["eval_loss"]) / expected["eval_loss"]
        assert error <= tolerance, f"rank {rank} validation loss {result['eval_loss']}"


def assert_states_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float, what: str
) -> None:
    """Every tensor of ``expected`` is in ``actual`` with the same shape, within ``tolerance``."""
    assert actual.keys() == expected.keys(), f"{what}: names differ"
    for name, t in expected.items():
        assert actual[name].shape == t.shape, f"{what} {name}: {actual[name].shape} != {t.shape}"
    worst = {name: relative_error(actual[name], t) for name, t in expected.items()}
    bad = {n: f"{e:.2e}" for n, e in worst.items() if not e <= tolerance}
    assert not bad, f"{what}: relative error above {tolerance:g}: {bad}"


def world_layout(config: PretrainingConfig) -> ParallelLayout:
    """This rank's layout of ``config``'s (dp, pp, cp, tp1, tp2) mesh (call inside a rank)."""
    ex = config.execution
    sizes = (ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2)
    return ParallelLayout.build(*sizes, CPU, cp=ex.context_parallel, pp=ex.pipeline_parallel)


def real_step_traffic(config: PretrainingConfig) -> dict:
    """One real gloo step of this rank (call inside a rank): its buffers and the bytes it sent
    over each group, as the dry run counts them."""
    from execution.planning.time_model import axis_traffic

    layout = world_layout(config)
    engine = planned_engine(config, layout)
    batch = replica_batch(config, global_batches(config, 1)[0], layout.dp.rank)
    engine.train_step(batch, 0, 1e-3)
    spec = RunShape.of(config).spec
    sent = {axis.name: axis_traffic(axis, spec)[0] for axis in layout.axes()}
    return {"buffers": engine.buffer_bytes(), "sent": sent}

"""Joining a job: the launcher's variables, the world-size check, the device and the groups.

torchrun, mpiexec (Open MPI, MPICH) and SLURM each say where a process belongs through
environment variables; :func:`setup_layout` reads them (here and nowhere deeper), checks them
against the preset's layout, joins the job and builds its :class:`ParallelLayout`. It also
learns whether this is a restart of the job (a torchrun ``--max-restarts`` restart, a SLURM
requeue) and the job's id, which stays the same over its restarts.
"""

from __future__ import annotations

import ctypes
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from config.loading import ConfigError
from config.schema import PretrainingConfig
from execution.parallel.collective_errors import CollectiveError, communicating
from execution.parallel.mesh import ParallelLayout
from execution.parallel.rendezvous import agent_store, job_of_torchrun, job_store


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node
    launcher: str
    # The same in every restart of the job (SLURM's job step, a torchrun command); None where
    # none is known. Rank 0's (torchrun's is read from its agent's store, by rank 0).
    job_id: str | None = None
    restarted: bool = False  # an earlier attempt of this job ran (rank 0 knows)


def read_launch_environment(env: Mapping[str, str]) -> LaunchInfo:
    """Rank and world size from torchrun, mpiexec (Open MPI, MPICH/PMI) or SLURM variables.

    torchrun's variables win, then MPI's, then SLURM's; none at all means a single process.
    For MPI and SLURM launches ``MASTER_ADDR`` and ``MASTER_PORT`` must be set by the user
    (the README shows how).
    """
    schemes = (
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        (
            "mpiexec",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    )
    for launcher, rank_key, size_key, local_key, local_size_key in schemes:
        if rank_key in env and size_key in env:
            try:
                rank, size = int(env[rank_key]), int(env[size_key])
                local = int(env.get(local_key, rank))
                # Unknown node size: assume all processes share one node (the cautious answer
                # for memory and GPU checks, and the same on every rank).
                local_size = int(env.get(local_size_key, size))
            except ValueError:
                raise ConfigError(
                    f"{launcher} variables {rank_key}={env[rank_key]!r} "
                    f"{size_key}={env[size_key]!r} are not integers"
                ) from None
            return LaunchInfo(rank, size, local, local_size, launcher, *_slurm_job(env))
    return LaunchInfo(0, 1, 0, 1, "single process", *_slurm_job(env))


def _slurm_job(env: Mapping[str, str]) -> tuple[str | None, bool]:
    """SLURM's (job id, restarted). A requeued job keeps its id and numbers its steps again
    from 0, so the job and step ids name one launch over its requeues; ``SLURM_RESTART_COUNT``
    counts them. Runs started one after another in one allocation share the ids but are no
    restarts (count 0): they are told apart as any two runs are."""
    if "SLURM_JOB_ID" not in env:
        return None, False
    count = env.get("SLURM_RESTART_COUNT", "0") or "0"
    if not count.isdigit():
        raise ConfigError(f"SLURM_RESTART_COUNT={count!r} is not a count")
    cluster = f" of cluster {env['SLURM_CLUSTER_NAME']}" if env.get("SLURM_CLUSTER_NAME") else ""
    step = env.get("SLURM_STEP_ID", "batch")
    return f"slurm job {env['SLURM_JOB_ID']} step {step}{cluster}", int(count) > 0


def check_world_size(config: PretrainingConfig, world_size: int) -> None:
    """Raises a one-line ConfigError when the launch does not fit the preset's layout."""
    ex = config.execution
    if world_size != config.world_size:
        pipeline = (
            f"--pipeline_parallel {ex.pipeline_parallel} x " if ex.pipeline_parallel > 1 else ""
        )
        context = f"--context_parallel {ex.context_parallel} x " if ex.context_parallel > 1 else ""
        raise ConfigError(
            f"--data_parallel {ex.data_parallel} x {pipeline}{context}--tensor_parallel_1 "
            f"{ex.tensor_parallel_1} x --tensor_parallel_2 {ex.tensor_parallel_2} = "
            f"{config.world_size} processes, but "
            f"the job has {world_size}; launch {config.world_size} processes (e.g. torchrun "
            f"--nproc_per_node {config.world_size}) or change the layout flags (--dry_run checks "
            f"this layout in one process; --plan_for {world_size} lists layouts of {world_size})"
        )


def select_device(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """The compute device for ``--device``: one GPU per process, or the CPU.

    ``auto`` takes this rank's GPU only when the node has a GPU for each of its processes, so
    every rank of a node makes the same choice (NCCL cannot share one GPU between ranks).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < local_world_size:
        raise ConfigError(
            f"--device cuda needs a GPU for each of the {local_world_size} process(es) on this "
            f"node, but {gpus} are available; launch fewer processes per node or use --device cpu"
        )
    if requested == "cpu" or (requested == "auto" and gpus < local_world_size):
        keep_freed_host_memory()
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_host_memory() -> bool:
    """Where the CPU is the device, keeps freed blocks for reuse, as CUDA's caching allocator
    does for a GPU. glibc otherwise maps every block over 32 MiB anew from the kernel and hands
    it back when freed, so each step's large activations (a micro-batch's logits) fault their
    pages in again: about a third of a ``tiny`` step on a 2-core machine. Process-wide and
    idempotent; the heap then stays at the step's peak, which the plan counts anyway. False
    where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # Every block from the heap (none mapped on its own), and the heap's top never trimmed.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def setup_layout(config: PretrainingConfig, env: Mapping[str, str] | None = None):
    """Joins the job described by the launcher's environment and builds its layout.

    Args:
        config: Validated config (its layout flags must match the job's world size).
        env: Launcher variables; ``os.environ`` when None. Read here and nowhere deeper.

    Returns:
        (layout, launch info). Call :func:`teardown` at the end.

    Raises:
        CollectiveError: a rank did not join within ``--collective_timeout``, or went away.
    """
    env = os.environ if env is None else env
    info = read_launch_environment(env)
    check_world_size(config, info.world_size)
    device = select_device(config.execution.device, info.local_rank, info.local_world_size)
    timeout_s = config.execution.collective_timeout
    try:
        with communicating("world", tuple(range(info.world_size)), timeout_s):
            info, store = _join_agent_store(info, env, timeout_s)
            if info.world_size == 1:
                return ParallelLayout.single(device), info
            return _join(config, info, device, store), info
    except CollectiveError as err:
        err.during("joining the job")
        raise


def _join_agent_store(info: LaunchInfo, env: Mapping[str, str], timeout_s: float):
    """Under torchrun's agent store (execution.parallel.rendezvous): the launch info with the
    job's id and restart (rank 0's), and the store this attempt's groups use; else (info,
    None), and ``init_process_group`` reads the launcher's variables itself."""
    if info.launcher != "torchrun" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return info, None
    try:
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ConfigError(
            "torchrun's MASTER_ADDR and MASTER_PORT are missing or not an address and a port"
        ) from None
    store = agent_store(host, port, timeout_s)
    if info.rank == 0:
        job, earlier = job_of_torchrun(store)
        # SLURM's id, where there is one, also holds over a requeue, which starts a new torchrun.
        info = replace(info, job_id=info.job_id or job, restarted=info.restarted or earlier)
    if info.world_size == 1:
        return info, None
    return info, job_store(store, info.rank, info.world_size, timeout_s)


def _join(config: PretrainingConfig, info: LaunchInfo, device: torch.device, store):
    """Joins the default group (through ``store``, or the launcher's variables) and builds
    every group of the layout, each waiting at most ``--collective_timeout``."""
    ex = config.execution
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=ex.collective_timeout),
        **({"store": store} if store is not None else {}),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return ParallelLayout.build(
        ex.data_parallel,
        ex.tensor_parallel_1,
        ex.tensor_parallel_2,
        device,
        ex.context_parallel,
        pp=ex.pipeline_parallel,
        timeout_s=ex.collective_timeout,
    )


def teardown() -> None:
    """Leaves the job's process group (if one was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()

"""The parallel geometry of a run: ranks, mesh axes and their process groups (DESIGN.md section 3).

Rank ``r = d * (tp1 * tp2) + i * tp2 + j`` where ``j`` indexes tensor_parallel_2 (innermost), ``i``
tensor_parallel_1 and ``d`` data_parallel. One :class:`ParallelLayout` is built at start-up and
passed to everything that communicates; there is no module-level process-group state.
"""

from __future__ import annotations

import collections
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from config.loading import ConfigError
from config.schema import PretrainingConfig

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the flat-tensor collectives and deprecated the old names (a FutureWarning
# per call); older versions only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class GroupAxis:
    """One communication group as seen by this rank; size 1 makes every collective a no-op.

    ``calls`` counts the collectives issued (by op name) so tests can check the schedule, and
    ``payload_bytes`` adds up their full-size tensors (the all-reduced tensor, the gathered
    output, the reduce-scattered input) for the dry run's traffic figures.
    """

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None = None
    members: tuple[int, ...] = ()  # global ranks of the group, in group-rank order
    # No process group at all: collectives only produce outputs of the right shape (meta
    # tensors), for measuring one rank's step inside a running job.
    shapes_only: bool = False
    calls: collections.Counter = field(default_factory=collections.Counter)
    payload_bytes: collections.Counter = field(default_factory=collections.Counter)

    def _count(self, op: str, full: torch.Tensor) -> None:
        self.calls[op] += 1
        self.payload_bytes[op] += full.numel() * full.element_size()

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` over the group (``sum``, ``max`` or ``min``)."""
        if self.size > 1:
            self._count(f"all_reduce_{op}", tensor)
            if not self._shapes_only(tensor):
                dist.all_reduce(tensor, _REDUCE_OPS[op], group=self.group)
        return tensor

    def _shapes_only(self, tensor: torch.Tensor) -> bool:
        assert not self.shapes_only or tensor.is_meta, "a shapes-only axis takes meta tensors"
        return self.shapes_only

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenation of every member's equally sized 1-D shard, in group-rank order."""
        if self.size == 1:
            return shard
        out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        self._count("all_gather", out)
        if not self._shapes_only(out):
            _all_gather_flat(out, shard.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This member's chunk of the elementwise sum of every member's 1-D ``full``."""
        if self.size == 1:
            return full
        self._count("reduce_scatter", full)
        out = torch.empty(full.numel() // self.size, dtype=full.dtype, device=full.device)
        if not self._shapes_only(out):
            _reduce_scatter_flat(out, full.contiguous(), group=self.group)
        return out


@dataclass(eq=False)
class ParallelLayout:
    """Sizes, this rank's coordinates and the groups of every axis of the (dp, tp1, tp2) mesh.

    Attributes:
        dp, tp1, tp2: The data-parallel and the two tensor-parallel axes.
        dp_tp1: Replicas holding identical copies of tp2-sharded vectors (their RTS group).
        dp_tp2: Replicas holding identical copies of tp1-sharded vectors (their RTS group).
        world: Every rank (global gradient norm, loss reporting).
        device: This rank's compute device.
    """

    dp: GroupAxis
    tp1: GroupAxis
    tp2: GroupAxis
    dp_tp1: GroupAxis
    dp_tp2: GroupAxis
    world: GroupAxis
    device: torch.device
    local_world_size: int = 1  # processes on this machine, sharing its host memory

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_main(self) -> bool:
        """The rank that writes logs, metrics and checkpoints."""
        return self.world.rank == 0

    def axes(self) -> list[GroupAxis]:
        return [self.dp, self.tp1, self.tp2, self.dp_tp1, self.dp_tp2, self.world]

    @classmethod
    def single(cls, device: torch.device) -> ParallelLayout:
        """The layout of one process: every axis has size 1."""
        axes = {name: GroupAxis(name, 1, 0) for name in _AXIS_NAMES}
        return cls(**axes, device=device)

    @classmethod
    def shapes_only(cls, dp: int, tp1: int, tp2: int, device: str | torch.device = "meta"):
        """Rank 0 of a (dp, tp1, tp2) layout with no process groups: collectives only shape
        their outputs (meta tensors). Lets a process measure a step of any layout, or build a
        rank's buffers on ``device`` (construction communicates nothing)."""
        sizes = {"dp": dp, "tp1": tp1, "tp2": tp2, "dp_tp1": dp * tp1, "dp_tp2": dp * tp2,
                 "world": dp * tp1 * tp2}  # fmt: skip
        axes = {n: GroupAxis(n, size, 0, shapes_only=True) for n, size in sizes.items()}
        return cls(**axes, device=torch.device(device))

    @classmethod
    def build(cls, dp: int, tp1: int, tp2: int, device: torch.device) -> ParallelLayout:
        """Creates every group of the mesh; all ranks of an initialised job must call this."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        assert world_size == dp * tp1 * tp2, "checked by check_world_size"
        coords = {r: (r // (tp1 * tp2), (r // tp2) % tp1, r % tp2) for r in range(world_size)}
        members = {
            # axis name -> function of (d, i, j) naming the group a rank belongs to
            "dp": lambda d, i, j: (i, j),
            "tp1": lambda d, i, j: (d, j),
            "tp2": lambda d, i, j: (d, i),
            "dp_tp1": lambda d, i, j: j,
            "dp_tp2": lambda d, i, j: i,
            "world": lambda d, i, j: 0,
        }
        axes = {}
        for name, key_of in members.items():
            groups: dict = collections.defaultdict(list)
            for r in range(world_size):
                groups[key_of(*coords[r])].append(r)
            mine = None
            # new_group is collective: every rank creates every group, in the same order.
            for key in sorted(groups):
                ranks = groups[key]
                pg = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = GroupAxis(name, len(ranks), ranks.index(rank), pg, tuple(ranks))
            axes[name] = mine
        return cls(**axes, device=device)


_AXIS_NAMES = ("dp", "tp1", "tp2", "dp_tp1", "dp_tp2", "world")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node
    launcher: str


def read_launch_environment(env: Mapping[str, str]) -> LaunchInfo:
    """Rank and world size from torchrun, mpiexec (Open MPI, MPICH/PMI) or SLURM variables.

    torchrun's variables win, then MPI's, then SLURM's; none at all means a single process.
    For MPI and SLURM launches ``MASTER_ADDR`` and ``MASTER_PORT`` must be set by the user
    (the README shows how).
    """
    schemes = (
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("mpiexec", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    )  # fmt: skip
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
            return LaunchInfo(rank, size, local, local_size, launcher)
    return LaunchInfo(0, 1, 0, 1, "single process")


def check_world_size(config: PretrainingConfig, world_size: int) -> None:
    """Raises a one-line ConfigError when the launch does not fit the preset's layout."""
    ex = config.execution
    if world_size != config.world_size:
        raise ConfigError(
            f"--data_parallel {ex.data_parallel} x --tensor_parallel_1 {ex.tensor_parallel_1} x "
            f"--tensor_parallel_2 {ex.tensor_parallel_2} = {config.world_size} processes, but "
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
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup_layout(config: PretrainingConfig, env: Mapping[str, str] | None = None):
    """Joins the job described by the launcher's environment and builds its layout.

    Args:
        config: Validated config (its layout flags must match the job's world size).
        env: Launcher variables; ``os.environ`` when None. Read here and nowhere deeper.

    Returns:
        (layout, launch info). Call :func:`teardown` at the end.
    """
    info = read_launch_environment(os.environ if env is None else env)
    check_world_size(config, info.world_size)
    device = select_device(config.execution.device, info.local_rank, info.local_world_size)
    ex = config.execution
    if info.world_size == 1:
        return ParallelLayout.single(device), info
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(minutes=30),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    layout = ParallelLayout.build(
        ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2, device
    )
    return layout, info


def teardown() -> None:
    """Leaves the job's process group (if one was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()

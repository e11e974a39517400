"""The parallel geometry of a run as process groups: one :class:`ParallelLayout`, built at
start-up from the mesh (:mod:`execution.parallel.mesh_shape`: the rank formula and the members
of every group) and passed to everything that communicates; there is no module-level
process-group state.

docs/design.md, "The mesh and the rank formula", draws the mesh and lists the groups.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from execution.parallel.collective_errors import communicating
from execution.parallel.mesh_shape import AXES as AXES
from execution.parallel.mesh_shape import COORDS as COORDS
from execution.parallel.mesh_shape import MeshShape as MeshShape
from utils.torch_private import is_fake

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the flat-tensor collectives and deprecated the old names (a FutureWarning
# per call); older versions only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Without a context axis the replicas of matrices are the data-parallel group itself: one
# group, not two with the same members (a run with cp = 1 creates and reports no second group
# of the same ranks).
_SAME_WHEN_NO_CP = {"dp_cp": "dp"}
# Without a pipeline these axes are size 1 and get no group (nor a place in ``axes()``), so a
# run with pp = 1 creates and reports no group it does not use.
PIPELINE_AXES = ("pp", "embedding")


class Pending:
    """A collective in flight (``async_op=True``): :meth:`wait` returns its result.

    Holds the collective's input until then, so the buffer it reads cannot be freed or reused
    while the background thread (gloo) or the communication stream (NCCL) still reads it.
    On CUDA, ``wait`` makes the *current* stream wait for the collective, not the host.
    """

    def __init__(self, result: torch.Tensor, work=None, source=None, axis=None):
        # ``source``: the input tensor; ``axis``: the GroupAxis a failed wait names.
        self._result, self._work, self._source, self._axis = result, work, source, axis

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with self._axis.failures() if self._axis else contextlib.nullcontext():
                self._work.wait()
            self._work = self._source = None
        return self._result


class _ShapesOnlyWork:
    """What a shapes-only collective "runs": nothing to wait for, but its :class:`Pending`
    holds the input until waited, as a real one does, so that a measured step (the planner's
    working set) counts an in-flight reduction's input beside the next phase's tensors."""

    def wait(self) -> None:
        pass


SHAPES_ONLY_WORK = _ShapesOnlyWork()


@dataclass(eq=False)
class GroupAxis:
    """One communication group as seen by this rank; size 1 makes every collective a no-op.

    ``calls`` counts the collectives issued (by op name) so tests can check the schedule, and
    ``sized_calls`` counts them by (op, payload bytes, issued with ``async_op``) for the dry
    run's traffic and time: the payload is the full-size tensor (the all-reduced tensor, the
    gathered output, the reduce-scattered input); the ``start_`` methods issue with
    ``async_op``, and those may run behind compute; and a call's time depends on its own size
    (a small one is all latency), not on the total's.
    """

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None = None
    members: tuple[int, ...] = ()  # global ranks of the group, in group-rank order
    # No process group at all: collectives only produce outputs of the right shape (meta
    # tensors), for measuring one rank's step inside a running job.
    shapes_only: bool = False
    # Point-to-point transfers toward higher group ranks, and toward lower ones, each on a
    # group of its own (None: on ``group``). NCCL ignores tags and runs a group's
    # point-to-point ops between two ranks in issue order, a send waiting for its receive: a
    # pipeline stage's dx receive, posted a pass ahead, would stand before its first x send,
    # while its successor's x receive stands before that successor's dx send, and the two
    # heads would be receive against receive. With a group per direction each pair of ranks
    # has one sender and one receiver per group, whose ops pair off in issue order.
    upward_group: dist.ProcessGroup | None = None
    downward_group: dist.ProcessGroup | None = None
    calls: collections.Counter = field(default_factory=collections.Counter)
    sized_calls: collections.Counter = field(default_factory=collections.Counter)
    timeout_s: float = 1800.0  # the job's --collective_timeout, for the error's message

    def failures(self):
        """Turns a collective of this group that times out or loses a rank into one line."""
        return communicating(self.name, self.members, self.timeout_s)

    def _count(self, op: str, full: torch.Tensor, async_op: bool = False) -> None:
        self.calls[op] += 1
        self.sized_calls[op, full.numel() * full.element_size(), async_op] += 1

    def _shapes_only(self, tensor: torch.Tensor) -> bool:
        layout_only = tensor.is_meta or is_fake(tensor)  # fake: the dry run's compiled parts
        assert not self.shapes_only or layout_only, "a shapes-only axis takes meta tensors"
        return self.shapes_only

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` over the group (``sum``, ``max`` or ``min``)."""
        return self._all_reduce(tensor, op, async_op=False).wait()

    def start_all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> Pending:
        """:meth:`all_reduce_` issued in the background; ``tensor`` is the result once waited."""
        return self._all_reduce(tensor, op, async_op=True)

    def _all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool) -> Pending:
        if self.size == 1:
            return Pending(tensor)
        self._count(f"all_reduce_{op}", tensor, async_op)
        work = None
        if not self._shapes_only(tensor):
            with self.failures():
                work = dist.all_reduce(tensor, _REDUCE_OPS[op], group=self.group, async_op=async_op)
        return Pending(tensor, work, axis=self)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenation of every member's equally sized 1-D shard, in group-rank order."""
        return self._all_gather(shard, async_op=False).wait()

    def start_all_gather(self, shard: torch.Tensor) -> Pending:
        """:meth:`all_gather` issued in the background."""
        return self._all_gather(shard, async_op=True)

    def _all_gather(self, shard: torch.Tensor, async_op: bool) -> Pending:
        if self.size == 1:
            return Pending(shard)
        out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        self._count("all_gather", out, async_op)
        if self._shapes_only(out):
            return Pending(out, SHAPES_ONLY_WORK, shard)
        shard = shard.contiguous()
        with self.failures():
            work = _all_gather_flat(out, shard, group=self.group, async_op=async_op)
        return Pending(out, work, shard, self)

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunk k of dim 0 (``size`` equal chunks) goes to member k; chunk k of the result
        came from member k. Its own inverse, so also its backward."""
        if self.size == 1:
            return chunks
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)
        self._count("all_to_all", chunks)
        if not self._shapes_only(out):
            with self.failures():
                dist.all_to_all_single(out, chunks, group=self.group)
        return out

    def start_send(self, tensor: torch.Tensor, to: int, tag: int) -> Pending:
        """Sends ``tensor`` to group rank ``to`` in the background (``isend``); its conjugate
        is :meth:`start_receive` on that rank with the same tag."""
        self._count("send", tensor, async_op=True)
        work = None
        if not self._shapes_only(tensor):
            group = self._point_to_point_group(self.rank, to)
            with self.failures():
                work = dist.isend(tensor, self.members[to], group=group, tag=tag)
        return Pending(tensor, work, tensor, self)

    def start_receive(self, into: torch.Tensor, source: int, tag: int) -> Pending:
        """Receives into ``into`` from group rank ``source`` in the background (``irecv``);
        :meth:`Pending.wait` gives it once arrived."""
        self._count("receive", into, async_op=True)
        work = None
        if not self._shapes_only(into):
            group = self._point_to_point_group(source, self.rank)
            with self.failures():
                work = dist.irecv(into, self.members[source], group=group, tag=tag)
        return Pending(into, work, axis=self)

    def _point_to_point_group(self, source: int, target: int) -> dist.ProcessGroup | None:
        """The group a transfer from group rank ``source`` to ``target`` runs on."""
        direction = self.upward_group if target > source else self.downward_group
        return direction or self.group

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This member's chunk of the elementwise sum of every member's 1-D ``full``."""
        return self._reduce_scatter(full, async_op=False).wait()

    def start_reduce_scatter(self, full: torch.Tensor) -> Pending:
        """:meth:`reduce_scatter` issued in the background."""
        return self._reduce_scatter(full, async_op=True)

    def _reduce_scatter(self, full: torch.Tensor, async_op: bool) -> Pending:
        if self.size == 1:
            return Pending(full)
        self._count("reduce_scatter", full, async_op)
        out = torch.empty(full.numel() // self.size, dtype=full.dtype, device=full.device)
        if self._shapes_only(out):
            return Pending(out, SHAPES_ONLY_WORK, full)
        full = full.contiguous()
        with self.failures():
            work = _reduce_scatter_flat(out, full, group=self.group, async_op=async_op)
        return Pending(out, work, full, self)


@dataclass(eq=False)
class ParallelLayout:
    """Sizes, this rank's coordinates and the groups of every axis of the (dp, pp, cp, tp1,
    tp2) mesh.

    Attributes:
        dp, cp, tp1, tp2: The data-parallel, context-parallel and two tensor-parallel axes.
        pp: The pipeline axis: this rank's stage is ``pp.rank``, its neighbours are
            ``pp.members[pp.rank -+ 1]``.
        embedding: The first and the last stage (size 1 without a pipeline, and on a middle
            stage): they sum the tied word embedding's gradient.
        dp_cp: Replicas holding identical copies of matrices (their RTS group, and the group
            their gradients are summed over); the ``dp`` axis itself when cp is 1.
        dp_tp1: Replicas holding identical copies of tp2-sharded vectors (their RTS group):
            dp x cp x tp1.
        dp_tp2: Replicas holding identical copies of tp1-sharded vectors (their RTS group):
            dp x cp x tp2.
        world: Every rank (global gradient norm, loss reporting).
        device: This rank's compute device.
    """

    dp: GroupAxis
    cp: GroupAxis
    tp1: GroupAxis
    tp2: GroupAxis
    dp_cp: GroupAxis
    dp_tp1: GroupAxis
    dp_tp2: GroupAxis
    world: GroupAxis
    device: torch.device
    pp: GroupAxis = field(default_factory=lambda: GroupAxis("pp", 1, 0, members=(0,)))
    embedding: GroupAxis = field(default_factory=lambda: GroupAxis("embedding", 1, 0, members=(0,)))
    local_world_size: int = 1  # processes on this machine, sharing its host memory

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_main(self) -> bool:
        """The rank that writes logs, metrics and checkpoints."""
        return self.world.rank == 0

    def axes(self) -> list[GroupAxis]:
        """Every distinct group, once (``dp_cp`` is ``dp`` when cp is 1; the pipeline axes
        only with a pipeline)."""
        pipeline = self.pp.size > 1
        axes = [getattr(self, n) for n in AXES if pipeline or n not in PIPELINE_AXES]
        return [a for n, a in enumerate(axes) if all(a is not b for b in axes[:n])]

    @classmethod
    def single(cls, device: torch.device) -> ParallelLayout:
        """The layout of one process: every axis has size 1."""
        mesh = MeshShape(1, 1, 1)
        axes = {name: GroupAxis(name, 1, 0, members=(0,)) for name in _axis_names(mesh)}
        return cls(**_with_aliases(axes, mesh), device=device)

    @classmethod
    def shapes_only(
        cls,
        dp: int,
        tp1: int,
        tp2: int,
        device: str | torch.device = "meta",
        cp: int = 1,
        pp: int = 1,
        stage: int = 0,
    ):
        """The first rank of pipeline stage ``stage`` of a (dp, pp, cp, tp1, tp2) layout with
        no process groups: collectives only shape their outputs (meta tensors). Lets a process
        measure a step of any layout, or build a rank's buffers on ``device`` (construction
        communicates nothing)."""
        mesh = MeshShape(dp, tp1, tp2, cp, pp)
        rank = mesh.rank(0, stage, 0, 0, 0)
        axes = {}
        for name in _axis_names(mesh):
            members = mesh.members(name, rank)
            index = members.index(rank)
            axes[name] = GroupAxis(name, len(members), index, members=members, shapes_only=True)
        return cls(**_with_aliases(axes, mesh), device=torch.device(device))

    @classmethod
    def build(
        cls,
        dp: int,
        tp1: int,
        tp2: int,
        device: torch.device,
        cp: int = 1,
        pp: int = 1,
        timeout_s: float = 1800.0,
    ) -> ParallelLayout:
        """Creates every group of the mesh; all ranks of an initialised job must call this.
        ``timeout_s`` bounds each collective's wait (new_group does not inherit the default
        group's timeout: gloo's groups would wait 30 minutes)."""
        mesh, rank = MeshShape(dp, tp1, tp2, cp, pp), dist.get_rank()
        assert dist.get_world_size() == mesh.world_size, "checked by check_world_size"
        timeout = datetime.timedelta(seconds=timeout_s)
        axes = {}
        for name in _axis_names(mesh):
            # new_group is collective: every rank creates every group, in the same order.
            for ranks in mesh.groups(name):
                group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                # The stages' transfers each way on a group of its own (GroupAxis).
                directions = {}
                if name == "pp" and group is not None:
                    directions = {
                        "upward_group": dist.new_group(list(ranks), timeout=timeout),
                        "downward_group": dist.new_group(list(ranks), timeout=timeout),
                    }
                if rank in ranks:
                    index = ranks.index(rank)
                    axes[name] = GroupAxis(
                        name, len(ranks), index, group, ranks, **directions, timeout_s=timeout_s
                    )
        if "embedding" in _axis_names(mesh) and "embedding" not in axes:  # a middle stage
            axes["embedding"] = GroupAxis("embedding", 1, 0, members=(rank,))
        return cls(**_with_aliases(axes, mesh), device=device)


def _axis_names(mesh: MeshShape) -> list[str]:
    """The axes that get a group of their own (not those that are another axis at cp 1, nor
    the pipeline's without a pipeline)."""
    return [
        n
        for n in AXES
        if not (mesh.cp == 1 and n in _SAME_WHEN_NO_CP)
        and not (mesh.pp == 1 and n in PIPELINE_AXES)
    ]


def _with_aliases(axes: dict[str, GroupAxis], mesh: MeshShape) -> dict[str, GroupAxis]:
    if mesh.cp == 1:
        axes.update({alias: axes[name] for alias, name in _SAME_WHEN_NO_CP.items()})
    return axes

"""NCCL's point-to-point rule, applied to gloo runs: a CPU stand-in that catches the deadlocks
a GPU job would hit.

Gloo matches a send with a receive by (peer, tag), whatever order either side issued them in.
NCCL ignores tags: between two ranks of one process group it runs point-to-point ops in issue
order on one stream, and a send waits for its receive. So a schedule that gloo completes can
hang under NCCL, e.g. when each of two ranks posts a receive from the other before its send.

:func:`recording` wraps ``torch.distributed``'s ``isend``, ``irecv`` and ``batch_isend_irecv``
inside a rank and logs every op in issue order (gloo still runs them). :func:`check_pairing`
then replays the logs of every rank under NCCL's rule: per process group and pair of ranks, the
two ranks' queues must pair off head to head, a send against a receive of equal size and dtype.
The ops of one ``batch_isend_irecv`` (one NCCL group call) may match in any order.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class P2POp:
    """One logged point-to-point op, as rank ``rank`` issued it."""

    group: str  # the process group's name (equal on every rank)
    rank: int  # global ranks
    peer: int
    kind: str  # "send" or "recv"
    numel: int
    dtype: str

    def pairs_with(self, other: P2POp) -> bool:
        """A send and a receive between the same two ranks, of equal size and dtype."""
        return (
            {self.kind, other.kind} == {"send", "recv"}
            and (self.rank, self.peer) == (other.peer, other.rank)
            and (self.numel, self.dtype) == (other.numel, other.dtype)
        )

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"rank {self.rank} {self.kind} {arrow} {self.peer} ({self.numel} x {self.dtype})"


# One entry of a rank's log: the ops of one call (one op, or one batch_isend_irecv).
Entry = tuple[P2POp, ...]


def _group_name(group) -> str:
    return "WORLD" if group is None else group.group_name


def _op(kind: str, tensor, peer: int, group) -> P2POp:
    """One op; ``peer`` is a global rank (as every call in this project passes it)."""
    rank, name = dist.get_rank(), _group_name(group)
    return P2POp(name, rank, peer, kind, tensor.numel(), str(tensor.dtype))


@contextlib.contextmanager
def recording() -> Iterator[list[Entry]]:
    """Logs this rank's point-to-point ops in issue order while the block runs (call inside
    an initialised rank). Yields the log, a list of entries filled as ops are issued."""
    log: list[Entry] = []
    isend, irecv, batch = dist.isend, dist.irecv, dist.batch_isend_irecv

    def logged_isend(tensor, dst=None, group=None, tag=0, **kwargs):
        log.append((_op("send", tensor, dst, group),))
        return isend(tensor, dst, group, tag, **kwargs)

    def logged_irecv(tensor, src=None, group=None, tag=0, **kwargs):
        log.append((_op("recv", tensor, src, group),))
        return irecv(tensor, src, group, tag, **kwargs)

    def logged_batch(ops):
        kinds = {"isend": "send", "irecv": "recv"}
        log.append(tuple(_op(kinds[o.op.__name__], o.tensor, o.peer, o.group) for o in ops))
        return batch(ops)

    dist.isend, dist.irecv, dist.batch_isend_irecv = logged_isend, logged_irecv, logged_batch
    try:
        yield log
    finally:
        dist.isend, dist.irecv, dist.batch_isend_irecv = isend, irecv, batch


class OrderError(AssertionError):
    """The logged ops would not pair off under NCCL: a deadlock or a mismatched transfer."""


def check_pairing(logs: dict[int, list[Entry]]) -> int:
    """Replays every rank's log (global rank -> entries) under NCCL's pairing rule.

    Returns:
        The number of send/receive pairs matched.

    Raises:
        OrderError: Naming the group, the two ranks and the ops at the heads of their queues.
    """
    # Per (group, pair of ranks), each rank's entries with that peer, in issue order.
    queues: dict[tuple, dict[int, list[list[P2POp]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for rank, entries in logs.items():
        for entry in entries:
            by_pair = collections.defaultdict(list)
            for op in entry:
                assert op.rank == rank, (op, rank)
                by_pair[op.group, frozenset((op.rank, op.peer))].append(op)
            for key, ops in by_pair.items():
                queues[key][rank].append(ops)
    matched = 0
    for (group, pair), sides in queues.items():
        a, b = sorted(pair)
        matched += _pair_off(group, sides[a], sides[b])
    return matched


def _pair_off(group: str, first: list[list[P2POp]], second: list[list[P2POp]]) -> int:
    """Pairs two ranks' queues head to head; the ops of one head entry match in any order."""
    first, second = [list(e) for e in first], [list(e) for e in second]
    matched = 0
    while first and second:
        found = next(
            ((x, y) for x in first[0] for y in second[0] if x.pairs_with(y)),
            None,
        )
        if found is None:
            heads = " | ".join(", ".join(map(str, head)) for head in (first[0], second[0]))
            raise OrderError(f"group {group}: the heads do not pair (NCCL would hang): {heads}")
        first[0].remove(found[0])
        second[0].remove(found[1])
        matched += 1
        for queue in (first, second):
            if not queue[0]:
                queue.pop(0)
    left = [str(op) for queue in (first, second) for entry in queue for op in entry]
    if left:
        raise OrderError(f"group {group}: ops with no partner (NCCL would hang): {left}")
    return matched

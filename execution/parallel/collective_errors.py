"""A collective that timed out or lost a rank, said in one line.

gloo raises a bare ``RuntimeError`` when a collective waits longer than the process group's
timeout (``--collective_timeout``) or when a peer's connection closes because that process
died. Left alone it is a traceback from deep in the engine that names neither the group nor
where the run was. :func:`communicating` turns those errors (and only those: any other
``RuntimeError`` is a bug and keeps its traceback) into a :class:`CollectiveError` naming the
group and its ranks; the callers up the stack add where the run was (the phase, the step), and
the entry point prints it as one line and exits 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# What gloo and the TCP store say when a wait runs out, and when a peer went away.
_TIMED_OUT = ("timed out", "timeout")
_LOST = ("connection closed", "connection reset", "connection refused", "broken pipe", "by peer")


class CollectiveError(RuntimeError):
    """A collective of one group timed out or lost a rank.

    Args:
        group: The group's name (``dp``, ``tp1``, ``world``, ``checkpoint``...).
        members: The group's global ranks.
        timed_out: It waited longer than ``timeout_s`` (else a rank went away).
        timeout_s: The job's ``--collective_timeout``.
    """

    def __init__(self, group: str, members: tuple[int, ...], timed_out: bool, timeout_s: float):
        super().__init__(group)
        self.group, self.members = group, members
        self.timed_out, self.timeout_s = timed_out, timeout_s
        self.places: list[str] = []  # innermost first

    def during(self, place: str) -> CollectiveError:
        """Adds where the run was (callers add theirs as the error passes them)."""
        self.places.append(place)
        return self

    def __str__(self) -> str:
        where = ", ".join(reversed(self.places))
        ranks = ", ".join(str(r) for r in self.members)
        if len(self.members) > 8:  # a long group's line names its first, second and last
            first, second, *_, last = self.members
            ranks = f"{first}, {second}, ..., {last}: {len(self.members)} ranks"
        if self.timed_out:
            what = (
                f"waited longer than --collective_timeout {self.timeout_s:g} s: one of its "
                "ranks stalled or died (its own output says which)"
            )
        else:
            what = "lost a rank: another process of the job ended (its own output says why)"
        said = f"a collective of the {self.group} group (ranks {ranks}) {what}"
        return f"{where}: {said}" if where else said


def failure_kind(err: BaseException) -> str | None:
    """Whether ``err`` says a wait ran out ("timed out") or a peer went away ("lost"); None
    for any other error (not a failure of the communication itself)."""
    text = str(err).lower()
    if any(word in text for word in _TIMED_OUT):
        return "timed out"
    if any(word in text for word in _LOST):
        return "lost"
    return None


@contextlib.contextmanager
def communicating(
    group: str,
    members: tuple[int, ...],
    timeout_s: float,
    catching: tuple[type[BaseException], ...] = (RuntimeError,),
    during: str = "",
) -> Iterator[None]:
    """Raises a :class:`CollectiveError` where the block's communication times out or loses
    a rank; other errors pass unchanged. ``catching``: the errors that may say so (DCP wraps
    a rank's in a ``CheckpointException``); ``during``: what the block does, if no caller
    up the stack says it."""
    try:
        yield
    except catching as err:
        if isinstance(err, CollectiveError):
            raise
        kind = failure_kind(err)
        if kind is None:
            raise
        error = CollectiveError(group, members, kind == "timed out", timeout_s)
        raise (error.during(during) if during else error) from err

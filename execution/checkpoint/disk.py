"""A save the disk cannot take: the room a checkpoint needs, and why a write failed, in words.

A checkpoint's size is known before it is written: the logical (unsharded, unpadded) float32
weights and both AdamW moments of every parameter, and a sparse run's masks. DCP's files add
about 1.6 KB per written chunk and the index and trainer state some KB (0.2% at ``tiny``), so a
save that finds just that much room too little still fails as it writes, and is said the same
way. Whatever stops a write (a full disk, a quota, a vanished mount, permissions changed while
the run went on) fails that save only: :class:`~execution.checkpoint.save.Checkpointer` says so
in one line and training goes on.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from config.loading import one_line
from execution.checkpoint.files import step_folders
from execution.engine.engine import PhasedEngine
from execution.parallel.collective_errors import CollectiveError

# What PyTorch's zip writer (torch.save, under DCP) raises when the file under it took only part
# of a write: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (a full
# disk), or "PytorchStreamWriter failed writing file ...".
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter")


def checkpoint_bytes(engine: PhasedEngine) -> int:
    """The bytes of one checkpoint's tensors (module docstring): the same for every layout."""
    from execution.checkpoint.dcp_plans import logical_sizes  # imports DCP: only when used

    return 4 * sum(size.numel() for size in logical_sizes(engine).values())


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def free_bytes(directory: Path) -> int | None:
    """Free bytes of ``directory``'s file system for this process; None if it cannot be read
    (the save that needs it says why)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def no_room(directory: Path, needed: int, what: str) -> OSError | None:
    """ENOSPC if ``directory``'s file system has less than ``needed`` bytes free; ``what`` is
    what needs them (the line that says it gives the numbers)."""
    free = free_bytes(directory)
    if free is None or free >= needed:
        return None
    return OSError(errno.ENOSPC, f"not enough space for {what}, nothing was written")


def room_warning(directory: Path, size: int, keep: int, saves: int) -> str | None:
    """One line if ``directory``'s file system cannot hold the checkpoints the run will have at
    once: ``keep`` kept and the one being written (``keep`` 0 keeps all: the ``saves`` the run
    makes, beside those already there). None when they fit, or there is nothing to save."""
    free = free_bytes(directory)
    if free is None or saves == 0 or size == 0:
        return None
    existing = step_folders(directory)
    held = sum(_folder_bytes(folder) for _, folder in existing)
    if keep:
        # The folder's checkpoints are pruned to ``keep`` as new ones are committed: their
        # room is the new ones' too.
        at_once, room = min(keep + 1, len(existing) + saves), (free + held) // size
        if room >= at_once:
            return None
        return (
            f"warning: --save {directory} has room for {room} checkpoint(s) of "
            f"{megabytes(size)} ({megabytes(free)} free on its file system), but "
            f"--keep_checkpoints {keep} needs {at_once} at once ({at_once - 1} kept and the one "
            "being written); saves that do not fit will fail, and training goes on"
        )
    room = free // size
    if room >= saves:
        return None
    return (
        f"warning: --save {directory} has room for {room} of this run's {saves} checkpoint(s) "
        f"of {megabytes(size)} ({megabytes(free)} free on its file system, and "
        "--keep_checkpoints 0 keeps them all); saves that do not fit will fail, and training "
        "goes on"
    )


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    except OSError:
        return 0


def failure_reason(err: BaseException) -> str | None:
    """Why a save's write failed, in words, if ``err`` says the file system refused it: an
    OSError anywhere in its chain or, from DCP, in any rank's failure that its
    ``CheckpointException`` gathers; or PyTorch's writer finding a write cut short (which keeps
    the OSError only in the rank's own chain). None for anything else: a bug keeps its
    traceback, and a collective that failed is said as such."""
    cut_short = None
    for error in _errors(err):
        if isinstance(error, CollectiveError):
            return None
        if isinstance(error, OSError):
            return _os_reason(error)
        if isinstance(error, RuntimeError) and any(w in str(error) for w in _TORCH_WRITER):
            cut_short = cut_short or error
    if cut_short is None:
        return None
    said = one_line(cut_short, limit=200).removeprefix(
        "[enforce fail at inline_container.cc:672] . "
    )
    return f"the file system took only part of a write (PyTorch's writer: {said})"


def _errors(err: BaseException) -> list[BaseException]:
    """``err``, the errors it was raised from or over, and the ranks' errors DCP gathered."""
    found, seen, todo = [], set(), [err]
    while todo:
        error = todo.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        found.append(error)
        todo += [error.__cause__, error.__context__]
        # DCP's CheckpointException: rank -> (error, trace)
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found


def _os_reason(error: OSError) -> str:
    text = error.strerror or one_line(error, limit=200) or type(error).__name__
    return f"{text}: {error.filename}" if error.filename else text

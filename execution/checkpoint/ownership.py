"""Which run a ``--save`` or ``--output_dir`` folder belongs to, and the one process that may
write into it, so that one run never damages another's files.

A run has an id: a new one when it starts from scratch (or only evaluates), the loaded
checkpoint's when it resumes (``--load``), so a resumed run is the same run. The id is written
to ``run.json`` in each folder the run writes to, and to every checkpoint's ``trainer.json``. A
folder without ``run.json`` (and a checkpoint whose ``trainer.json`` names no run) belongs to
the run that resumes from a checkpoint inside it.

Before it writes anything, a run checks each of its folders (:func:`check_run_folder`):

- neither the folder nor any folder above it is a checkpoint (``step_N``): a checkpoint holds
  exactly the files its manifest lists, so any file added to it makes it unloadable;
- no folder above it is another run's ``--save`` folder;
- the folder itself holds no other run's checkpoints, metrics or ``run.json``: saving there
  would replace that run's ``step_N`` and move its ``latest`` back, pruning would delete its
  checkpoints by step number, and a new ``run.json`` would refuse that run's own resume;
- it can be written (a read-only ``--save`` found at the first save loses the steps before).

Then it claims each folder (:func:`claim_folder`): an exclusive ``flock`` on the folder's
``run.lock``, held until the run ends, and the checks again under it. A second process given
the folder, even one of the same run (a requeued job started twice), is refused in one line.
The kernel drops the lock when its process dies, so a killed run leaves no stale claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from config.loading import ConfigError
from execution.checkpoint.files import (
    LATEST_FILE,
    MANIFEST_FILE,
    TRAINER_FILE,
    step_folders,
    write_atomic,
)

RUN_FILE, LOCK_FILE, METRICS_FILE = "run.json", "run.lock", "metrics.jsonl"
SAVE_FLAG, OUTPUT_FLAG = "--save", "--output_dir"
# A checkpoint, one being written, or one being replaced (execution.checkpoint.save).
_CHECKPOINT_NAME = re.compile(r"^step_\d+(\.tmp|\.old)?$")


def new_run_id() -> str:
    return uuid.uuid4().hex


def checkpoint_run_id(folder: Path, trainer: dict[str, Any]) -> str:
    """The id of the run that saved the checkpoint ``folder`` (its ``trainer.json``): a
    checkpoint that names no run belongs to the run of the save folder it lies in."""
    return trainer.get("run_id") or _legacy_id(folder.parent)


def _legacy_id(directory: Path) -> str:
    return f"folder:{directory.resolve()}"


def _claimed_by(directory: Path, strict: bool = True) -> str | None:
    """The id in ``directory``'s ``run.json``, None without one. A damaged one is an error
    (``strict``, for a folder the run would write to) or no claim (a folder above it, whose
    ``run.json`` may be another program's)."""
    file = directory / RUN_FILE
    if not file.is_file():
        return None
    try:
        return str(json.loads(file.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        if not strict:
            return None
        raise ConfigError(
            f"{file} is damaged ({type(err).__name__}): it should name the run that owns "
            f"{directory}; give a new folder"
        ) from None


def _holds_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` is a ``--save`` folder: a ``latest``, or a run's step folders."""
    return (directory / LATEST_FILE).is_file() or (
        (directory / RUN_FILE).is_file() and bool(step_folders(directory))
    )


def _is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint (complete, being written or replaced) or the slot of
    one in a ``--save`` folder."""
    if (folder / MANIFEST_FILE).is_file() or (folder / TRAINER_FILE).is_file():
        return True
    return bool(_CHECKPOINT_NAME.match(folder.name)) and _holds_checkpoints(folder.parent)


def check_run_folder(directory: Path, run_id: str, flag: str) -> None:
    """Raises a one-line ConfigError if run ``run_id`` may not write into ``directory`` (the
    module docstring's checks); ``flag`` is ``--save`` or ``--output_dir``."""
    where = directory.resolve()
    for folder in (where, *where.parents):
        if _is_checkpoint(folder):
            inside = "is" if folder == where else f"is inside {folder}, which is"
            raise ConfigError(
                f"{flag} {directory} {inside} a checkpoint: a checkpoint holds only the files its "
                "manifest lists, so nothing else may be written into it; give a folder outside it"
            )
    for folder in where.parents:
        if _holds_checkpoints(folder):
            owner = _claimed_by(folder, strict=False) or _legacy_id(folder)
            if owner != run_id:
                raise ConfigError(
                    f"{flag} {directory} is inside {folder}, the --save folder of another run; "
                    "give a folder outside it"
                )
    _check_own_folder(directory, run_id, flag)
    _check_writable(directory, where, flag)


def _check_own_folder(directory: Path, run_id: str, flag: str) -> None:
    owner = _claimed_by(directory)
    steps = step_folders(directory)
    if owner is None and (steps or (directory / LATEST_FILE).exists()):
        owner = _legacy_id(directory)
    if owner == run_id:
        return
    metrics = (directory / METRICS_FILE).exists()
    if owner is None and not (flag == OUTPUT_FLAG and metrics):
        return
    checkpoints = bool(steps) or (directory / LATEST_FILE).exists()
    if checkpoints:
        newest = f" (up to {steps[-1][1].name})" if steps else ""
        holds = f"holds the checkpoints of another run{newest}"
    elif metrics:
        holds = f"already holds the {METRICS_FILE} of another run (its metrics, no checkpoint)"
    else:
        holds = f"belongs to another run (its {RUN_FILE})"
    if flag == SAVE_FLAG:
        # Only a folder with checkpoints can be resumed from: elsewhere --load would refuse.
        resume = f", or resume that run with --load {directory}" if checkpoints else ""
        raise ConfigError(
            f"{flag} {directory} {holds}; a checkpoint folder belongs to one run: give a new "
            f"--save folder{resume}"
        )
    raise ConfigError(
        f"{directory} {holds}; choose a new --output_dir (or leave it out for a fresh folder "
        "under runs/)"
    )


def _check_writable(directory: Path, where: Path, flag: str) -> None:
    existing = next(folder for folder in (where, *where.parents) if folder.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {directory}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == where else f" ({existing}, where it would be made)"
        raise ConfigError(
            f"cannot write to {flag} {directory}{what}: it is read-only for this process; make "
            "it writable or give another folder"
        )


def record_owner(directory: Path, run_id: str, job: str | None = None) -> None:
    """Writes ``run.json`` naming ``run_id`` into ``directory`` (claimed by this process), and
    the launch's ``job`` (execution.parallel.launch), by which a restart of the job that saved
    no checkpoint yet knows the run as its own (execution.training.restart)."""
    record = {"run_id": run_id, **({"job": job} if job else {})}
    if owner_record(directory) != record:
        write_atomic(directory / RUN_FILE, json.dumps(record) + "\n")


def owner_record(directory: Path) -> dict[str, Any] | None:
    """``directory``'s ``run.json`` (its run's id and job), None without a readable one."""
    try:
        record = json.loads((directory / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "run_id" in record else None


class _Hold:
    """This process's lock on one folder, shared by its claims of it (a run whose
    ``--output_dir`` is its ``--save`` claims the folder twice; flock would refuse the second
    open of the lock file)."""

    def __init__(self, fd: int, made: list[Path]):
        self.fd, self.made, self.claims = fd, made, 1


_held: dict[Path, _Hold] = {}
_held_by = os.getpid()


def _holds() -> dict[Path, _Hold]:
    """This process's holds. A forked child inherits its parent's dict, and the parent's
    lock with its fd, but not the claim: it must lock the folder for itself (and be refused
    while the parent holds it)."""
    global _held, _held_by
    if _held_by != os.getpid():
        _held, _held_by = {}, os.getpid()
    return _held


class FolderClaim:
    """This process's exclusive hold on a run folder, until :meth:`release`."""

    def __init__(self, directory: Path, key: Path):
        self.directory, self._key, self._released = directory, key, False

    def release(self, undo: bool = False) -> None:
        """Lets the folder go (once every claim of it by this process is released).

        Args:
            undo: The run failed before it started: remove the folders and the lock file
                the claim made, so that a refused run leaves nothing behind.
        """
        if self._released:
            return
        self._released = True
        holds = _holds()
        hold = holds[self._key]
        hold.claims -= 1
        if hold.claims:
            return
        del holds[self._key]
        try:
            if undo:  # unlinked while still locked: a process that opened it sees the inode go
                for path in reversed(hold.made):
                    with contextlib.suppress(OSError):
                        if path.name == LOCK_FILE:
                            path.unlink()
                        else:
                            path.rmdir()
        finally:
            os.close(hold.fd)


def claim_folder(directory: Path, run_id: str, flag: str, new: bool = False) -> FolderClaim:
    """Claims ``directory`` (made if missing) for this process: locks its ``run.lock`` and
    checks it again under the lock (the check before the lock raced with other processes).

    Args:
        new: The folder must not exist yet (FileExistsError if it does).

    Raises:
        ConfigError: another process holds the folder, or the checks fail (one line).
    """
    key = directory.resolve()
    holds = _holds()
    if key in holds and not new:
        holds[key].claims += 1
        return FolderClaim(directory, key)
    made = _make_folders(key, new, flag, directory)
    try:
        fd, made_lock = _lock(key / LOCK_FILE, flag, directory)
    except BaseException:
        _remove_folders(made)
        raise
    holds[key] = _Hold(fd, [*made, key / LOCK_FILE] if made_lock else made)
    claim = FolderClaim(directory, key)
    try:
        check_run_folder(directory, run_id, flag)
    except BaseException:
        claim.release(undo=True)
        raise
    return claim


def claim_new_folder(directory: Path, run_id: str) -> tuple[Path, FolderClaim]:
    """Claims a new ``--output_dir``: ``directory``, or ``directory-2``, ``-3``... if taken
    (two runs started in the same second get folders of their own)."""
    for n in itertools.count(1):
        candidate = directory if n == 1 else directory.with_name(f"{directory.name}-{n}")
        try:
            return candidate, claim_folder(candidate, run_id, OUTPUT_FLAG, new=True)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _make_folders(key: Path, new: bool, flag: str, directory: Path) -> list[Path]:
    """Makes ``key`` and the folders above it that are missing; returns those made,
    outermost first."""
    missing = [folder for folder in (key, *key.parents) if not folder.exists()][::-1]
    if new and key not in missing:
        raise FileExistsError(key)
    made = []
    try:
        for folder in missing:
            folder.mkdir(exist_ok=not (new and folder == key))
            made.append(folder)
    except FileExistsError:
        _remove_folders(made)
        raise
    except OSError as err:
        _remove_folders(made)
        raise ConfigError(f"cannot create {flag} {directory}: {err.strerror}") from None
    return made


def _remove_folders(made: list[Path]) -> None:
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _lock(path: Path, flag: str, directory: Path) -> tuple[int, bool]:
    """An fd of ``path`` holding its exclusive flock, and whether this call made the file."""
    while True:
        fd, made = _open(path, flag, directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{flag} {directory} is in use by {holder}: a run's folder is written by one "
                "process at a time; wait for that one to end, or give another folder"
            ) from None
        except OSError as err:
            os.close(fd)
            raise ConfigError(
                f"cannot lock {path} ({flag}): {err.strerror}; a run's folders must be on a file "
                "system with flock (Lustre: mounted with -o flock)"
            ) from None
        # A claim undone in between unlinks the file it locked: a lock on that inode guards
        # nothing, so lock the file now at the path.
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    return fd, made


def _holder(fd: int) -> str:
    """Which process holds the flock on ``fd``'s file, from Linux's /proc/locks. The lock file
    itself stays empty: a claim that writes into it would change the folder of a run it is
    refused."""
    status = os.fstat(fd)
    wanted = (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "->" lines are waiters, not holders
            continue
        major, minor, inode = fields[5].split(":")
        if (int(major, 16), int(minor, 16), int(inode)) == wanted:
            return f"process {fields[4]}"
    return "another process"


def _open(path: Path, flag: str, directory: Path) -> tuple[int, bool]:
    """An fd of the lock file ``path``, and whether this call made it."""
    try:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(path, os.O_RDWR), False
    except OSError as err:
        raise ConfigError(f"cannot open {path} ({flag} {directory}): {err.strerror}") from None

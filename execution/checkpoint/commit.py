"""One save's writes into a ``--save`` folder, on every rank, and rank 0's commit; and what
happens when the file system refuses one of them.

Every rank writes its chunks (and rank 0 DCP's index) through ``dcp.save``, after each checked
that its file system has room (:mod:`execution.checkpoint.disk`). Then every rank reads back the
size and CRC-32C of its own files, rank 0 gathers them, writes ``trainer.json`` and
``manifest.json``, renames ``step_N.tmp`` to ``step_N``, points ``latest`` at it and prunes.

A write the file system refuses (no space, a quota, a vanished mount, permissions changed while
the run went on: an OSError, or PyTorch's writer finding a write cut short) fails that save on
every rank, wherever it struck: DCP gathers each rank's error and raises them on every rank,
the files' sizes are gathered, and rank 0's commit ends with its word on the save, broadcast.
Rank 0 removes ``step_N.tmp``, a commit that failed half-way is undone (``latest`` never moves),
and one line names the step, the folder, the reason and the newest intact checkpoint. The run
goes on; the next save tries again. Any other error is a bug and is raised as it is.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from execution.checkpoint.disk import failure_reason, free_bytes, megabytes, no_room
from execution.checkpoint.files import (
    LATEST_FILE,
    MANIFEST_FILE,
    TRAINER_FILE,
    file_crc,
    fsync,
    single_process_quiet,
    step_folders,
    write_atomic,
)
from execution.parallel.collective_errors import communicating
from execution.parallel.mesh import ParallelLayout


class SaveFolder:
    """The writes of one run's saves into its ``--save`` folder, and their outcomes.

    Args:
        directory: The save folder (claimed by rank 0).
        layout: This rank's layout.
        group: The checkpointer's own gloo group (None in one process).
        timeout_s: ``--collective_timeout``.
        keep: Keep only the newest ``keep`` checkpoints (0 keeps all).
        log: Where rank 0's messages go (nothing on other ranks).
        checkpoint_bytes: The size of one checkpoint's tensors.

    Attributes:
        failed_saves: How many saves failed (the same on every rank).
        last_failure: Why the last save failed ("step N: reason"), None if it was committed.
        newest: The newest complete checkpoint (``step_N``, what ``latest`` names), None
            before the first (rank 0 only).
    """

    def __init__(
        self,
        directory: Path,
        layout: ParallelLayout,
        group,
        timeout_s: float,
        keep: int,
        log: Callable[[str], None],
        checkpoint_bytes: int,
    ):
        self.directory, self.layout, self.group = directory, layout, group
        self.timeout_s, self.keep, self.log = timeout_s, keep, log
        self.checkpoint_bytes = checkpoint_bytes
        self.ranks = tuple(range(dist.get_world_size(group))) if group is not None else ()
        self.failed_saves = 0
        self.last_failure: str | None = None
        self.newest: str | None = None
        if layout.is_main:
            with contextlib.suppress(OSError):
                self.newest = (directory / LATEST_FILE).read_text().strip() or None

    def write(
        self,
        planner_args: tuple,
        extra: dict[str, torch.Tensor],
        host_read: threading.Event,
        final: Path,
        trainer: dict,
        started: float,
        held_seconds: float,
    ) -> None:
        """Background thread: every rank writes its chunks, then rank 0 commits (module
        docstring). ``planner_args``: the ``ChunkSavePlanner``'s items, logical sizes and row
        lookup; ``host_read`` is set once every chunk has been copied out of its row."""
        write_started, step = time.perf_counter(), trainer["step"]
        tmp = final.with_name(final.name + ".tmp")
        try:
            failure = self._write_chunks(planner_args, extra, host_read, tmp, step)
        finally:
            host_read.set()  # a failed write must not hold the training loop forever
        files: dict[str, list[int]] = {}
        if failure is None:  # DCP's own collectives told every rank the same
            files, failure = self._gather_files(tmp, step)
        gb = 0.0
        if self.layout.is_main and failure is None:
            try:
                gb = self._complete(tmp, final, trainer, files)
            except OSError as err:
                failure = failure_reason(err)
            except BaseException:  # a bug: the other ranks hear of it rather than wait
                self._from_main("rank 0 stopped while committing it (its own output says why)")
                raise
        if failure is not None and self.layout.is_main:  # before the ranks hear of it
            shutil.rmtree(tmp, ignore_errors=True)
        failure = self._from_main(failure)
        if failure is not None:
            self._failed(step, final, failure)
            return
        self.last_failure = None
        seconds, writing = time.perf_counter() - started, time.perf_counter() - write_started
        self.log(
            f"checkpoint: saved step {step} ({gb:.3f} GB in {seconds:.2f} s: "
            f"written at {gb / writing:.3f} GB/s in the background, training held "
            f"{held_seconds:.2f} s for the copy off the device)"
        )

    def _write_chunks(
        self,
        planner_args: tuple,
        extra: dict[str, torch.Tensor],
        host_read: threading.Event,
        tmp: Path,
        step: int,
    ) -> str | None:
        """Every rank writes its chunks and rank 0 DCP's index, once each checked that its file
        system has room: None, or why the file system refused (every rank gets the same
        answer: DCP gathers each rank's error and raises them all on every rank)."""
        import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used
        from torch.distributed.checkpoint.api import CheckpointException

        from execution.checkpoint.dcp_plans import ChunkSavePlanner, item_bytes

        items = planner_args[0]
        if self.layout.is_main:  # a shared file system: rank 0 checks for the whole checkpoint
            needed, what = self.checkpoint_bytes, "the checkpoint"
        else:
            needed = item_bytes(items)
            what = f"rank {self.layout.world.rank}'s share ({megabytes(needed)})"

        def check_room() -> None:
            if (refused := no_room(self.directory, needed, what)) is not None:
                raise refused

        planner = ChunkSavePlanner(*planner_args, host_read.set, check_room)
        writer = planner.writer(tmp)
        # A rank that died or stalled while saving: one line naming the checkpoint's group.
        wrapped, saving = (RuntimeError, CheckpointException), f"saving step {step}"
        try:
            if self.group is None:
                with single_process_quiet():
                    dcp.save(extra, storage_writer=writer, planner=planner, no_dist=True)
            else:
                with communicating("checkpoint", self.ranks, self.timeout_s, wrapped, saving):
                    group = self.group
                    dcp.save(extra, storage_writer=writer, planner=planner, process_group=group)
        except BaseException as err:  # CheckpointException is a BaseException
            reason = failure_reason(err)
            if reason is None:
                raise
            return reason
        return None

    def _gather_files(self, tmp: Path, step: int) -> tuple[dict[str, list[int]], str | None]:
        """Every rank's data files (name -> [size, CRC-32C]) for rank 0's manifest, and why a
        rank could not read its own back (a vanished mount), if one could not."""
        rank = self.layout.world.rank
        mine: dict[str, list[int]] | str | None
        try:
            mine = {p.name: [p.stat().st_size, file_crc(p)] for p in tmp.glob(f"__{rank}_*.distcp")}
        except OSError as err:
            mine = failure_reason(err)
        gathered = [mine]
        if self.group is not None:
            gathered = [None] * len(self.ranks)
            with communicating(
                "checkpoint", self.ranks, self.timeout_s, during=f"saving step {step}"
            ):
                dist.all_gather_object(gathered, mine, group=self.group)
        failure = next((entry for entry in gathered if isinstance(entry, str)), None)
        files = {
            name: entry
            for each in gathered
            if isinstance(each, dict)
            for name, entry in each.items()
        }
        return files, failure

    def _complete(self, tmp: Path, final: Path, trainer: dict, files: dict) -> float:
        """Rank 0: writes the trainer state and the manifest, commits and prunes; the GB saved."""
        manifest = dict(files)
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer, indent=1))
        for name in (".metadata", TRAINER_FILE):
            manifest[name] = [(tmp / name).stat().st_size, file_crc(tmp / name)]
        write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        fsync(tmp)
        self.commit(tmp, final)
        self._prune(trainer["step"])
        return sum(size for size, _ in manifest.values()) / 1e9

    def _from_main(self, failure: str | None) -> str | None:
        """Rank 0's word on the save (None: committed), which every rank takes."""
        if self.group is None:
            return failure
        said = [failure]
        with communicating("checkpoint", self.ranks, self.timeout_s, during="committing a save"):
            dist.broadcast_object_list(said, src=0, group=self.group)
        return said[0]

    def _failed(self, step: int, final: Path, reason: str) -> None:
        """Every rank counts the save as failed; rank 0 says so in one line."""
        self.failed_saves += 1
        self.last_failure = f"step {step}: {reason}"
        if not self.layout.is_main:
            return
        free = free_bytes(self.directory)
        room = f"{megabytes(free)} free on its file system, " if free is not None else ""
        newest = (
            f"the newest intact checkpoint is still {self.newest} (latest)"
            if self.newest
            else "no checkpoint of this run is complete yet"
        )
        self.log(
            f"checkpoint: step {step} was not saved to {final}: {reason} ({room}a checkpoint "
            f"needs {megabytes(self.checkpoint_bytes)}); {newest}"
        )

    def commit(self, tmp: Path, final: Path) -> None:
        """Renames the written ``step_N.tmp`` into place and points ``latest`` at it: until
        then a reader finds the last complete checkpoint (tests/rank_faults.py holds the
        commit back to kill a run in the middle of a save). A rename or write that fails puts
        the folder back as it was, but for ``step_N.tmp``, which the caller removes."""
        old = final.with_name(final.name + ".old") if final.exists() else None
        if old is not None:  # the same step saved again: replace it
            final.rename(old)
        try:
            tmp.rename(final)
            try:
                fsync(self.directory)
                write_atomic(self.directory / LATEST_FILE, final.name + "\n")
            except BaseException:
                final.rename(tmp)
                raise
        except BaseException:
            if old is not None:
                old.rename(final)
            raise
        self.newest = final.name
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        # ``latest`` names a complete checkpoint either way: a failure here (power lost before
        # the folder's entry is on disk) can only leave it naming the previous one.
        with contextlib.suppress(OSError):
            fsync(self.directory)

    def _prune(self, saved: int) -> None:
        """Keeps the newest ``keep`` checkpoints of the run's history, ``saved`` the newest.

        Checkpoints of later steps are from steps the run abandoned when it resumed from an
        earlier checkpoint: they count as older than any of the history, so the checkpoint it
        resumed from is kept before them."""
        if not self.keep:
            return
        folders = step_folders(self.directory)
        abandoned = [folder for step, folder in folders if step > saved]
        history = [folder for step, folder in folders if step <= saved]
        for folder in [*abandoned, *history][: -self.keep]:
            shutil.rmtree(folder, ignore_errors=True)

"""Saving checkpoints of logical tensors through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the *unsharded, unpadded* float32 weights and both AdamW moments of every
parameter, named as in :class:`modelling.gpt.GPT` (``weights/layers.3.attn.qkv.weight``), plus
the trainer's position. So any (data_parallel, tensor_parallel_1, tensor_parallel_2), placement
or precision can resume any checkpoint: loading slices the logical tensors for the new layout.

The folder's files are described in :mod:`execution.checkpoint.files`.

Saving (no tensor data crosses ranks): every rank writes exactly the chunks of logical tensors
its own buffers hold (:mod:`execution.checkpoint.chunks`), each byte of the model once, through
``dcp.save`` with the planner of :mod:`execution.checkpoint.dcp_plans`; only DCP's plans and
metadata travel between ranks, over a gloo group of the checkpointer's own. State held on the
compute device is copied off first (in bounded pinned pieces on a GPU): that copy is all the
training loop waits for at the save. State held in host memory is written from the buffers
themselves, in a background thread, one chunk (at most ``MAX_CHUNK_BYTES``) copied at a time;
the next step runs meanwhile and waits, before its optimizer update changes those buffers,
only until the last chunk has been copied out. When every rank has written, rank 0 writes
``trainer.json`` and ``manifest.json`` and renames ``step_N.tmp`` to ``step_N``, then updates
``latest`` with an atomic ``os.replace``: a process killed at any moment leaves the previous
checkpoint loadable. A write the file system refuses (a full disk) fails that save only, on every
rank, and the run goes on (:mod:`execution.checkpoint.commit`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from config.loading import ConfigError, config_to_dict
from config.schema import PretrainingConfig
from execution.checkpoint.chunks import MAX_CHUNK_BYTES
from execution.checkpoint.commit import SaveFolder
from execution.checkpoint.disk import checkpoint_bytes, room_warning
from execution.checkpoint.files import (
    FORMAT,
    MASKS,
    SAVED_STATES,
)
from execution.checkpoint.ownership import (
    SAVE_FLAG,
    check_run_folder,
    claim_folder,
    new_run_id,
    record_owner,
)
from execution.engine.engine import PhasedEngine, StepHooks
from execution.engine.storage.masks import SPARSE_KIND, SPARSE_PART
from execution.parallel.mesh import MeshShape


class Checkpointer:
    """Writes checkpoints of one engine into a ``--save`` folder, in the background.

    Args:
        directory: The save folder.
        engine: This rank's engine (its layout and buffers are used).
        config: The run's config (written into every checkpoint, so a resume can check it).
        keep: Keep only the newest ``keep`` checkpoints (0 keeps all).
        log: Where rank 0's messages go.
        max_chunk_bytes: Chunks are written (and later read) at most this many bytes at a time.
        run_id: The run the folder belongs to (ownership module); a new one if None.
        job: The launch's job id (execution.parallel.launch), saved with each checkpoint so
            that a restart of the job finds its own newest (execution.training.restart).
        output_dir: The run's output folder, saved for the same restart to log into.

    Attributes:
        held_seconds: How long the last save held the training loop (the copy off the device).
        fence_seconds: How long optimizer updates have waited for host chunks to be copied out.
        saves: How many saves were started.
        folder: The saves' writes and their outcomes: how many failed, why the last one did,
            the newest complete checkpoint (:class:`~execution.checkpoint.commit.SaveFolder`).
    """

    def __init__(
        self,
        directory: str | Path,
        engine: PhasedEngine,
        config: PretrainingConfig,
        keep: int = 0,
        log: Callable[[str], None] = print,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        run_id: str | None = None,
        job: str | None = None,
        output_dir: Path | None = None,
    ):
        self.directory = Path(directory)
        self.run_id = run_id or new_run_id()
        self.job, self.output_dir = job, output_dir
        self.engine = engine
        self.config = config
        self.layout = engine.layout
        self.keep = keep
        self.log = log if self.layout.is_main else (lambda _: None)
        self.max_chunk_bytes = max_chunk_bytes
        self.held_seconds = self.fence_seconds = 0.0
        self.saves = 0
        self._items = None  # this rank's chunks: the same at every save
        self._host_read: threading.Event | None = None  # set once host chunks are copied out
        self._bounce: list[torch.Tensor] | None = None  # pinned, for copies off a GPU
        self._copy_stream = None
        # The background writes talk over their own gloo group, never the training's groups.
        distributed = dist.is_available() and dist.is_initialized()
        self.timeout_s = config.execution.collective_timeout
        timeout = datetime.timedelta(seconds=self.timeout_s)  # not inherited by new groups
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: concurrent.futures.Future | None = None
        self._claim = None
        if self.layout.is_main:  # the folder is this process's while it saves (ownership)
            check_run_folder(self.directory, self.run_id, SAVE_FLAG)
            self._claim = claim_folder(self.directory, self.run_id, SAVE_FLAG)
            try:
                record_owner(self.directory, self.run_id, job)
            except OSError as err:
                self._claim.release(undo=True)
                raise ConfigError(
                    f"cannot create --save {self.directory}: {err.strerror}"
                ) from None
            # A killed run's unfinished writes, removed now. (At a save instead, this rank
            # could remove a folder another rank's write had already begun.)
            for stale in self.directory.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        if self.group is not None:  # no rank begins a write before they are gone
            dist.barrier(group=self.group)
        size = checkpoint_bytes(engine)
        self.folder = SaveFolder(
            self.directory, self.layout, self.group, self.timeout_s, keep, self.log, size
        )

    def check_room(self, saves: int) -> None:
        """Rank 0 warns in one line if the folder's file system cannot hold the checkpoints the
        run will have at once (``saves``: how many it makes)."""
        if self.layout.is_main:
            size = self.folder.checkpoint_bytes
            warning = room_warning(self.directory, size, self.keep, saves)
            if warning:
                self.log(warning)

    def save(self, step: int, loader_state: dict | None) -> None:
        """Starts saving the state after ``step`` steps; returns once device state is copied off.

        Collective: every rank calls it. Waits for the previous save first.

        Args:
            step: Steps completed (the resumed run starts at this step index).
            loader_state: The data loader's ``state_dict()`` (None in tests without a loader).
        """
        # imports DCP: only when used
        from execution.checkpoint.dcp_plans import HeldItem, held_items, logical_sizes

        self.wait()
        self.engine.finish_update()  # the host update of the step saved, if it runs behind
        self.saves += 1
        started = time.perf_counter()
        final = self.directory / f"step_{step}"
        self.log(f"checkpoint: saving step {step} to {final}")
        if self._items is None:
            self._items = held_items(self.engine, self.max_chunk_bytes, saving=True)
        rows = self._stage()
        self.held_seconds = time.perf_counter() - started
        self._host_read = host_read = threading.Event()
        if not self.engine.state.places["weights"].remote:
            host_read.set()  # written from copies: the buffers may change at once
        trainer = self._trainer_state(step, loader_state)

        def row_of(item: HeldItem) -> torch.Tensor:
            return rows[item.state, item.part, item.chunk.kind][item.row]

        planner_args = (self._items, logical_sizes(self.engine), row_of)
        extra, held = self._extra_state(), self.held_seconds
        self._pending = self._executor.submit(
            self.folder.write, planner_args, extra, host_read, final, trainer, started, held
        )

    def _stage(self) -> dict[tuple[str, str, str], torch.Tensor]:
        """The ``[rows, shard]`` tensor each saved (state, part, kind) is written from.

        Host-placed buffers are written from as they are (the optimizer waits for the write,
        see :meth:`wait_for_host_reads`); buffers on the compute device are copied off now,
        since the training loop updates them in place and a GPU's memory is not the writer's.
        """
        place = self.engine.state.places["weights"]
        rows = {}
        for part, buffers in self.engine.state.parts.items():
            for state in SAVED_STATES:
                for kind, t in getattr(buffers, state).items():
                    rows[state, part, kind] = t if place.remote else self._copy_off(t)
        masks = self.engine.state.masks
        if masks is not None:  # saved as float32 0/1: a copy, free to change at once
            rows[MASKS, SPARSE_PART, SPARSE_KIND] = masks.rows.to("cpu", torch.float32)
        return rows

    def _copy_off(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device buffer, through two pinned bounce buffers on a GPU."""
        out = torch.empty(t.shape, dtype=t.dtype)
        if t.device.type != "cuda":
            return out.copy_(t)
        if self._bounce is None:
            n = max(1, min(self.max_chunk_bytes, 64 << 20) // 4)
            self._bounce = [torch.empty(n, pin_memory=True) for _ in range(2)]
            self._copy_stream = torch.cuda.Stream(device=t.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        source, target, n = t.view(-1), out.view(-1), self._bounce[0].numel()
        in_flight: list[tuple | None] = [None, None]  # per bounce buffer: (event, start, end)

        def drain(slot: int) -> None:
            if in_flight[slot] is not None:
                event, a, b = in_flight[slot]
                event.synchronize()
                target[a:b].copy_(self._bounce[slot][: b - a])

        for k, a in enumerate(range(0, source.numel(), n)):
            slot, b = k % 2, min(a + n, source.numel())
            drain(slot)
            with torch.cuda.stream(self._copy_stream):
                self._bounce[slot][: b - a].copy_(source[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            in_flight[slot] = (event, a, b)
        for slot in (len(in_flight) - 1, 0):
            drain(slot)
        return out

    @property
    def hooks(self) -> StepHooks:
        """What a training step runs for this checkpointer: optimizer updates change the host
        buffers a save in flight is reading, so each waits for those reads first."""
        return StepHooks(before_update=[self.wait_for_host_reads])

    def wait_for_host_reads(self) -> None:
        """Before an optimizer update: the save in flight has copied out every host chunk."""
        if self._host_read is not None:
            waited = time.perf_counter()
            self._host_read.wait()
            self.fence_seconds += time.perf_counter() - waited
            self._host_read = None

    def _extra_state(self) -> dict[str, torch.Tensor]:
        """What is saved beside the chunks: rank 0's random number generator states."""
        if not self.layout.is_main:
            return {}
        state = {"rng/cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.layout.device.type == "cuda":
            state["rng/cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return state

    def _trainer_state(self, step: int, loader_state: dict | None) -> dict[str, Any]:
        config = self.config
        ex = config.execution
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "job": self.job,
            "output_dir": str(self.output_dir) if self.output_dir else None,
            "step": step,
            "optimizer_steps": self.engine.optimizer_steps,
            "loss_scaling": config.training.loss_scaling,
            "learning_rate_position": {"step": step, "total_steps": config.training.steps},
            "loader": loader_state,
            "saved_mesh": dataclasses.asdict(MeshShape.of(ex)),
            "saved_placement": f"{self.engine.memory.passes} pass(es), {self.engine.memory.placement.describe()}",
            "config": config_to_dict(config),
        }

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed or has failed (the folder's
        ``last_failure``); re-raises any other error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Waits for the last save and stops the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown()
            if self._claim is not None:
                self._claim.release()

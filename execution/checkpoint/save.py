"""Saving checkpoints of logical tensors through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the *unsharded, unpadded* float32 weights and both AdamW moments of every
parameter, named as in :class:`modelling.gpt.GPT` (``weights/layers.3.attn.qkv.weight``), plus
the trainer's position. So any (data_parallel, tensor_parallel_1, tensor_parallel_2), placement
or precision can resume any checkpoint: loading slices the logical tensors for the new layout.

The folder's files are described in :mod:`execution.checkpoint.files`.

Saving: the model's (part, row, state) items are dealt round-robin to ranks; every rank takes
part in each collective :func:`~execution.checkpoint.logical.read_part_state` (the copy off
the device, which is all that holds the training loop), keeps the items it owns and writes them with ``dcp.save`` in a
background thread, over a process group of its own. When every rank has written, rank 0
writes ``trainer.json`` and ``manifest.json`` and renames ``step_N.tmp`` to ``step_N``, then
updates ``latest`` with an atomic ``os.replace``: a process killed at any moment leaves the
previous checkpoint loadable.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from config.loading import ConfigError, config_to_dict
from execution.checkpoint.files import (
    FORMAT,
    LATEST_FILE,
    MANIFEST_FILE,
    SAVED_STATES,
    TRAINER_FILE,
    CheckpointError,
    file_crc,
    fsync,
    single_process_quiet,
    step_folders,
    write_atomic,
)
from execution.checkpoint.logical import read_part_state, tensor_key
from execution.engine.phases import PhasedEngine


class Checkpointer:
    """Writes checkpoints of one engine into a ``--save`` folder, in the background.

    Args:
        directory: The save folder.
        engine: This rank's engine (its config and layout are used).
        keep: Keep only the newest ``keep`` checkpoints (0 keeps all).
        log: Where rank 0's messages go.
        commit_delay: Test hook: seconds to wait after writing, before the commit.
    """

    def __init__(
        self,
        directory: str | Path,
        engine: PhasedEngine,
        keep: int = 0,
        log: Callable[[str], None] = print,
        commit_delay: float = 0.0,
    ):
        self.directory = Path(directory)
        self.engine = engine
        self.layout = engine.layout
        self.keep = keep
        self.log = log if self.layout.is_main else (lambda _: None)
        self.commit_delay = commit_delay
        # The background writes talk over their own gloo group, never the training's groups.
        distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: concurrent.futures.Future | None = None
        if self.layout.is_main:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(
                    f"cannot create --save {self.directory}: {err.strerror}"
                ) from None

    def save(self, step: int, loader_state: dict | None) -> None:
        """Starts saving the state after ``step`` steps; returns once it is off the device.

        Collective: every rank calls it. Waits for the previous save first.

        Args:
            step: Steps completed (the resumed run starts at this step index).
            loader_state: The data loader's ``state_dict()`` (None in tests without a loader).
        """
        self.wait()
        started = time.perf_counter()
        final = self.directory / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        self.log(f"checkpoint: saving step {step} to {final}")
        if self.layout.is_main:
            for stale in self.directory.glob("step_*.tmp"):  # left by a killed run
                shutil.rmtree(stale, ignore_errors=True)
        state = self._stage()
        held = time.perf_counter() - started
        trainer = self._trainer_state(step, loader_state)
        self._pending = self._executor.submit(
            self._write, state, tmp, final, trainer, started, held
        )

    def _stage(self) -> dict[str, torch.Tensor]:
        """This rank's items as CPU float32 tensors (collective: every rank reads every part).

        An item is one state of one part row, so the three states of the large embedding are
        written by three ranks.
        """
        world = self.layout.world
        items = [(p, row, s) for p, row in self.engine.state.part_rows() for s in SAVED_STATES]
        state = {}
        for index, (part, row, s) in enumerate(items):
            tensors = read_part_state(self.engine, part, row, s)
            if index % world.size == world.rank:
                for name, t in tensors.items():
                    state[tensor_key(s, part, row, name)] = t
        if self.layout.is_main:
            state["rng/cpu"] = torch.get_rng_state()
            if torch.cuda.is_available() and self.layout.device.type == "cuda":
                state["rng/cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return state

    def _trainer_state(self, step: int, loader_state: dict | None) -> dict[str, Any]:
        config = self.engine.config
        ex = config.execution
        return {
            "format": FORMAT,
            "step": step,
            "optimizer_steps": self.engine.optimizer_steps,
            "loss_scaling": config.training.loss_scaling,
            "learning_rate_position": {"step": step, "total_steps": config.training.steps},
            "loader": loader_state,
            "saved_layout": [ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2],
            "saved_placement": f"{self.engine.plan.passes} pass(es), {self.engine.plan.placement.describe()}",
            "config": config_to_dict(config),
        }

    def _write(
        self, state, tmp: Path, final: Path, trainer: dict, started: float, held: float
    ) -> None:
        """Background thread: every rank writes its items, then rank 0 commits."""
        import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

        write_started = time.perf_counter()
        rank = self.layout.world.rank
        if self.group is None:
            with single_process_quiet():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.group)
        mine = {p.name: [p.stat().st_size, file_crc(p)] for p in tmp.glob(f"__{rank}_*.distcp")}
        files = [mine]
        if self.group is not None:
            files = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(files, mine, group=self.group)
        if not self.layout.is_main:
            return
        manifest = {name: entry for per_rank in files for name, entry in per_rank.items()}
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer, indent=1))
        for name in (".metadata", TRAINER_FILE):
            manifest[name] = [(tmp / name).stat().st_size, file_crc(tmp / name)]
        write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        fsync(tmp)
        writing = time.perf_counter() - write_started
        if self.commit_delay:
            time.sleep(self.commit_delay)
        if final.exists():  # the same step saved again: replace it
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        write_atomic(self.directory / LATEST_FILE, final.name + "\n")
        fsync(self.directory)
        self._prune(final)
        seconds = time.perf_counter() - started
        gb = sum(size for size, _ in manifest.values()) / 1e9
        self.log(
            f"checkpoint: saved step {trainer['step']} ({gb:.3f} GB in {seconds:.2f} s: "
            f"written at {gb / writing:.3f} GB/s in the background, training held "
            f"{held:.2f} s for the copy off the device)"
        )

    def _prune(self, newest: Path) -> None:
        if not self.keep:
            return
        for _, folder in step_folders(self.directory)[: -self.keep]:
            if folder != newest:
                shutil.rmtree(folder, ignore_errors=True)

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed; re-raises its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except OSError as err:  # a full or read-only disk: the user's to fix, one line
                where = f" {err.filename}" if err.filename else ""
                raise CheckpointError(
                    f"cannot write checkpoint{where} in {self.directory}: {err.strerror or err}"
                ) from None

    def close(self) -> None:
        """Waits for the last save and stops the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown()

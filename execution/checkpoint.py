"""Checkpoints of logical tensors through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the *unsharded, unpadded* float32 weights and both AdamW moments of every
parameter, named as in :class:`modelling.gpt.GPT` (``weights/layers.3.attn.qkv.weight``), plus
the trainer's position. So any (data_parallel, tensor_parallel_1, tensor_parallel_2), placement
or precision can resume any checkpoint: loading slices the logical tensors for the new layout.

Layout of a ``--save`` folder::

    step_6/                 one complete checkpoint
        __0_0.distcp ...    DCP data files, one per rank (each rank writes its own in parallel)
        .metadata           DCP's index of the tensors
        trainer.json        step, optimizer steps, loader position, loss scale, model config
        manifest.json       size and CRC-32C of every file above; written last
    step_9.tmp/             a checkpoint being written (never loaded)
    latest                  "step_6": the newest complete checkpoint

Saving: the model's (part, row, state) items are dealt round-robin to ranks; every rank takes
part in each collective :meth:`PhasedEngine.read_part_state` (the copy off the device, which is all
that holds the training loop), keeps the items it owns and writes them with ``dcp.save`` in a
background thread, over a process group of its own. When every rank has written, rank 0
writes ``trainer.json`` and ``manifest.json`` and renames ``step_N.tmp`` to ``step_N``, then
updates ``latest`` with an atomic ``os.replace``: a process killed at any moment leaves the
previous checkpoint loadable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from config.loading import ConfigError, config_to_dict, one_line
from execution.phases import PhasedEngine
from modelling.gpt import GPT, LAYERS, GPTShapes
from modelling.hf_interchange import HFWeights, hf_name

FORMAT = 1
STATES = ("weights", "exp_avg", "exp_avg_sq")
TRAINER_FILE, MANIFEST_FILE, LATEST_FILE = "trainer.json", "manifest.json", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, damaged or of another model (one line)."""


def tensor_key(state: str, part: str, row: int, name: str) -> str:
    """DCP key of one logical tensor: ``{state}/{name as in GPT}``."""
    prefix = f"{part}.{row}." if part == LAYERS else f"{part}."
    return f"{state}/{prefix}{name}"


def logical_shapes(shapes: GPTShapes) -> dict[str, tuple[int, ...]]:
    """Unpadded shape of every parameter of the model, named as in :class:`GPT`."""
    whole = GPTShapes(shapes.layers, shapes.hidden, shapes.heads, shapes.vocab, shapes.positions,
                      shapes.dropout_prob, shapes.layer_norm_eps)  # fmt: skip
    with torch.device("meta"):
        model = GPT(whole)
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    out["embedding.word.weight"] = (shapes.vocab, shapes.hidden)
    out["embedding.position.weight"] = (shapes.positions, shapes.hidden)
    return out


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it is not distributed; we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = crc32c.crc32c(chunk, crc)
    return crc


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """Complete-looking ``step_N`` folders of a save folder, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


class Checkpointer:
    """Writes checkpoints of one engine into a ``--save`` folder, in the background.

    Args:
        directory: The save folder.
        engine: This rank's engine (its config and layout are used).
        keep: Keep only the newest ``keep`` checkpoints (0 keeps all).
        log: Where rank 0's messages go.
        commit_delay: Test hook: seconds to wait after writing, before the commit.
    """

    def __init__(self, directory: str | Path, engine: PhasedEngine, keep: int = 0,
                 log: Callable[[str], None] = print, commit_delay: float = 0.0):  # fmt: skip
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
        items = [(part, row, s) for part, row in self.engine.part_rows() for s in STATES]
        state = {}
        for index, (part, row, s) in enumerate(items):
            tensors = self.engine.read_part_state(part, row, s)
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

    def _write(self, state, tmp: Path, final: Path, trainer: dict, started: float,
               held: float) -> None:  # fmt: skip
        """Background thread: every rank writes its items, then rank 0 commits."""
        import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

        write_started = time.perf_counter()
        rank = self.layout.world.rank
        if self.group is None:
            with _single_process_quiet():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.group)
        mine = {p.name: [p.stat().st_size, _file_crc(p)] for p in tmp.glob(f"__{rank}_*.distcp")}
        files = [mine]
        if self.group is not None:
            files = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(files, mine, group=self.group)
        if not self.layout.is_main:
            return
        manifest = {name: entry for per_rank in files for name, entry in per_rank.items()}
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer, indent=1))
        for name in (".metadata", TRAINER_FILE):
            manifest[name] = [(tmp / name).stat().st_size, _file_crc(tmp / name)]
        _write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        _fsync(tmp)
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
        _write_atomic(self.directory / LATEST_FILE, final.name + "\n")
        _fsync(self.directory)
        self._prune(final)
        seconds = time.perf_counter() - started
        gb = sum(size for size, _ in manifest.values()) / 1e9
        self.log(f"checkpoint: saved step {trainer['step']} ({gb:.3f} GB in {seconds:.2f} s: "
                 f"written at {gb / writing:.3f} GB/s in the background, training held "
                 f"{held:.2f} s for the copy off the device)")  # fmt: skip

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


# ----------------------------------------------------------------- loading


def resolve(path: str | Path) -> Path:
    """The checkpoint folder that ``--load path`` means: ``path`` itself or its ``latest``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / LATEST_FILE).is_file():
        name = (path / LATEST_FILE).read_text().strip()
        path = path / name
        if not path.is_dir():
            raise CheckpointError(f"{path.parent / LATEST_FILE} names {name}, which is missing")
    if not (path / MANIFEST_FILE).is_file():
        if path.name.endswith(".tmp"):
            raise CheckpointError(f"{path} is a checkpoint that was never completed")
        raise CheckpointError(
            f"{path} holds no checkpoint (no {MANIFEST_FILE}, and no {LATEST_FILE} file naming one)"
        )
    return path


def verify(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Checks every file of the manifest (sizes all, CRCs of this rank's share); None if good."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"checkpoint file {path / MANIFEST_FILE} is damaged: {err}"
    for index, (name, (size, crc)) in enumerate(sorted(manifest.items())):
        file = path / name
        if not file.is_file():
            return f"checkpoint file {file} is missing"
        if file.stat().st_size != size:
            return (f"checkpoint file {file} is damaged: {file.stat().st_size} bytes, "
                    f"{size} were written")  # fmt: skip
        if index % world_size == rank and _file_crc(file) != crc:
            return f"checkpoint file {file} is damaged: its CRC-32C does not match"
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        trainer = json.loads((path / TRAINER_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path / TRAINER_FILE} is damaged: {err}") from None
    if trainer.get("format") != FORMAT:
        raise CheckpointError(f"{path / TRAINER_FILE} has format {trainer.get('format')}, "
                              f"this program reads {FORMAT}")  # fmt: skip
    return trainer


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor in a checkpoint (from DCP's index, no data read)."""
    import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # DCP raises whatever unpickling raised
        raise CheckpointError(
            f"checkpoint file {path / '.metadata'} is damaged: {type(err).__name__}"
        ) from None
    return {key: tuple(m.size) for key, m in metadata.state_dict_metadata.items()
            if hasattr(m, "size")}  # fmt: skip


def check_shapes(path: Path, shapes: GPTShapes, states: tuple[str, ...] = STATES) -> None:
    """Raises a one-line CheckpointError naming the first tensor whose shape differs."""
    stored = stored_shapes(path)
    expected = {
        f"{s}/{name}": shape for s in states for name, shape in logical_shapes(shapes).items()
    }
    for key, shape in expected.items():
        if key not in stored:
            raise CheckpointError(
                f"checkpoint {path} has no tensor {key} of shape {list(shape)}: it holds another "
                f"model (this run has --layers {shapes.layers})"
            )
        if stored[key] != shape:
            raise CheckpointError(
                f"checkpoint {path}: tensor {key} has shape {list(stored[key])} in the checkpoint "
                f"but {list(shape)} in this model; use the model flags of the saved run"
            )
    extra = sorted(k for k in stored if k.split("/")[0] in states and k not in expected)
    if extra:
        raise CheckpointError(
            f"checkpoint {path} holds tensor {extra[0]} of shape {list(stored[extra[0]])}, which "
            f"this model (--layers {shapes.layers}) does not have"
        )


def _dcp_load(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except Exception as err:  # a file that passed its CRC but still fails to read
        raise CheckpointError(
            f"cannot read checkpoint {path}: {one_line(err, limit=300)}"
        ) from None


def load_checkpoint(path: str | Path, engine: PhasedEngine) -> dict[str, Any]:
    """Loads weights, AdamW moments, optimizer step and RNG into ``engine`` (any layout).

    Collective (checks are agreed between ranks). Each rank reads one part row at a time and
    keeps its own shard, so no rank holds the whole model.

    Returns:
        The checkpoint's trainer state (``step``, ``loader``, ...).

    Raises:
        CheckpointError: missing, incomplete or damaged files, or another model shape.
    """
    layout = engine.layout
    problem = None
    try:
        folder = resolve(path)
        problem = verify(folder, layout.world.rank, layout.world.size)
    except CheckpointError as err:
        folder, problem = None, str(err)
    if layout.world.size > 1:  # every rank stops on a problem any rank found
        problems: list[str | None] = [None] * layout.world.size
        dist.all_gather_object(problems, problem, group=layout.world.group)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)
    assert folder is not None
    trainer = read_trainer_state(folder)
    check_shapes(folder, engine.shapes)
    shapes = logical_shapes(engine.shapes)
    for part, row in engine.part_rows():  # one part row in memory at a time
        prefix = tensor_key("", part, row, "").removeprefix("/")
        local = [name.removeprefix(prefix) for name in shapes if name.startswith(prefix)]
        state = {tensor_key(s, part, row, n): torch.empty(shapes[prefix + n])
                 for s in STATES for n in local}  # fmt: skip
        _dcp_load(state, folder)
        for s in STATES:
            full = {n: state[tensor_key(s, part, row, n)] for n in local}
            engine.write_part_state(part, row, s, full)
    engine.optimizer_steps = int(trainer["optimizer_steps"])
    rng = _rng_state(folder)
    if "rng/cpu" in rng:
        torch.set_rng_state(rng["rng/cpu"])
    if "rng/cuda" in rng and layout.device.type == "cuda":
        torch.cuda.set_rng_state(rng["rng/cuda"], layout.device)
    trainer["folder"] = str(folder)
    return trainer


def _rng_state(folder: Path) -> dict[str, torch.Tensor]:
    stored = stored_shapes(folder)
    state = {k: torch.empty(shape, dtype=torch.uint8) for k, shape in stored.items()
             if k.startswith("rng/")}  # fmt: skip
    if state:
        _dcp_load(state, folder)
    return state


def read_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The saved run's config and every logical weight, in one process (generation, export).

    Returns:
        (the saved run's ``model`` config section as a dict, weights named as in :class:`GPT`).
    """
    folder = resolve(path)
    problem = verify(folder)
    if problem:
        raise CheckpointError(problem)
    trainer = read_trainer_state(folder)
    stored = stored_shapes(folder)
    state = {k: torch.empty(shape) for k, shape in stored.items() if k.startswith("weights/")}
    _dcp_load(state, folder)
    return trainer["config"]["model"], {k.removeprefix("weights/"): t for k, t in state.items()}


def load_hf_weights(folder: str | Path, engine: PhasedEngine) -> None:
    """Starts ``engine`` from a local HuggingFace GPT-2 folder (weights; moments stay zero).

    Not collective: every rank reads each tensor and keeps its shard, one part row at a time.

    Raises:
        ConfigError: unreadable files, or a model shape that differs from the run's flags.
    """
    hf = HFWeights(folder)
    hf.check_shape(engine.config.model)
    shapes = logical_shapes(engine.shapes)
    for part, row in engine.part_rows():
        prefix = tensor_key("", part, row, "").removeprefix("/")
        full = {}
        for name in (n for n in shapes if n.startswith(prefix)):
            t = hf.get(name)
            if tuple(t.shape) != shapes[name]:
                raise ConfigError(
                    f"--hf_model {folder}: tensor {hf_name(name)[0]} gives {name} the shape "
                    f"{list(t.shape)}, this model needs {list(shapes[name])}"
                )
            full[name.removeprefix(prefix)] = t
        engine.write_part_state(part, row, "weights", full)

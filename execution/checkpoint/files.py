"""The files of a checkpoint folder: finding, verifying, committing and reading their metadata.

Layout of a ``--save`` folder::

    step_6/                 one complete checkpoint
        __0_0.distcp ...    DCP data files, one per rank (each rank writes its own in parallel)
        .metadata           DCP's index of the tensors
        trainer.json        step, optimizer steps, loader position, loss scale, model config
        manifest.json       size and CRC-32C of every file above; written last
    step_9.tmp/             a checkpoint being written (never loaded)
    latest                  "step_6": the newest complete checkpoint
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from config.loading import ConfigError, one_line
from execution.engine.storage.buffers import WEIGHT_STATES
from modelling.gpt import LAYERS, GPTShapes, logical_shapes, qualified_name
from modelling.sparsity import sparse_weights
from utils.checksum import crc32c

FORMAT = 1
# What a checkpoint holds of each parameter: the weights and both AdamW moments.
SAVED_STATES = WEIGHT_STATES
# RigL's masks, saved by a sparse run as float32 0/1 chunks of the sparse matrices (the chunk
# machinery writes float32 only; 4 bytes per sparse weight, a quarter of its AdamW state).
MASKS = "masks"
TRAINER_FILE, MANIFEST_FILE, LATEST_FILE = "trainer.json", "manifest.json", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, damaged or of another model (one line)."""


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it is not distributed; we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` at once: a reader finds the old text or the new one. A
    write that fails (a full disk) leaves ``path`` as it was, and no ``.tmp`` beside it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # 4 MiB: a load's extra memory stays small
            crc = crc32c(chunk, crc)
    return crc


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """Complete-looking ``step_N`` folders of a save folder, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def resolve(path: str | Path) -> Path:
    """The checkpoint folder that ``--load path`` means: ``path`` itself or its ``latest``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    # A checkpoint is itself, whatever else is in its folder: a `latest` there is a stray
    # file (it would make the manifest check refuse it), never a pointer to follow.
    if (path / LATEST_FILE).is_file() and not (path / MANIFEST_FILE).is_file():
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


def newest_intact(path: str | Path, problem: Callable[[Path], str | None]) -> str:
    """Where to go on from when the checkpoint ``--load path`` means is damaged or missing:
    "; the newest intact checkpoint is step_N: --load DIR/step_N", or "" if there is none.

    Only checkpoints before the damaged one count (a later one belongs to steps a run resumed
    from an earlier checkpoint abandoned); ``problem`` checks one (collective if the load is).
    """
    path = Path(path)
    if _STEP_DIR.match(path.name) or (path / MANIFEST_FILE).is_file():
        save, damaged = path.parent, path.name
    else:
        try:
            save, damaged = path, (path / LATEST_FILE).read_text().strip()
        except OSError:
            save, damaged = path, ""
    named = _STEP_DIR.match(damaged)
    before = int(named.group(1)) if named else None
    for step, folder in reversed(step_folders(save)):
        if (before is None or step < before) and problem(folder) is None:
            return f"; the newest intact checkpoint is {folder.name}: --load {folder}"
    return ""


def verify(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Checks every file of the manifest (sizes all, CRCs of this rank's share); None if good."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"checkpoint file {path / MANIFEST_FILE} is damaged: {err}"
    problem = _manifest_problem(path, manifest)
    if problem:
        return f"checkpoint file {path / MANIFEST_FILE} is damaged: {problem}"
    for index, (name, (size, crc)) in enumerate(sorted(manifest.items())):
        file = path / name
        if not file.is_file():
            return f"checkpoint file {file} is missing"
        if file.stat().st_size != size:
            return (
                f"checkpoint file {file} is damaged: {file.stat().st_size} bytes, "
                f"{size} were written"
            )
        if index % world_size == rank and file_crc(file) != crc:
            return f"checkpoint file {file} is damaged: its CRC-32C does not match"
    return None


def _manifest_problem(path: Path, manifest: Any) -> str | None:
    """What makes a manifest unusable, or None: it must map each file of the folder but itself
    (the trainer state and DCP's index at least) to ``[size, CRC-32C]``. A manifest that lists
    fewer files would let a damaged or missing one pass unchecked."""
    if not isinstance(manifest, dict):
        return f"it holds a {type(manifest).__name__}, not a map of file -> [size, CRC-32C]"
    for name, entry in manifest.items():
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in entry)
        ):
            return f"its entry for {name!r} is {entry!r}, not [size, CRC-32C]"
    on_disk = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE}
    unlisted = sorted((on_disk | {TRAINER_FILE, ".metadata"}) - manifest.keys())
    if unlisted:
        return f"it does not list {', '.join(unlisted[:3])}" + (" ..." if unlisted[3:] else "")
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        trainer = json.loads((path / TRAINER_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path / TRAINER_FILE} is damaged: {err}") from None
    if trainer.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / TRAINER_FILE} has format {trainer.get('format')}, this program reads {FORMAT}"
        )
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
    return {
        key: tuple(m.size) for key, m in metadata.state_dict_metadata.items() if hasattr(m, "size")
    }


def check_shapes(path: Path, shapes: GPTShapes, states: tuple[str, ...] = SAVED_STATES) -> None:
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


def sparse_names(shapes: GPTShapes) -> list[str]:
    """The checkpoint names of every sparse matrix (``layers.3.attn.qkv.weight``)."""
    return [
        qualified_name(LAYERS, layer, name)
        for layer in range(shapes.layers)
        for name in sparse_weights(shapes)
    ]


def dcp_load(state: dict[str, torch.Tensor], path: Path, reader=None) -> None:
    """Fills ``state`` (whole logical tensors, or DCP's own sharded types) from ``path``."""
    import torch.distributed.checkpoint as dcp  # 1.4 s to import: only when used

    try:
        with single_process_quiet():
            reader = reader or dcp.FileSystemReader(path)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as err:  # a file that passed its CRC but still fails to read
        raise CheckpointError(
            f"cannot read checkpoint {path}: {one_line(err, limit=300)}"
        ) from None

"""Which run a ``--save`` or ``--output_dir`` folder belongs to, so one run never overwrites
another's files.

A run has an id: a new one when it starts from scratch, the loaded checkpoint's when it
resumes (``--load``), so a resumed run is the same run. The id is written to ``run.json`` in
each folder the run writes to, and to every checkpoint's ``trainer.json``. A new run given a
folder that holds another run's checkpoints or metrics stops before writing anything: saving
there would replace that run's ``step_N`` and move its ``latest`` back, and pruning with
``--keep_checkpoints`` would delete its checkpoints by step number. A folder without
``run.json`` (and a checkpoint whose ``trainer.json`` names no run) belongs to the run that
resumes from a checkpoint inside it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from config.loading import ConfigError
from execution.checkpoint.files import LATEST_FILE, step_folders, write_atomic

RUN_FILE = "run.json"


def new_run_id() -> str:
    return uuid.uuid4().hex


def checkpoint_run_id(folder: Path, trainer: dict[str, Any]) -> str:
    """The id of the run that saved the checkpoint ``folder`` (its ``trainer.json``): a
    checkpoint that names no run belongs to the run of the save folder it lies in."""
    return trainer.get("run_id") or _legacy_id(folder.parent)


def _legacy_id(directory: Path) -> str:
    return f"folder:{directory.resolve()}"


def _claimed_by(directory: Path) -> str | None:
    file = directory / RUN_FILE
    if not file.is_file():
        return None
    try:
        run_id = json.loads(file.read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{file} is damaged ({type(err).__name__}): it should name the run that owns "
            f"{directory}; give a new folder"
        ) from None
    return str(run_id)


def check_save_folder(directory: Path, run_id: str) -> None:
    """Raises a one-line ConfigError if ``directory`` holds another run's checkpoints."""
    owner = _claimed_by(directory)
    steps = step_folders(directory)
    if owner is None and (steps or (directory / LATEST_FILE).exists()):
        owner = _legacy_id(directory)
    if owner is None or owner == run_id:
        return
    newest = f" (up to {steps[-1][1].name})" if steps else ""
    raise ConfigError(
        f"--save {directory} holds the checkpoints of another run{newest}; a checkpoint folder "
        f"belongs to one run: give a new --save folder, or resume that run with --load {directory}"
    )


def check_output_folder(directory: Path, run_id: str) -> None:
    """Raises a one-line ConfigError if ``directory`` holds another run's metrics (a resumed
    run appends to its own)."""
    if (directory / "metrics.jsonl").exists() and _claimed_by(directory) != run_id:
        raise ConfigError(
            f"{directory} already holds the metrics.jsonl of another run; choose a new "
            "--output_dir (or leave it out for a fresh folder under runs/)"
        )


def claim(directory: Path, run_id: str) -> None:
    """Marks ``directory`` (created if missing) as ``run_id``'s."""
    directory.mkdir(parents=True, exist_ok=True)
    if _claimed_by(directory) != run_id:
        write_atomic(directory / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")

"""The suite's one way to write an engine's state as a checkpoint, and to export one to a
HuggingFace folder, for the tests that read them back."""

from __future__ import annotations

from pathlib import Path

import convert_checkpoint
from config.schema import PretrainingConfig
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import PhasedEngine


def save_checkpoint(folder: Path, engine: PhasedEngine, config: PretrainingConfig, step: int):
    """Saves ``engine`` as the checkpoint after ``step`` steps into ``folder``, quietly, and
    waits until it is complete."""
    checkpointer = Checkpointer(folder, engine, config, log=lambda _: None)
    checkpointer.save(step, None)
    checkpointer.close()


def export_hf(checkpoint: Path, output: Path) -> None:
    """``convert_checkpoint.py --load checkpoint --hf_output output``."""
    convert_checkpoint.main(["--load", str(checkpoint), "--hf_output", str(output)])

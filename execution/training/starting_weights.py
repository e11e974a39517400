"""Whether ``--load`` or ``--hf_model`` fits the run, checked from their small files (the
checkpoint's ``trainer.json`` and tensor index, the HuggingFace ``config.json``) before the
run reads its data, plans its memory or draws its initial weights.

The loaders check shapes once the engine exists, and building it draws every initial weight:
7 to 10 s at the ``gpt3_125M`` and ``test`` sizes on two idle CPU cores, growing with the model
and the machine's load. The loaders keep their checks; these find the same mismatches first,
and name the flag to change. They also find what no shape shows: a model flag that reads the
same tensors as another model (``--heads``, ``--rope_theta``: config/model_math.py classifies
every model flag), and, for a resumed run, a data position in other batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from config.model_math import refuse_other_model
from config.schema import PretrainingConfig
from execution.checkpoint.files import (
    SAVED_STATES,
    CheckpointError,
    check_shapes,
    read_trainer_state,
    resolve,
)
from execution.checkpoint.load import hf_model_mistakes
from execution.training.finetuning import saved_task
from modelling.hf_interchange import open_hf_weights
from tasks.specs import run_shapes, task_spec

# What a resumed run's data position is a position in, as the loader's saved state records
# it (data/loader.py, data/finetuning_data.py): another value gives other batches, which the
# loader would refuse once the engine is built.
DATA_POSITION_FLAGS = {
    "sequence_length": "model",
    "global_batch_size": "training",
    "seed": "training",
}
# What a resumed fine-tuning run's rows are cut by, besides the task files: another value
# gives other rows, which its data position does not point into. Where each flag's value
# comes from when it is not given (config/finetuning.py).
ROW_FLAGS = {
    ("model", "sequence_length"): "the task's usual length, capped by --max_positional_length",
    ("finetuning", "doc_stride"): "a third of --sequence_length",
}


def check_starting_weights(config: PretrainingConfig) -> None:
    """Raises a one-line ConfigError when ``--load`` or ``--hf_model`` cannot start the run
    ``config`` describes (a pretraining or a fine-tuning run)."""
    c = config.checkpoint
    if c.load:
        _check_checkpoint(config, c.load)
    elif c.hf_model and Path(c.hf_model).is_dir():  # not a folder: said by the run's assembly
        with hf_model_mistakes():
            open_hf_weights(c.hf_model).check_shape(run_shapes(config))


def _check_checkpoint(config: PretrainingConfig, path: str) -> None:
    folder = resolve(path)
    trainer = read_trainer_state(folder)
    saved: dict[str, Any] = trainer.get("config", {})
    tuned_for = saved_task(trainer)
    if tuned_for and not config.task:
        raise CheckpointError(
            f"--load {path} is a checkpoint of a fine-tuning run (--task {tuned_for}): its "
            f"{tuned_for} head replaced the language model's, so pretraining cannot go on from "
            f"it; continue it with run_finetuning.py --task {tuned_for} --load {path}, or give a "
            "pretraining checkpoint"
        )
    if tuned_for and tuned_for != config.task:
        return  # another task's: refused by the fine-tuning run before its set-up
    refuse_other_model(f"--load {path}", saved.get("model", {}), config.model, CheckpointError)
    # a fine-tuning run from a pretraining checkpoint takes its weights only
    resumes = bool(tuned_for) or not config.task
    if resumes and not config.checkpoint.eval_only:
        _check_data_position(path, trainer.get("loader") or {}, config)
    if tuned_for and not config.checkpoint.eval_only:
        _check_rows(path, saved, config)
    shapes = run_shapes(config)
    if not resumes:
        shapes = dataclasses.replace(shapes, task_head=None)
    check_shapes(folder, shapes, SAVED_STATES if resumes else ("weights",))


def _check_data_position(path: str, loader: dict[str, Any], config: PretrainingConfig) -> None:
    """A resumed run goes on from the saved data position, which counts batches of the saved
    shape (the weights themselves take any sequence length: docs/checkpoints.md)."""
    for name, section in DATA_POSITION_FLAGS.items():
        theirs, ours = loader.get(name), getattr(getattr(config, section), name)
        if theirs is not None and theirs != ours:
            raise CheckpointError(
                f"--load {path} resumes a run whose data position is a place in the batches of "
                f"--{name} {theirs}; this run has --{name} {ours}, whose batches differ: pass "
                f"--{name} {theirs} (the weights alone, as --eval_only or a fine-tuning run "
                "takes them, do not need it)"
            )


def _check_rows(path: str, saved: dict[str, Any], config: PretrainingConfig) -> None:
    for (section, name), default in ROW_FLAGS.items():
        if section == "finetuning" and name not in task_spec(config.task).own_flags:
            continue  # a flag the task does not read cuts none of its rows
        theirs = saved.get(section, {}).get(name)
        ours = getattr(getattr(config, section), name)
        if theirs is not None and theirs != ours:
            raise CheckpointError(
                f"--load {path} resumes a run whose rows were cut with --{name} {theirs}; this "
                f"run has --{name} {ours} (unless given: {default}), which cuts other rows: "
                f"pass --{name} {theirs}"
            )

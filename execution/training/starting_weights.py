"""Whether ``--load`` or ``--hf_model`` fits the run, checked from their small files (the
checkpoint's ``trainer.json`` and tensor index, the HuggingFace ``config.json``) before the
run reads its data, plans its memory or draws its initial weights.

The loaders check shapes once the engine exists, and building it draws every initial weight:
7 to 10 s at the ``gpt3_125M`` and ``test`` sizes on two idle CPU cores, growing with the model
and the machine's load. The loaders keep their checks; these find the same mismatches first,
and name the flag to change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

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

# The model flags that give the tensors their shapes.
SHAPE_FLAGS = ("layers", "hidden_size", "vocab_size", "max_positional_length")
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
    _check_flags(path, saved.get("model", {}), config)
    # a fine-tuning run from a pretraining checkpoint takes its weights only
    resumes = bool(tuned_for) or not config.task
    if tuned_for and not config.checkpoint.eval_only:
        _check_rows(path, saved, config)
    shapes = run_shapes(config)
    if not resumes:
        shapes = dataclasses.replace(shapes, task_head=None)
    check_shapes(folder, shapes, SAVED_STATES if resumes else ("weights",))


def _check_flags(path: str, saved_model: dict[str, Any], config: PretrainingConfig) -> None:
    for name in SHAPE_FLAGS:
        theirs, ours = saved_model.get(name), getattr(config.model, name)
        if theirs is not None and theirs != ours:
            raise CheckpointError(
                f"--load {path} was saved by a model of --{name} {theirs}, this run has --{name} "
                f"{ours}: pass --{name} {theirs} (a checkpoint's tensors have the sizes of the "
                "model that saved them)"
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

"""A fine-tuning run: the task's data, what ``--load`` takes, and evaluation on the task.

It is assembled and trained as a pretraining run is (:func:`~execution.training.build.assemble`,
:func:`~execution.training.loop.train`), with the inputs of a task:

- the rows of the task's training file (:mod:`data.finetuning_data`), read and checked before
  anything else, and each evaluation file's rows, windows and examples;
- ``--load`` of a pretraining checkpoint takes its weights only (a fresh optimizer, step 0,
  the task's data from its start); ``--load`` of this task's own fine-tuning checkpoint
  resumes it exactly (moments, step, RNG, data position); another task's is refused;
- ``--hf_model`` takes a HuggingFace GPT-2's weights; with neither, the run starts from a
  fresh initialisation and says so once;
- evaluation scores every evaluation file at the end (and every ``--eval_every`` steps) and
  writes the predictions and ``eval.json`` (:mod:`execution.training.task_eval`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from config.finetuning import FinetuningRunConfig
from config.loading import ConfigError
from data.errors import DataError
from data.finetuning_data import TaskDataLoader, TaskSet
from data.tokenizer import TokenizerSpec, load_tokenizer
from execution.checkpoint.files import read_trainer_state
from execution.checkpoint.files import resolve as resolve_checkpoint
from execution.checkpoint.load import load_checkpoint, load_hf_weights, load_pretrained_weights
from execution.engine.engine import PhasedEngine
from execution.parallel.launch import LaunchInfo
from execution.parallel.mesh import ParallelLayout
from execution.training.build import Run, RunInputs, assemble
from execution.training.restart import Restart
from execution.training.task_eval import evaluate_task
from tasks.specs import evaluation_files, task_spec, training_files


def saved_task(trainer: dict) -> str:
    """The task a checkpoint was fine-tuned for ("" for a pretraining checkpoint)."""
    return trainer["config"].get("finetuning", {}).get("task", "")


def task_tokenizer(path: str, eot_token: str, vocab_size: int) -> Tokenizer:
    """The tokenizer of the task's text: the model's own tokenizer.json (``path``), else
    GPT-2's BPE (shipped in a package); one line when it cannot be used."""
    try:
        tokenizer, _, vocab = load_tokenizer(TokenizerSpec(path or None, eot_token))
    except FileNotFoundError as err:
        flag = "--tokenizer: " if path else "cannot tokenize the task's text: "
        raise DataError(f"{flag}{err}") from None
    except ValueError as err:
        raise ConfigError(f"--tokenizer: {err}") from None
    if vocab > vocab_size:
        which = path or "GPT-2's"
        raise ConfigError(
            f"--vocab_size {vocab_size} is smaller than {which} tokenizer's {vocab} tokens; "
            "give the model's own with --tokenizer"
        )
    return tokenizer


def build_finetuning(
    config: FinetuningRunConfig,
    preset: str,
    layout: ParallelLayout,
    launch: LaunchInfo,
    restart: Restart | None = None,
) -> Run:
    """Builds this rank's fine-tuning run; every rank of the job calls it (``restart``: how a
    restarted job goes on, execution.training.restart).

    Raises:
        ConfigError, DataError: the user's input cannot run (one line each).
    """
    f, model = config.finetuning, config.model
    tokenizer = task_tokenizer(f.tokenizer, f.eot_token, model.vocab_size)

    spec = task_spec(f.task)

    def read(path: str) -> TaskSet:
        return spec.read(path, tokenizer, model.sequence_length, f)

    training = [read(path) for path in training_files(config)]
    evaluation_sets = [read(path) for path in evaluation_files(config)]
    rows = torch.cat([t.rows for t in training])
    ex = config.execution
    loader = TaskDataLoader(
        rows,
        config.training.global_batch_size,
        ex.micro_batch_size,
        layout.dp.rank,
        layout.dp.size,
        config.training.seed,
    )
    shipped = "" if config.data.input_files else "shipped sample "
    examples = sum(len(t.examples) for t in training)
    data = (
        f"{f.task}, {shipped}{', '.join(training_files(config))}: {examples} examples, "
        f"{len(rows)} rows of {model.sequence_length} tokens; evaluating on "
        f"{', '.join(evaluation_files(config)) or 'nothing'}"
    )
    c = config.checkpoint
    if not (c.load or c.hf_model) and layout.is_main:  # once per job
        print(
            f"{config.PROGRAM}: warning: fine-tuning from a fresh initialisation; give --load "
            "CKPT (a pretraining checkpoint) or --hf_model DIR for pretrained weights",
            file=sys.stderr,
            flush=True,
        )
    if c.load:  # a checkpoint of another task is refused before any set-up
        _check_task(c.load, f.task)

    def evaluation(engine: PhasedEngine, output_dir: Path):
        return lambda step: evaluate_task(engine, config, evaluation_sets, output_dir, step)

    inputs = RunInputs(
        loader,
        data,
        evaluation if evaluation_sets else None,
        lambda engine, loader: _restore(config, engine, loader),
        continues=lambda trainer: saved_task(trainer) == f.task,
    )
    return assemble(config, f"{preset}-{f.task}", layout, launch, inputs, restart)


def _check_task(path: str, task: str) -> None:
    folder = resolve_checkpoint(path)
    saved = saved_task(read_trainer_state(folder))
    if saved and saved != task:
        raise ConfigError(
            f"--load {path}: the checkpoint was fine-tuned for {saved}, this run is --task "
            f"{task}; load a pretraining checkpoint (or give --task {saved})"
        )


def _restore(
    config: FinetuningRunConfig, engine: PhasedEngine, loader: TaskDataLoader
) -> tuple[int, str]:
    """Loads ``--load`` or ``--hf_model`` (module docstring).

    Returns:
        (steps already done, a start-up line saying what was loaded, or "").
    """
    c = config.checkpoint
    if c.hf_model:
        load_hf_weights(c.hf_model, engine)
        return 0, f"weights from the HuggingFace model {c.hf_model}\n"
    if not c.load:
        return 0, ""
    if not saved_task(read_trainer_state(resolve_checkpoint(c.load))):
        trainer = load_pretrained_weights(c.load, engine)
        return 0, f"pretrained weights from {trainer['folder']} (step {trainer['step']})\n"
    trainer = load_checkpoint(c.load, engine)
    start = trainer["step"]
    if c.eval_only:
        return start, f"loaded {trainer['folder']} at step {start}\n"
    loader.load_state_dict(trainer["loader"])
    if start >= config.training.steps:
        raise ConfigError(
            f"the checkpoint {trainer['folder']} is at step {start} and --steps is "
            f"{config.training.steps}: nothing to train; raise --steps"
        )
    return start, f"resumed fine-tuning from {trainer['folder']} at step {start}\n"


def evaluate_only(run: Run) -> dict[str, float]:
    """``--eval_only``: the loaded weights' scores on the evaluation files, printed and
    logged (and written, as at the end of training)."""
    try:
        assert run.evaluate is not None, "validate_finetuning requires evaluation files"
        metrics = run.evaluate(run.start_step)
        run.tracker.log({"step": run.start_step, **metrics})
        if run.engine.layout.is_main:
            print(", ".join(f"{k} {v:.2f}" for k, v in metrics.items()), flush=True)
    finally:
        run.close()
    return metrics

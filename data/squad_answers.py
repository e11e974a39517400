"""SQuAD predictions from span logits, and their score with the official v1.1 metric.

Post-processing follows HuggingFace's ``postprocess_qa_predictions`` for v1.1: for every window
of an example, the ``n_best`` highest start and end logits are paired; a pair counts when both
tokens are context tokens, the end is not before the start and the span is at most
``max_answer_length`` tokens long. The pair with the highest start + end logit over all the
example's windows gives the answer, cut from the context by the offset mapping.

The metric is the official ``evaluate-v1.1.py``'s: answers are normalised (lower case,
punctuation and the articles a/an/the removed, whitespace collapsed), each prediction scores
the best of its references for exact match and token F1, and both are averaged in percent.
"""

from __future__ import annotations

import collections
import re
import string

import torch

from config.finetuning import FinetuningConfig
from data.finetuning_data import TaskSet
from data.squad import SquadExample, SquadWindows

N_BEST = 20
MAX_ANSWER_LENGTH = 30


def best_answers(
    examples: list[SquadExample],
    windows: SquadWindows,
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    n_best: int = N_BEST,
    max_answer_length: int = MAX_ANSWER_LENGTH,
) -> dict[str, str]:
    """The predicted answer text of every example (``""`` when no span qualifies).

    Args:
        examples: The examples the windows were made from.
        windows: Their windows (:func:`data.squad.squad_windows`).
        start_logits, end_logits: ``[windows, max_length]``, in the order of ``windows``.
        n_best: Start and end candidates per window.
        max_answer_length: Longest answer, in tokens.

    Returns:
        Example id -> answer text (the official ``predictions.json`` content).
    """
    best: dict[int, tuple[float, str]] = {}
    starts = start_logits.float().topk(min(n_best, start_logits.shape[1]), dim=1).indices
    ends = end_logits.float().topk(min(n_best, end_logits.shape[1]), dim=1).indices
    for w in range(len(windows)):
        owner = int(windows.example_index[w])
        spans = windows.offsets[w]
        context = examples[owner].context
        start_row, end_row = start_logits[w].tolist(), end_logits[w].tolist()
        for start in starts[w].tolist():
            for end in ends[w].tolist():
                if spans[start] is None or spans[end] is None:
                    continue
                if end < start or end - start + 1 > max_answer_length:
                    continue
                score = start_row[start] + end_row[end]
                if owner not in best or score > best[owner][0]:
                    # Tokens carry their leading space: strip it from the answer.
                    text = context[spans[start][0] : spans[end][1]].strip()
                    best[owner] = (score, text)
    return {e.id: best[n][1] if n in best else "" for n, e in enumerate(examples)}


def normalize_answer(text: str) -> str:
    """The official normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_PUNCTUATION = frozenset(string.punctuation)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised texts are equal."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised texts' bags of words (the official ``f1_score``)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = collections.Counter(predicted) & collections.Counter(expected)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], examples: list[SquadExample]) -> dict[str, float]:
    """``exact_match`` and ``f1`` in percent over ``examples``, each the best over its
    references; an example without a prediction scores 0 (as the official script)."""
    em = f1 = 0.0
    for example in examples:
        predicted = predictions.get(example.id)
        if predicted is None:
            continue
        references = [answer.text for answer in example.answers]
        em += max(exact_match(predicted, ref) for ref in references)
        f1 += max(token_f1(predicted, ref) for ref in references)
    count = max(len(examples), 1)
    return {"exact_match": 100.0 * em / count, "f1": 100.0 * f1 / count}


def score_squad(
    task_set: TaskSet, outputs: torch.Tensor, options: FinetuningConfig
) -> tuple[dict[str, float], dict[str, str]]:
    """(``exact_match`` and ``f1``, the answer of each question by id) of one file's start
    and end logits, float32 ``[rows, seq, 2]``."""
    answers = best_answers(
        task_set.examples,
        task_set.windows,
        outputs[..., 0],
        outputs[..., 1],
        n_best=options.n_best_size,
        max_answer_length=options.max_answer_length,
    )
    return squad_scores(answers, task_set.examples), answers

"""Fine-tuning heads: span start/end logits (SQuAD) and a last-token classifier (MNLI).

Each replaces the language-model head as the model's last part. Both begin with the final
layer norm ``ln_f`` (the pretrained one, as HuggingFace's ``GPT2Model`` ends with it), then a
small projection of the hidden size:

- :class:`SpanHead`: ``Linear(hidden, 2)`` with bias, as ``GPT2ForQuestionAnswering``'s
  ``qa_outputs``; the loss is the mean of the start and end cross-entropies over positions.
- :class:`ClassifierHead`: bias-free ``Linear(hidden, 3)`` on the last non-pad token, as
  ``GPT2ForSequenceClassification``'s ``score``; the loss is the cross-entropy over labels.

Shards: the residual stream is ``[B, S, h/tp2]``, so the projection's input features are split
over tp2 and its partial sums all-reduced over tp2. The outputs (2 or 3) are too few to split;
tp1 ranks hold the same copy and compute the same numbers, so the residual's gradient, like the
residual, is the same on every tp1 rank and needs no collective.

Both heads take ``targets`` int64 ``[B, 2]``: (first, last answer token) for spans, (label,
position of the last real token) for the classifier; :data:`TARGET_WIDTH` columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelling.layers import LayerNorm, ParallelLinear
from modelling.parallel import Axis, reduce_from

SQUAD, MNLI = "squad", "mnli"
TASKS = (SQUAD, MNLI)
TARGET_WIDTH = 2
NUM_LABELS = 3  # entailment, neutral, contradiction


def reads_whole_sequences(task: str) -> bool:
    """Whether a run's head needs every position of a sequence on one rank, so that it cannot
    run context-parallel: a task's does (a softmax over every position, or the last token);
    the language model's head ("") reads each position alone."""
    return bool(task)


class SpanHead(nn.Module):
    """Start and end logits of an answer span at every position.

    The bias (2 numbers, too few to split) is held by tp2 rank 0 and added to its partial
    sums before the tp2 all-reduce; the other tp2 ranks hold padding there, masked to zero so
    that it gets no gradient (``execution.parallel.sharding``: ``_on_first_tp2``).
    """

    def __init__(self, local_hidden: int, eps: float, tp2: Axis):
        super().__init__()
        self.ln_f = LayerNorm(local_hidden, tp2, eps)
        self.qa = ParallelLinear(local_hidden, 2, tp2, bias=True)
        self.tp2 = tp2

    def logits(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, 2]``: start logits in ``[..., 0]``, end logits in ``[..., 1]``."""
        bias = self.qa.bias * (self.tp2.rank == 0)
        return reduce_from(F.linear(self.ln_f(x), self.qa.weight, bias), self.tp2)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor, logits_only: bool = False
    ) -> torch.Tensor:
        """Mean of the start and end cross-entropies, each averaged over the micro-batch (or,
        with ``logits_only``, the logits: the phased engine binds weights to ``forward``)."""
        logits = self.logits(x)
        if logits_only:
            return logits
        logits = logits.float()
        start = F.cross_entropy(logits[..., 0], targets[:, 0])
        end = F.cross_entropy(logits[..., 1], targets[:, 1])
        return (start + end) / 2


class ClassifierHead(nn.Module):
    """Label logits read at each sequence's last real token."""

    def __init__(self, local_hidden: int, eps: float, tp2: Axis):
        super().__init__()
        self.ln_f = LayerNorm(local_hidden, tp2, eps)
        self.score = ParallelLinear(local_hidden, NUM_LABELS, tp2, bias=False)

    def logits(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[B, 3]``. The layer norm acts per token, so picking the token first and then
        normalising it is what normalising every token and then picking gives."""
        last = x[torch.arange(x.shape[0], device=x.device), targets[:, 1]]  # (B, h/tp2)
        return self.score(self.ln_f(last))

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor, logits_only: bool = False
    ) -> torch.Tensor:
        """Cross-entropy of the labels ``targets[:, 0]``, averaged over the micro-batch (or,
        with ``logits_only``, the logits)."""
        logits = self.logits(x, targets)
        return logits if logits_only else F.cross_entropy(logits.float(), targets[:, 0])


def task_head(task: str, local_hidden: int, eps: float, tp2: Axis) -> nn.Module:
    """The head of ``task`` (one of :data:`TASKS`) for one tp2 shard."""
    heads = {SQUAD: SpanHead, MNLI: ClassifierHead}
    return heads[task](local_hidden, eps, tp2)


def head_parameter_shapes(task: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """Unsharded shapes of a task's projection (``ln_f`` is the language model's); none for
    the language model's head (``task`` empty)."""
    if task == SQUAD:
        return {"qa.weight": (2, hidden), "qa.bias": (2,)}
    if task == MNLI:
        return {"score.weight": (NUM_LABELS, hidden)}
    assert not task, f"unknown task {task!r}"
    return {}

"""Fine-tuning heads: span start/end logits (SQuAD) and a last-token classifier (MNLI).

Each replaces the language-model head as the model's last part. Both begin with the final
norm ``ln_f`` (the pretrained one, as HuggingFace's ``GPT2Model`` and ``LlamaModel`` end with
it), built by the model as its own final norm is (a layer norm for GPT-3, an RMSNorm for a
Llama model) and handed in, then a small projection of the hidden size:

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

Each head's class declares what the rest of the house reads of it (:class:`TaskHead`); which
task uses which head is the task's spec (``tasks/specs.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from modelling.layers import ParallelLinear
from modelling.parallel import Axis, reduce_from

TARGET_WIDTH = 2
NUM_LABELS = 3  # entailment, neutral, contradiction

# How a head's parameter is split over the tensor-parallel mesh (execution.parallel.sharding
# gives each its index rule and shard kind):
INPUT_OVER_TP2 = "input_over_tp2"  # [out, in]: whole along out, input features over tp2
ON_FIRST_TP2 = "on_first_tp2"  # too short to split, added before a tp2 all-reduce: tp2 rank 0's


class HFTaskClass(NamedTuple):
    """A HuggingFace task class: its name, and the attribute holding its base model (whose
    names prefix every weight but the projection's)."""

    name: str
    base_model: str


class TaskHead(nn.Module, ABC):
    """What the rest of the house reads of a fine-tuning head, each head declaring its own.

    Attributes:
        TARGET_WIDTH: Target columns at the end of each row (:data:`TARGET_WIDTH`).
        SPLITS: Our parameter name within the head -> its split (:data:`INPUT_OVER_TP2`,
            :data:`ON_FIRST_TP2`); the final norm ``ln_f`` is the language model's.
        HF_NAMES: Our parameter name within the head -> HuggingFace's (an ``nn.Linear``: not
            transposed); a language model's folder (``GPT2LMHeadModel``, ``LlamaForCausalLM``)
            has none of them.
        HF_CLASSES: HuggingFace ``model_type`` (``gpt2``, ``llama``) -> the class a fine-tuned
            model of that family exports as.
    """

    TARGET_WIDTH: ClassVar[int] = TARGET_WIDTH
    SPLITS: ClassVar[dict[str, str]]
    HF_NAMES: ClassVar[dict[str, str]]
    HF_CLASSES: ClassVar[dict[str, HFTaskClass]]

    @staticmethod
    @abstractmethod
    def parameter_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
        """Unsharded shapes of the head's projection, in the order the model holds them."""

    @staticmethod
    @abstractmethod
    def output_shape(micro_batch: int, sequence_length: int) -> tuple[int, ...]:
        """The shape of the logits it gives for a micro-batch (``logits_only``)."""

    @classmethod
    def describe_hf(cls, config) -> None:
        """Fills what HuggingFace's class needs besides the sizes into ``config`` (a
        ``transformers.GPT2Config`` or ``LlamaConfig``)."""
        config.architectures = [cls.HF_CLASSES[config.model_type].name]


def reads_whole_sequences(head: type[TaskHead] | None) -> bool:
    """Whether a run's head needs every position of a sequence on one rank, so that it cannot
    run context-parallel: a task's does (a softmax over every position, or the last token);
    the language model's (None) reads each position alone."""
    return head is not None


class SpanHead(TaskHead):
    """Start and end logits of an answer span at every position.

    The bias (2 numbers, too few to split) is held by tp2 rank 0 and added to its partial
    sums before the tp2 all-reduce; the other tp2 ranks hold padding there, masked to zero so
    that it gets no gradient (:data:`ON_FIRST_TP2`).
    """

    SPLITS: ClassVar[dict[str, str]] = {"qa.weight": INPUT_OVER_TP2, "qa.bias": ON_FIRST_TP2}
    HF_NAMES: ClassVar[dict[str, str]] = {
        "qa.weight": "qa_outputs.weight",
        "qa.bias": "qa_outputs.bias",
    }
    HF_CLASSES: ClassVar[dict[str, HFTaskClass]] = {
        "gpt2": HFTaskClass("GPT2ForQuestionAnswering", "transformer"),
        "llama": HFTaskClass("LlamaForQuestionAnswering", "transformer"),
    }

    @staticmethod
    def parameter_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
        return {"qa.weight": (2, hidden), "qa.bias": (2,)}

    @staticmethod
    def output_shape(micro_batch: int, sequence_length: int) -> tuple[int, ...]:
        return (micro_batch, sequence_length, 2)

    def __init__(self, final_norm: nn.Module, local_hidden: int, tp2: Axis):
        super().__init__()
        self.ln_f = final_norm
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


class ClassifierHead(TaskHead):
    """Label logits read at each sequence's last real token."""

    SPLITS: ClassVar[dict[str, str]] = {"score.weight": INPUT_OVER_TP2}
    HF_NAMES: ClassVar[dict[str, str]] = {"score.weight": "score.weight"}
    HF_CLASSES: ClassVar[dict[str, HFTaskClass]] = {
        "gpt2": HFTaskClass("GPT2ForSequenceClassification", "transformer"),
        "llama": HFTaskClass("LlamaForSequenceClassification", "model"),
    }

    @staticmethod
    def parameter_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
        return {"score.weight": (NUM_LABELS, hidden)}

    @staticmethod
    def output_shape(micro_batch: int, sequence_length: int) -> tuple[int, ...]:
        return (micro_batch, NUM_LABELS)

    @classmethod
    def describe_hf(cls, config) -> None:
        """Three labels; the padding token is ``<|endoftext|>``, as our prompts pad."""
        super().describe_hf(config)
        config.num_labels, config.pad_token_id = NUM_LABELS, config.eos_token_id

    def __init__(self, final_norm: nn.Module, local_hidden: int, tp2: Axis):
        super().__init__()
        self.ln_f = final_norm
        self.score = ParallelLinear(local_hidden, NUM_LABELS, tp2, bias=False)

    def logits(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[B, 3]``. The final norm acts per token, so picking the token first and then
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


# Every kind of head, for what is read from parameter names alone (HuggingFace's names).
HEADS: tuple[type[TaskHead], ...] = (SpanHead, ClassifierHead)
# Our name of each head's projection in the whole model -> HuggingFace's.
HF_TASK_NAMES = {f"head.{ours}": theirs for head in HEADS for ours, theirs in head.HF_NAMES.items()}


def head_holding(names: Iterable[str]) -> type[TaskHead] | None:
    """The head whose projection a model's parameter ``names`` hold (None: a language
    model's)."""
    names = set(names)
    for head in HEADS:
        if all(f"head.{name}" in names for name in head.HF_NAMES):
            return head
    return None

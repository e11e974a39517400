"""The schedule of a step: which phases run, in which order, over which micro-batches.

A training step walks the model in one or more *passes*, each over a disjoint, contiguous group
of this replica's micro-batches (DESIGN.md section 6):

    embedding forward, layer 0 .. L-1 forward, head forward + backward,
    layer L-1 .. 0 backward, embedding backward

Gradients accumulate across passes; the global norm, clipping and the optimizer follow the last
pass. One pass loads each layer once per step (least weight traffic, most activation memory);
as many passes as micro-batches streams the layers per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from modelling import gpt

EMBEDDING_FORWARD = "embedding_forward"
LAYER_FORWARD = "layer_forward"
HEAD = "head"  # forward, plus backward when training
LAYER_BACKWARD = "layer_backward"
EMBEDDING_BACKWARD = "embedding_backward"


@dataclass(frozen=True)
class Phase:
    """One phase: a part (``layer`` for decoder phases) run over a group of micro-batches.

    Attributes:
        kind: One of the phase names above.
        layer: Decoder layer index for layer phases, else 0.
        micro_batches: Indices into this replica's micro-batches of the step.
        first_pass: Gradients of this phase start the step's accumulation.
        last_pass: Gradients of this phase complete it (they count towards the global norm).
        pass_index: The pass it belongs to (a pipeline stage holds several passes at once,
            each in its own slot of the activation buffers).
    """

    kind: str
    layer: int
    micro_batches: range
    first_pass: bool = True
    last_pass: bool = True
    pass_index: int = 0


def weights_loaded(phase: Phase) -> list[tuple[str, int]]:
    """The (part, row) whose weights a phase loads, so they can be fetched a phase ahead.

    The head also loads the word embedding, tied to its output projection; the pipeline's
    point-to-point moves load none.
    """
    if phase.kind not in (
        EMBEDDING_FORWARD,
        LAYER_FORWARD,
        HEAD,
        LAYER_BACKWARD,
        EMBEDDING_BACKWARD,
    ):
        return []
    if phase.kind in (LAYER_FORWARD, LAYER_BACKWARD):
        return [(gpt.LAYERS, phase.layer)]
    if phase.kind == HEAD:
        return [(gpt.HEAD, 0), (gpt.EMBEDDING, 0)]
    return [(gpt.EMBEDDING, 0)]


def pass_groups(micro_batches: int, passes: int) -> list[range]:
    """``passes`` contiguous groups covering ``range(micro_batches)``, sizes differing by at
    most one (the largest, ``ceil(micro_batches / passes)``, is what the buffers hold)."""
    base, extra = divmod(micro_batches, passes)
    groups, start = [], 0
    for index in range(passes):
        size = base + (index < extra)
        groups.append(range(start, start + size))
        start += size
    return groups


def forward_phases(layers: int, group: range) -> Iterator[Phase]:
    """Embedding and every decoder layer forward over one group of micro-batches."""
    yield Phase(EMBEDDING_FORWARD, 0, group)
    for n in range(layers):
        yield Phase(LAYER_FORWARD, n, group)


def training_phases(layers: int, micro_batches: int, passes: int) -> Iterator[Phase]:
    """Every phase of one training step up to (not including) the optimizer, in order."""
    groups = pass_groups(micro_batches, passes)
    for index, group in enumerate(groups):
        first, last = index == 0, index == len(groups) - 1
        yield from forward_phases(layers, group)
        yield Phase(HEAD, 0, group, first, last)
        for n in reversed(range(layers)):
            yield Phase(LAYER_BACKWARD, n, group, first, last)
        # The head's tied word-embedding gradient has already started the embedding's sum.
        yield Phase(EMBEDDING_BACKWARD, 0, group, first_pass=False, last_pass=last)

"""The schedule of a step: which phases run, in which order, over which micro-batches.

A training step walks the model in one or more *passes*, each over a disjoint, contiguous group
of this replica's micro-batches (docs/design.md, "The phases of a step"):

    embedding forward, layer 0 .. L-1 forward, head forward + backward,
    layer L-1 .. 0 backward, embedding backward

Gradients accumulate across passes; the global norm, clipping and the optimizer follow the last
pass. One pass loads each layer once per step (least weight traffic, most activation memory);
as many passes as micro-batches streams the layers per micro-batch.

With a pipeline the decoder layers split into S contiguous stages (:class:`Stage`): stage 0
also holds the embedding, stage S - 1 the head (and a copy of the word embedding tied to it).
Phased execution stays inside a stage, so the passes of a step are the pipeline's chunks, run
one forward, one backward: stage s starts ``S - 1 - s`` forwards before its first backward and
holds at most ``min(S - s, P)`` passes of activations at once. Boundary activations cross
between stages in *move* phases (:mod:`execution.engine.phases.pipeline` runs them). One generator,
:func:`training_phases`, serves every layout: with one stage it gives the list above, pass
after pass.

:data:`PHASE_KINDS` is the one table of phase kinds: what each loads, and whether it moves
activations between stages rather than computing.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelling.gpt import EMBEDDING, HEAD, LAYERS

EMBEDDING_FORWARD = "embedding_forward"
LAYER_FORWARD = "layer_forward"
HEAD_PHASE = "head"  # forward, plus backward when training
UNTIED_HEAD = "untied_head"  # a language model's head with a projection of its own (Llama)
TASK_HEAD = "task_head"  # a fine-tuning task's head instead: no tied word embedding
LAYER_BACKWARD = "layer_backward"
EMBEDDING_BACKWARD = "embedding_backward"
# x arrives from the previous stage before a pass's forward and leaves for the next after it;
# dx arrives from the next stage before the backward and leaves for the previous after it.
RECEIVE_X = "receive_x"
SEND_X = "send_x"
RECEIVE_DX = "receive_dx"
SEND_DX = "send_dx"


@dataclass(frozen=True)
class PhaseKind:
    """What a kind of phase does, as far as scheduling and prefetch need to know.

    Attributes:
        loads: The parts whose weights it loads (a layer phase loads its own decoder layer;
            the head also loads the word embedding, tied to its output projection).
        move: It moves boundary activations between pipeline stages and computes nothing.
    """

    loads: tuple[str, ...] = ()
    move: bool = False


PHASE_KINDS: dict[str, PhaseKind] = {
    EMBEDDING_FORWARD: PhaseKind(loads=(EMBEDDING,)),
    LAYER_FORWARD: PhaseKind(loads=(LAYERS,)),
    HEAD_PHASE: PhaseKind(loads=(HEAD, EMBEDDING)),
    UNTIED_HEAD: PhaseKind(loads=(HEAD,)),
    TASK_HEAD: PhaseKind(loads=(HEAD,)),
    LAYER_BACKWARD: PhaseKind(loads=(LAYERS,)),
    EMBEDDING_BACKWARD: PhaseKind(loads=(EMBEDDING,)),
    RECEIVE_X: PhaseKind(move=True),
    SEND_X: PhaseKind(move=True),
    RECEIVE_DX: PhaseKind(move=True),
    SEND_DX: PhaseKind(move=True),
}
MOVES = tuple(kind for kind, what in PHASE_KINDS.items() if what.move)


@dataclass(frozen=True)
class Phase:
    """One phase: a part (``layer`` for decoder phases) run over a group of micro-batches.

    Attributes:
        kind: A key of :data:`PHASE_KINDS`.
        layer: This stage's decoder layer index for layer phases, else 0.
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
    """The (part, row) whose weights a phase loads, so they can be fetched a phase ahead."""
    return [(part, phase.layer if part == LAYERS else 0) for part in PHASE_KINDS[phase.kind].loads]


def first_loads(phases: list[Phase]) -> list[tuple[str, int]]:
    """Each (part, row) whose weights ``phases`` load, in the order of its first load: the
    order in which a host update running behind the step should write them (the last
    pipeline stage loads its layers before the head and the word embedding tied to it)."""
    return list(dict.fromkeys(key for phase in phases for key in weights_loaded(phase)))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its place in the pipeline and the decoder layers it holds.

    Attributes:
        index, count: This stage and the number of stages (1 without a pipeline).
        first_layer: Global index of its first decoder layer (its buffer row 0).
        layers: Decoder layers it holds.
        task_head: Whether its head is a fine-tuning task's (:mod:`modelling.task_heads`),
            which ties nothing, rather than the language model's (tied to the word embedding).
        tied_head: Whether a language model's head is tied to the word embedding (GPT-3's)
            rather than projecting with its own weights (Llama's).
    """

    index: int
    count: int
    first_layer: int
    layers: int
    task_head: bool = False
    tied_head: bool = True

    @classmethod
    def of(
        cls,
        stage_layers: tuple[int, ...],
        index: int,
        task_head: bool = False,
        tied_head: bool = True,
    ) -> Stage:
        """Stage ``index`` of a pipeline whose stages hold ``stage_layers`` layers each."""
        first = sum(stage_layers[:index])
        return cls(index, len(stage_layers), first, stage_layers[index], task_head, tied_head)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def head_kind(self) -> str:
        """The kind of this stage's head phase (on the last stage)."""
        if self.task_head:
            return TASK_HEAD
        return HEAD_PHASE if self.tied_head else UNTIED_HEAD

    @property
    def holds_tied_head(self) -> bool:
        """The language model's head is here: its projection is the word embedding."""
        return self.is_last and not self.task_head and self.tied_head

    def rows(self, part: str) -> int:
        """Buffer rows of ``part`` this stage holds: its layers, the embedding on the first
        stage and on the last with the tied head, the head on the last, else none."""
        if part == LAYERS:
            return self.layers
        if part == EMBEDDING:
            return int(self.is_first or self.holds_tied_head)
        assert part == HEAD, part
        return int(self.is_last)

    def load_order(self, micro_batches: int, passes: int) -> list[tuple[str, int]]:
        """Each (part, row) this stage holds in the order a training step first loads it
        (:func:`first_loads`)."""
        return first_loads(training_phases(self, micro_batches, passes))

    def in_flight(self, passes: int) -> int:
        """Passes whose activations this stage holds at once in one-forward-one-backward."""
        return min(self.count - self.index, passes)


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


def _forward(stage: Stage, group: range, index: int, evaluation: bool = False) -> list[Phase]:
    """One pass's forward through a stage: in from the embedding or the previous stage,
    every layer, out to the next stage (or, when evaluating, the head's loss)."""
    first_kind = EMBEDDING_FORWARD if stage.is_first else RECEIVE_X
    phases = [Phase(first_kind, 0, group, pass_index=index)]
    phases += [Phase(LAYER_FORWARD, n, group, pass_index=index) for n in range(stage.layers)]
    if not stage.is_last:
        phases.append(Phase(SEND_X, 0, group, pass_index=index))
    elif evaluation:
        phases.append(Phase(stage.head_kind, 0, group, pass_index=index))
    return phases


def _backward(stage: Stage, group: range, index: int, passes: int) -> list[Phase]:
    """One pass's backward through a stage: the head (forward and backward) or dx from the
    next stage, every layer in reverse, then the embedding or dx out to the previous stage."""
    first, last = index == 0, index == passes - 1
    flags = {"first_pass": first, "last_pass": last, "pass_index": index}
    phases = [Phase(stage.head_kind if stage.is_last else RECEIVE_DX, 0, group, **flags)]
    phases += [Phase(LAYER_BACKWARD, n, group, **flags) for n in reversed(range(stage.layers))]
    if stage.is_first:
        # On the last stage too (one stage), the head's tied gradient already started the sum.
        flags["first_pass"] = first and not stage.holds_tied_head
        phases.append(Phase(EMBEDDING_BACKWARD, 0, group, **flags))
    else:
        phases.append(Phase(SEND_DX, 0, group, **flags))
    return phases


def training_phases(stage: Stage, micro_batches: int, passes: int) -> list[Phase]:
    """Every phase of one stage's training step up to the optimizer, one forward, one
    backward over passes after ``S - 1 - s`` forwards of warm-up (none with one stage)."""
    groups = pass_groups(micro_batches, passes)
    warmup = min(stage.count - 1 - stage.index, passes)
    order = [("F", p) for p in range(warmup)]
    for p in range(passes - warmup):
        order += [("F", warmup + p), ("B", p)]
    order += [("B", p) for p in range(passes - warmup, passes)]
    phases = []
    for direction, p in order:
        if direction == "F":
            phases += _forward(stage, groups[p], p)
        else:
            phases += _backward(stage, groups[p], p, passes)
    return phases


def evaluation_phases(stage: Stage, group: range, index: int) -> list[Phase]:
    """One evaluation chunk's forward through this stage (the head's loss on the last)."""
    return _forward(stage, group, index, evaluation=True)

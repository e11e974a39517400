"""Pipeline parallelism: which layers a stage holds, its one-forward-one-backward schedule over
passes, and the point-to-point moves of boundary activations between neighbouring stages.

The decoder layers split into S contiguous stages (``PretrainingConfig.stage_layers``); stage 0
also holds the embedding and stage S - 1 the head, with a copy of the word embedding tied to
it. Phased execution stays inside a stage: a stage loads each of its layers once per pass and
runs that pass's micro-batches through it, so the passes of a step are the pipeline's chunks.
While stage s runs the forward of pass p, stage s - 1 runs pass p + 1, and the backward comes
back the same way. In one-forward-one-backward order stage s starts ``S - 1 - s`` forwards
before its first backward, so it holds at most ``min(S - s, P)`` passes of activations (a
*slot* each) rather than all P. Of a step's ``P + S - 1`` pass-times each stage idles for
``S - 1``: the bubble.

Each boundary activation crosses once per micro-batch: stage s sends its tp1 slice of x after
its last layer (the receiver stores it in its first x row as is) and receives its gradient
back before its last layer's backward. Receives are posted a pass ahead and sends run in the
background (``isend``/``irecv``), so transfers overlap compute; every send is waited for at the
end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from execution.engine import schedule
from execution.engine.buffers import ActivationLayout
from execution.engine.schedule import Phase
from execution.engine.state import StateStore
from execution.parallel.mesh import GroupAxis, Pending
from modelling.gpt import EMBEDDING, HEAD, LAYERS

# Phase kinds of the point-to-point moves: x arrives from the previous stage before a pass's
# forward and leaves for the next after it; dx arrives from the next stage before the backward
# and leaves for the previous after it.
RECEIVE_X = "receive_x"
SEND_X = "send_x"
RECEIVE_DX = "receive_dx"
SEND_DX = "send_dx"
MOVES = (RECEIVE_X, SEND_X, RECEIVE_DX, SEND_DX)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its place in the pipeline and the decoder layers it holds.

    Attributes:
        index, count: This stage and the number of stages.
        first_layer: Global index of its first decoder layer (its buffer row 0).
        layers: Decoder layers it holds.
    """

    index: int
    count: int
    first_layer: int
    layers: int

    @classmethod
    def of(cls, stage_layers: tuple[int, ...], index: int) -> Stage:
        """Stage ``index`` of a pipeline whose stages hold ``stage_layers`` layers each."""
        first = sum(stage_layers[:index])
        return cls(index, len(stage_layers), first, stage_layers[index])

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def rows(self, part: str) -> int:
        """Buffer rows of ``part`` this stage holds: its layers, the embedding on the first
        and the last stage (tied to the head), the head on the last, else none."""
        if part == LAYERS:
            return self.layers
        if part == EMBEDDING:
            return int(self.is_first or self.is_last)
        assert part == HEAD, part
        return int(self.is_last)

    def in_flight(self, passes: int) -> int:
        """Passes whose activations this stage holds at once in one-forward-one-backward."""
        return min(self.count - self.index, passes)


def deciding_stages(stage_layers: tuple[int, ...]) -> list[int]:
    """The stages whose memory decides whether a plan fits every stage: the first and the
    last (they hold the embedding, and the head), and each middle stage with more layers than
    every middle stage before it (a later one with no more layers holds fewer passes)."""
    count = len(stage_layers)
    out, most = sorted({0, count - 1}), 0
    for index in range(1, count - 1):
        if stage_layers[index] > most:
            out.append(index)
            most = stage_layers[index]
    return sorted(out)


def bubble_fraction(stages: int, passes: int) -> float:
    """The share of a step each stage idles: (S - 1) / (P + S - 1)."""
    return (stages - 1) / (passes + stages - 1)


def _forward(stage: Stage, group: range, index: int, evaluation: bool = False) -> list[Phase]:
    phases = []
    if stage.is_first:
        phases.append(Phase(schedule.EMBEDDING_FORWARD, 0, group, pass_index=index))
    else:
        phases.append(Phase(RECEIVE_X, 0, group, pass_index=index))
    phases += [
        Phase(schedule.LAYER_FORWARD, n, group, pass_index=index) for n in range(stage.layers)
    ]
    if not stage.is_last:
        phases.append(Phase(SEND_X, 0, group, pass_index=index))
    elif evaluation:
        phases.append(Phase(schedule.HEAD, 0, group, pass_index=index))
    return phases


def _backward(stage: Stage, group: range, index: int, passes: int) -> list[Phase]:
    first, last = index == 0, index == passes - 1
    flags = {"first_pass": first, "last_pass": last, "pass_index": index}
    phases = [Phase(schedule.HEAD if stage.is_last else RECEIVE_DX, 0, group, **flags)]
    phases += [
        Phase(schedule.LAYER_BACKWARD, n, group, **flags) for n in reversed(range(stage.layers))
    ]
    if stage.is_first:
        # On the last stage too (pp 1), the head's tied gradient already started the sum.
        flags["first_pass"] = first and not stage.is_last
        phases.append(Phase(schedule.EMBEDDING_BACKWARD, 0, group, **flags))
    else:
        phases.append(Phase(SEND_DX, 0, group, **flags))
    return phases


def training_phases(stage: Stage, micro_batches: int, passes: int) -> list[Phase]:
    """Every phase of one stage's training step, one forward, one backward over passes
    (without a pipeline, :func:`schedule.training_phases`: every pass forward, then back)."""
    if stage.count == 1:
        return list(schedule.training_phases(stage.layers, micro_batches, passes))
    groups = schedule.pass_groups(micro_batches, passes)
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
    """One chunk's forward through this stage (the head's loss on the last)."""
    if stage.count == 1:
        return [*schedule.forward_phases(stage.layers, group), Phase(schedule.HEAD, 0, group)]
    return _forward(stage, group, index, evaluation=True)


class Link:
    """The point-to-point moves of one stage with its neighbours, over the pipeline group.

    Receives land in fresh device tensors; :meth:`start` posts the first of each direction and
    each receive, once waited for, posts the next pass's, so every transfer is posted a pass
    ahead of its use. Sends read a copy of what they send, so the buffers they came from may be
    reused at once. The tag is the pass index: under gloo the receive of a pass matches only
    that pass's send. NCCL ignores tags and pairs a group's ops between two ranks in issue
    order, so x and dx travel on a group each (:class:`GroupAxis` ``upward_group`` and
    ``downward_group``): per group and pair of stages, one sends and the other receives, pass
    after pass in the same order (``tests/nccl_order.py`` checks every pipeline test by that
    rule).
    """

    def __init__(self, pp: GroupAxis, stage: Stage, activations: ActivationLayout, device):
        self.pp = pp
        self.stage = stage
        self.activations = activations
        self.device = device
        self._sizes: dict[tuple[str, int], int] = {}  # receives of the schedule: entries each
        self._receives: dict[tuple[str, int], Pending] = {}
        self._sends: list[Pending] = []

    def start(self, phases: list[Phase]) -> None:
        """Notes the receives of a schedule and posts the first of each direction."""
        self._sizes = {
            (phase.kind, phase.pass_index): len(phase.micro_batches)
            for phase in phases
            if phase.kind in (RECEIVE_X, RECEIVE_DX)
        }
        for kind in (RECEIVE_X, RECEIVE_DX):
            first = min((p for k, p in self._sizes if k == kind), default=None)
            if first is not None:
                self._post(kind, first)

    def _post(self, kind: str, index: int) -> None:
        a, entries = self.activations, self._sizes[kind, index]
        shape = (entries, a.x_shard) if kind == RECEIVE_X else (entries, *a.tokens, a.hidden)
        into = torch.empty(shape, dtype=a.dtype, device=self.device)
        source = self.stage.index - 1 if kind == RECEIVE_X else self.stage.index + 1
        self._receives[kind, index] = self.pp.start_receive(into, source, index)

    def receive(self, kind: str, index: int) -> torch.Tensor:
        """Pass ``index``'s x or dx once arrived; posts the next pass's receive."""
        if (kind, index) not in self._receives:
            self._post(kind, index)
        value = self._receives.pop((kind, index)).wait()
        if (kind, index + 1) in self._sizes:
            self._post(kind, index + 1)
        return value

    def send(self, kind: str, index: int, value: torch.Tensor) -> None:
        target = self.stage.index + 1 if kind == SEND_X else self.stage.index - 1
        self._sends.append(self.pp.start_send(value.contiguous(), target, index))

    def finish(self) -> None:
        """Waits for every send (their receivers have them once their step is done)."""
        assert not self._receives, f"receives posted and never used: {list(self._receives)}"
        for pending in self._sends:
            pending.wait()
        self._sends.clear()


def move(link: Link, state: StateStore, phase: Phase, entries: range) -> None:
    """Runs one move phase: x or dx between this stage's buffers and a neighbour.

    x leaves from the last boundary (this rank's tp1 slices, as stored) and arrives at
    boundary 0; dx leaves from boundary 0 and arrives at the last boundary.
    """
    last = link.stage.layers
    if phase.kind == RECEIVE_X:
        state.put_x_slices(0, entries, link.receive(RECEIVE_X, phase.pass_index))
    elif phase.kind == SEND_X:
        link.send(SEND_X, phase.pass_index, state.x_slices(last, entries))
    elif phase.kind == RECEIVE_DX:
        for e, dx in zip(entries, link.receive(RECEIVE_DX, phase.pass_index), strict=True):
            state.store_dx(last, e, dx)
    else:
        assert phase.kind == SEND_DX, phase.kind
        link.send(SEND_DX, phase.pass_index, state.dx_entries(0, entries))


def sum_tied_gradient(state: StateStore, embedding: GroupAxis) -> list[torch.Tensor]:
    """Adds the first stage's word-embedding gradient (its lookups) and the last stage's (the
    head's projection), so both hold the whole and update it identically; the position
    embedding's gradient is the first stage's alone (the last adds zeros).

    Returns the summed shards on the device (for the norm, counted by one of the two)."""
    summed = []
    place = state.places["grads"]
    for kind in state.specs[EMBEDDING]:
        stored = state.parts[EMBEDDING].grads[kind][0]
        total = embedding.all_reduce_(state._load(stored, place).clone())
        state._store(stored, total, place)
        summed.append(total)
    return summed

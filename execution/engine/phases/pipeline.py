"""Pipeline parallelism: the point-to-point moves of boundary activations between neighbouring
stages, and the tied word embedding's gradient summed over the first and last stage.

Which layers a stage holds and its one-forward-one-backward order over passes are part of the
one schedule (:mod:`execution.engine.phases.schedule`). While stage s runs the forward of pass p,
stage s - 1 runs pass p + 1, and the backward comes back the same way; of a step's
``P + S - 1`` pass-times each stage idles for ``S - 1``: the bubble
(:mod:`execution.planning.pipeline_figures` prices it).

Each boundary activation crosses once per micro-batch: stage s sends its tp1 slice of x after
its last layer (the receiver stores it in its first x row as is) and receives its gradient
back before its last layer's backward. Receives are posted a pass ahead and sends run in the
background (``isend``/``irecv``), so transfers overlap compute; every send is waited for at the
end of the step.
"""

from __future__ import annotations

import torch

from execution.engine.phases.schedule import RECEIVE_DX, RECEIVE_X, SEND_DX, SEND_X, Phase, Stage
from execution.engine.storage.buffers import ActivationLayout
from execution.engine.storage.state import StateStore
from execution.parallel.mesh import GroupAxis, Pending
from modelling.gpt import EMBEDDING


class Link:
    """The point-to-point moves of one stage with its neighbours, over the pipeline group.

    Receives land in fresh device tensors; :meth:`start` posts the first of each direction and
    each receive, once waited for, posts the next pass's, so every transfer is posted a pass
    ahead of its use. Sends read a copy of what they send, so the buffers they came from may be
    reused at once. The tag is the pass index: under gloo the receive of a pass matches only
    that pass's send. NCCL ignores tags and pairs a group's ops between two ranks in issue
    order, so x and dx travel on a group each (:class:`GroupAxis` ``upward_group`` and
    ``downward_group``): per group and pair of stages, one sends and the other receives, pass
    after pass in the same order (``tests/parallel/nccl_order.py`` checks every pipeline test by that
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
        state.activations.put_x_slices(0, entries, link.receive(RECEIVE_X, phase.pass_index))
    elif phase.kind == SEND_X:
        link.send(SEND_X, phase.pass_index, state.activations.x_slices(last, entries))
    elif phase.kind == RECEIVE_DX:
        for e, dx in zip(entries, link.receive(RECEIVE_DX, phase.pass_index), strict=True):
            state.activations.store_dx(last, e, dx)
    else:
        assert phase.kind == SEND_DX, phase.kind
        link.send(SEND_DX, phase.pass_index, state.activations.dx_entries(0, entries))


def sum_tied_gradient(state: StateStore, embedding: GroupAxis) -> list[torch.Tensor]:
    """Adds the first stage's word-embedding gradient (its lookups) and the last stage's (the
    head's projection), so both hold the whole and update it identically; the position
    embedding's gradient is the first stage's alone (the last adds zeros).

    Returns the summed shards on the device (for the norm, counted by one of the two)."""
    return state.grads.all_reduce(EMBEDDING, 0, embedding)

"""AdamW on flat shards, global-norm clipping, and the driver that updates every shard a rank
holds (:class:`AdamWDriver`)."""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch.optim.adamw import adamw

from execution.engine.storage.row_updates import RowUpdates
from execution.parallel.sharding import DECAYED_KINDS
from modelling.host_threads import team_thread

if TYPE_CHECKING:
    from config.schema import OptimizerConfig
    from execution.engine.storage.state import StateStore


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor applied to every gradient; same formula as ``torch.nn.utils.clip_grad_norm_``."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


@torch.no_grad()
def adamw_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    optim: OptimizerConfig,
    weight_decay: bool,
    grad_scale: float,
    mask: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """One decoupled-weight-decay Adam update of a float32 shard, in place, by torch's fused
    AdamW kernel (``torch.optim.adamw.adamw(fused=True)``, what ``torch.optim.AdamW(fused=True)``
    runs): one pass over the four tensors, on the device's cores or the host's (the calling
    thread's OpenMP team; bitwise the same at any team size).

    Args:
        weight, grad, exp_avg, exp_avg_sq: float32 tensors of equal shape.
        step: 1-based count of updates including this one (bias correction).
        lr: Learning rate of this step.
        optim: Betas, epsilon and the weight-decay rate.
        weight_decay: Whether this shard is decayed (matrices and embeddings only).
        grad_scale: Multiplier applied to ``grad`` before use (loss-scale removal and
            clipping), into a new tensor or ``scratch``: the step's gradients stay as they
            were.
        mask: RigL's bool mask of a sparse shard: the gradient outside it is not applied (it
            is the dense gradient, which RigL reads to grow connections, so it is masked here,
            not in place), and the weights outside it are exactly zero after the update.
        scratch: Where the scaled gradient goes, at least ``grad``'s length, kept by the
            caller from update to update. In host memory a new tensor as large as the shard
            comes with fresh pages, whose first touch costs more than the update itself (16M
            floats, bench_step.py's line: 39.8 ms with a new one on one core, 11.9 ms with a
            kept one).
    """
    shapes = {t.shape for t in (weight, grad, exp_avg, exp_avg_sq)}
    if len(shapes) != 1:  # the fused kernel reads every tensor at the weight's length
        raise ValueError(f"AdamW needs tensors of one shape, not {sorted(map(tuple, shapes))}")
    g = grad
    if grad_scale != 1.0 or (mask is not None and scratch is not None):
        into = None if scratch is None else scratch[: grad.numel()].view_as(grad)
        g = torch.mul(grad, grad_scale, out=into)
    if mask is not None:
        g = g.masked_fill_(~mask, 0.0) if g is not grad else g.masked_fill(~mask, 0.0)
    # The functional form counts the step up before it updates: it is given the steps before.
    steps_before = torch.full((), float(step - 1), device=weight.device)
    adamw(
        [weight],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [steps_before],
        fused=True,
        amsgrad=False,
        maximize=False,
        beta1=optim.beta1,
        beta2=optim.beta2,
        lr=lr,
        weight_decay=optim.weight_decay if weight_decay else 0.0,
        eps=optim.eps,
    )
    if mask is not None:
        weight.masked_fill_(~mask, 0.0)


class AdamWDriver:
    """AdamW on every part's shards of one rank, one row of one kind at a time.

    Device-placed weights are updated on the device. Host-placed ones are updated where they
    live, by the host's cores: weights and moments never cross the host link, only gradients
    kept on the device do. The host's update runs on a thread of its own whose OpenMP team is
    this rank's share of the node's cores (:func:`~modelling.host_threads.team_thread`), or,
    waited for on a team as large as the calling thread's, on the calling thread
    (:meth:`_on_calling_thread`). With ``overlap`` that thread goes on behind the next step:
    :meth:`update` returns once the update is started, the rows are updated in ``order``, the
    order the next step first loads them, and a load of a row waits for that row alone
    (:mod:`execution.engine.storage.row_updates`).
    The numbers are the same either way: each row's update reads and writes what it would
    have, before the next step reads or writes that row.

    Args:
        state: The rank's buffers.
        optim: Betas, epsilon and weight decay.
        host_threads: Cores for host updates (this process's share of the node's).
        overlap: Let the host update run behind the next step.
        order: Every (part, row) held, in the order the host updates them
            (:func:`~execution.engine.phases.schedule.first_loads`); default: the embedding,
            each decoder layer, the head.

    Attributes:
        behind: The rows of the last update that ran behind a step, once the next update
            (or :meth:`finish`) has waited for it: when each was written and how long the
            step's loads waited for it (:meth:`RowUpdates.report`); None before.
    """

    def __init__(
        self,
        state: StateStore,
        optim: OptimizerConfig,
        host_threads: int,
        overlap: bool = False,
        order: list[tuple[str, int]] | None = None,
    ):
        self.state, self.optim, self.host_threads = state, optim, max(1, host_threads)
        self.overlap = overlap
        held = dict.fromkeys(state.part_rows())
        self.order = list(dict.fromkeys(key for key in order or held if key in held))
        placed = set(self.order)
        self.order += [key for key in held if key not in placed]  # none that no phase loads
        self.behind: list[dict] | None = None
        self.steps = 0  # updates applied (AdamW's bias correction counts them)
        self._in_flight: Future | None = None
        self._host: ThreadPoolExecutor | None = None  # made at the first host update
        self._scratch: dict[str, torch.Tensor] = {}  # by device type: adamw_'s scratch

    def _scratch_for(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer for ``grad``'s scaled copy (adamw_'s ``scratch``), grown to the
        largest shard, where it is in host memory, or on meta tensors (a dry run, which
        meters what a CPU run does); None on a GPU, whose caching allocator hands back its
        blocks as they were."""
        kind = grad.device.type
        if kind == "cuda":
            return None
        kept = self._scratch.get(kind)
        if kept is None or kept.numel() < grad.numel():
            kept = self._scratch[kind] = torch.empty(grad.numel(), device=grad.device)
        return kept

    def _host_thread(self) -> ThreadPoolExecutor:
        """The rank's host update thread, made once and kept: the scheduler's waits of it and
        of its OpenMP team, which a step spends, stay visible to whoever times the step
        (utils/sample_clock.py reads every thread of the process). It goes with the
        driver."""
        if self._host is None:
            self._host = team_thread("host-adamw", self.host_threads)
            weakref.finalize(self, self._host.shutdown, wait=False)
        return self._host

    def _on_calling_thread(self) -> bool:
        """Whether the host update runs on the calling thread: a dry run (meta tensors, whose
        ops are metered on it), or an update the step waits for whose team would be the
        calling thread's own. A thread of its own would then only add a second OpenMP team,
        and GNU OpenMP, once it manages more threads than there are cores, stops its idle
        threads' spinning: every parallel op of every later phase waits for its team's
        other thread to wake (a host-bound step of 4 layers of width 64, every state on the
        host, on 2 cores: 8,000 such wake-ups, 0.48 s against 0.30 s a step)."""
        if self.state.device.type == "meta":
            return True
        return not self.overlap and torch.get_num_threads() == self.host_threads

    def update(self, lr: float, grad_scale: float) -> None:
        """One update of every shard with the step's gradients times ``grad_scale``; with
        ``overlap``, of host shards, started and left running (:meth:`finish` waits)."""
        self.finish()
        self.steps += 1
        hyper = {"step": self.steps, "lr": lr, "optim": self.optim, "grad_scale": grad_scale}
        state = self.state
        masks = state.masks  # RigL's, where a kind is sparse
        if not state.places["weights"].remote:
            for part, row in state.part_rows():
                for kind in state.specs[part]:
                    mask = masks.of(part, kind, row, True) if masks is not None else None
                    w, g, m, v = state.load_optimizer_row(part, kind, row)
                    scratch = self._scratch_for(g)
                    decay = kind in DECAYED_KINDS
                    adamw_(w, g, m, v, weight_decay=decay, mask=mask, scratch=scratch, **hyper)
            return
        rows = RowUpdates(self.order)
        if self._on_calling_thread():
            self._host_update(rows, hyper)
            return
        future = self._host_thread().submit(self._host_update, rows, hyper)
        if self.overlap:
            state.updating, self._in_flight = rows, future
            return
        future.result()

    def finish(self) -> None:
        """Waits for the update in flight, if any (its error, if it raised, is raised here)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            try:
                future.result()
            finally:
                if self.state.updating is not None:
                    self.behind = self.state.updating.report()
                self.state.updating = None

    @torch.no_grad()
    def _host_update(self, rows: RowUpdates, hyper: dict) -> None:
        """Every host shard's update, piece by piece in row order (on the host thread); each
        row is marked as its last piece is written."""
        state, masks = self.state, self.state.masks
        current = None
        try:
            for part, kind, row, piece, tensors in state.host_update_pieces(self.order):
                if current is not None and current != (part, row):
                    rows.finished(*current)
                current = (part, row)
                # Meta tensors (a dry run) hold nothing to compute, and the host's update is
                # priced by its elements (Window.host_update_elements), not by its ops.
                if not tensors[0].is_meta:
                    mask = masks.of(part, kind, row, False) if masks is not None else None
                    adamw_(
                        *tensors,
                        weight_decay=kind in DECAYED_KINDS,
                        mask=None if mask is None else mask[piece],
                        scratch=self._scratch_for(tensors[1]),
                        **hyper,
                    )
                state.refresh_weight_copy(part, kind, row, piece)
            if current is not None:
                rows.finished(*current)
        except BaseException as error:
            rows.failed(error)
            raise

"""Movement of state: every load to the compute device and every store back to a buffer.

The phase bodies (:mod:`execution.phases`) only ever see device tensors; this module knows
where each state lives (:class:`~execution.buffers.Place`) and what a load costs there. A load
from host memory is a real copy; state held on the device is used in place. The RTS all-gather
of weights and the tp1 all-gather of the (tp1-sharded) activations x also happen here, so a
phase receives whole tensor-parallel shards.
"""

from __future__ import annotations

import torch

from execution.buffers import (
    GRAD_STATES,
    WEIGHT_STATES,
    ActivationBuffers,
    ActivationLayout,
    FlatSpec,
    PartBuffers,
    Place,
    part_rows,
)
from execution.layout import ParallelLayout
from modelling.gpt import PARTS
from modelling.parallel import Axis


class StateStore:
    """Buffers of one rank and the loads and stores between them and the compute device.

    Args:
        specs: Per part and kind, how parameters pack into flat shards.
        layers: Decoder layers.
        rts: RTS group of each kind.
        layout: This rank's parallel geometry.
        places: Place of ``weights`` (with the AdamW moments), ``grads`` and ``activations``.
        activations: Sizes of the activation buffers.
    """

    def __init__(self, specs: dict[str, dict[str, FlatSpec]], layers: int, rts: dict[str, Axis],
                 layout: ParallelLayout, places: dict[str, Place],
                 activations: ActivationLayout):  # fmt: skip
        self.specs = specs
        self.rts = rts
        self.device = layout.device
        self.tp1 = layout.tp1
        self.places = places
        by_state = {s: places["weights"] for s in WEIGHT_STATES}
        by_state.update({s: places["grads"] for s in GRAD_STATES})
        self.parts = {
            part: PartBuffers(specs[part], part_rows(part, layers), by_state) for part in PARTS
        }
        self.activations = ActivationBuffers(activations, places["activations"])
        # Bytes copied over the host link, by direction (the dry run reports them).
        self.host_to_device = 0
        self.device_to_host = 0

    # ------------------------------------------------------------------ generic moves

    def _load(self, t: torch.Tensor, place: Place, dtype: torch.dtype | None = None):
        """A device tensor of a buffer: a real copy from the host, the buffer itself otherwise
        (a dtype conversion still makes a new tensor)."""
        if place.remote:
            self.host_to_device += t.numel() * t.element_size()
        return t.to(self.device, dtype, non_blocking=True, copy=place.remote)

    def _store(self, target: torch.Tensor, value: torch.Tensor, place: Place) -> None:
        if place.remote:
            self.device_to_host += target.numel() * target.element_size()
        target.copy_(value, non_blocking=True)

    # ------------------------------------------------------------------ weights

    def load_weights(self, part: str, row: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A part's weights on the device in ``dtype``, RTS shards gathered, named views."""
        weights = {}
        for kind, spec in self.specs[part].items():
            shard = self._load(self.parts[part].weights[kind][row], self.places["weights"], dtype)
            weights.update(spec.views(self.rts[kind].all_gather(shard)))
        return weights

    # ------------------------------------------------------------------ gradients

    def accumulate_grads(self, part: str, row: int, shards: dict[str, torch.Tensor],
                         first: bool) -> dict[str, torch.Tensor]:  # fmt: skip
        """Adds reduced gradient shards to the part's accumulators (``first``: replaces them).

        Returns the accumulated shards on the device (for the global norm).
        """
        place = self.places["grads"]
        out = {}
        for kind, shard in shards.items():
            stored = self.parts[part].grads[kind][row]
            if not first:
                shard = self._load(stored, place) + shard
            self._store(stored, shard, place)
            out[kind] = shard
        return out

    # ------------------------------------------------------------------ optimizer state

    def load_optimizer_row(self, part: str, kind: str, row: int) -> list[torch.Tensor]:
        """Weights, gradient and both moments of one row of one kind, on the device."""
        buffers = self.parts[part]
        return [
            self._load(getattr(buffers, s)[kind][row], self.places[_group(s)])
            for s in PartBuffers.STATES
        ]

    def store_optimizer_row(self, part: str, kind: str, row: int,
                            updated: list[torch.Tensor]) -> None:  # fmt: skip
        """Writes back updated weights and moments (gradients are read-only in the update)."""
        if not self.places["weights"].remote:
            return  # updated in place
        buffers = self.parts[part]
        for state, value in zip(PartBuffers.STATES, updated, strict=True):
            if state not in GRAD_STATES:
                self._store(getattr(buffers, state)[kind][row], value, self.places["weights"])

    # ------------------------------------------------------------------ activations

    def store_x(self, boundary: int, entry: int, y: torch.Tensor) -> None:
        """Stores this rank's tp1 slice of the residual stream at a layer boundary."""
        layout = self.activations.layout
        flat = y.reshape(-1)
        if self.tp1.size > 1:
            padded = torch.nn.functional.pad(
                flat, (0, layout.x_shard * self.tp1.size - flat.numel())
            )
            flat = padded.view(self.tp1.size, -1)[self.tp1.rank]
        self._store(self.activations.x[boundary, entry], flat, self.places["activations"])

    def fetch_x(self, boundary: int, entry: int) -> torch.Tensor:
        """The whole local residual stream ``[micro_batch, seq, h/tp2]`` at a layer boundary."""
        layout = self.activations.layout
        shard = self._load(self.activations.x[boundary, entry], self.places["activations"])
        full = self.tp1.all_gather(shard)[: layout.entry_numel]
        return full.view(*layout.tokens, layout.hidden).detach()

    def store_dx(self, boundary: int, entry: int, dx: torch.Tensor) -> None:
        """Stores the gradient at a layer boundary (rows alternate: only two are ever live)."""
        self._store(self.activations.dx[boundary % 2, entry], dx, self.places["activations"])

    def fetch_dx(self, boundary: int, entry: int) -> torch.Tensor:
        return self._load(self.activations.dx[boundary % 2, entry], self.places["activations"])

    # ------------------------------------------------------------------ accounting

    def nbytes(self) -> dict[str, int]:
        """Bytes of buffers held, by state: weights, optimizer, grads, activations."""
        out = {"weights": 0, "optimizer": 0, "grads": 0}
        for buffers in self.parts.values():
            for state, n in buffers.nbytes().items():
                key = state if state in ("weights", "grads") else "optimizer"
                out[key] += n
        out["activations"] = self.activations.nbytes()
        return out


def _group(state: str) -> str:
    return "grads" if state in GRAD_STATES else "weights"

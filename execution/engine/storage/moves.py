"""Copies between buffers and the compute device, and the activations' moves.

:class:`Mover` is the one place a buffer becomes a device tensor (a real copy from the host,
the buffer itself on the device) and a device tensor goes back, counting the bytes that cross
the host link (:class:`Traffic`; the dry run reports them and tests hold them to the plan).

:class:`ActivationStore` is a rank's activation buffers with their moves: the residual stream
x at each layer boundary (this rank's tp1 slice), the gradients dx, and the tensors a layer
keeps for its backward. Stores to host memory run on the store side stream
(:mod:`execution.engine.storage.streams`): the copy of one micro-batch's output overlaps the next one's
compute, and each entry's next load waits for the event of its store. The kept tensors travel
the same way, so a layer forward's copies to the host do not hold up the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from execution.engine.storage.buffers import ActivationBuffers, ActivationLayout, Place
from modelling.parallel import Axis


@dataclass
class Traffic:
    """Bytes copied over the host link, by direction."""

    host_to_device: int = 0
    device_to_host: int = 0


class Mover:
    """Loads buffers to the compute device and stores device tensors back, counting the
    bytes that cross the host link."""

    def __init__(self, device: torch.device, traffic: Traffic):
        self.device, self.traffic = device, traffic

    def load(self, t: torch.Tensor, place: Place, dtype: torch.dtype | None = None):
        """A device tensor of a buffer: a real copy from the host, the buffer itself otherwise
        (a dtype conversion still makes a new tensor)."""
        if place.remote:
            self.traffic.host_to_device += t.numel() * t.element_size()
        return t.to(self.device, dtype, non_blocking=True, copy=place.remote)

    def store(self, target: torch.Tensor, value: torch.Tensor, place: Place) -> None:
        if place.remote:
            self.traffic.device_to_host += target.numel() * target.element_size()
        target.copy_(value, non_blocking=True)


class ActivationStore(ActivationBuffers):
    """The activation buffers of one rank and every move in and out of them.

    Args:
        layout: Sizes of the buffers.
        place: Where they live.
        tp1: The axis x is sliced over at layer boundaries.
        mover: Copies to and from the device, counted.
        stores: The side stream of stores to host memory.
    """

    def __init__(
        self, layout: ActivationLayout, place: Place, tp1: Axis, mover: Mover, stores
    ) -> None:
        super().__init__(layout, place)
        self.place, self.tp1, self.mover, self.stores = place, tp1, mover, stores
        # Stores in flight on the store stream: buffer entry (or kept region) -> event.
        self._in_flight: dict[tuple, object] = {}

    def store_x(self, boundary: int, entry: int, y: torch.Tensor) -> None:
        """Stores this rank's tp1 slice of the residual stream at a layer boundary."""
        flat = y.reshape(-1)
        if self.tp1.size > 1:
            padded = torch.nn.functional.pad(
                flat, (0, self.layout.x_shard * self.tp1.size - flat.numel())
            )
            flat = padded.view(self.tp1.size, -1)[self.tp1.rank]
        self._store(("x", boundary, entry), self.x[boundary, entry], flat)

    def fetch_x(self, boundary: int, entry: int) -> torch.Tensor:
        """The whole local residual stream ``[micro_batch, seq, h/tp2]`` at a layer boundary."""
        layout = self.layout
        shard = self._load(("x", boundary, entry), self.x[boundary, entry])
        full = self.tp1.all_gather(shard)[: layout.entry_numel]
        return full.view(*layout.tokens, layout.hidden).detach()

    def store_dx(self, boundary: int, entry: int, dx: torch.Tensor) -> None:
        """Stores the gradient at a layer boundary (rows alternate: only two are ever live;
        one pass's entries, as one backward runs at a time)."""
        row, entry = boundary % 2, entry % self.layout.entries
        self._store(("dx", row, entry), self.dx[row, entry], dx)

    def fetch_dx(self, boundary: int, entry: int) -> torch.Tensor:
        row, entry = boundary % 2, entry % self.layout.entries
        return self._load(("dx", row, entry), self.dx[row, entry])

    def x_slices(self, boundary: int, entries: range) -> torch.Tensor:
        """This rank's tp1 slices of x at a boundary for consecutive entries, on the device:
        what a pipeline stage sends to the next."""
        return torch.stack([self._load(("x", boundary, e), self.x[boundary, e]) for e in entries])

    def put_x_slices(self, boundary: int, entries: range, slices: torch.Tensor) -> None:
        """Stores tp1 slices of x received from the previous stage (inverse of
        :meth:`x_slices`)."""
        for e, flat in zip(entries, slices, strict=True):
            self._store(("x", boundary, e), self.x[boundary, e], flat)

    def dx_entries(self, boundary: int, entries: range) -> torch.Tensor:
        """The gradients at a boundary for consecutive entries, on the device."""
        return torch.stack([self.fetch_dx(boundary, e) for e in entries])

    def store_kept(self, target: torch.Tensor, value: torch.Tensor) -> None:
        """Copies a tensor a layer keeps for its backward into its region of ``kept``."""
        self._store(_region(target), target, value)

    def load_kept(self, source: torch.Tensor) -> torch.Tensor:
        """A kept tensor on the device: a copy from the host, else the region itself."""
        return self._load(_region(source), source)

    def _store(self, key: tuple, target: torch.Tensor, value: torch.Tensor) -> None:
        """Stores into a region; to host memory, on the store stream.

        The store stream first waits for the compute stream (the kernels that made ``value``,
        and earlier reads of this region, which x, the two dx rows and the kept regions
        reuse), records an event that the region's next load waits for, and keeps ``value``'s
        memory from being reused until the copy is done (``record_stream``).
        """
        if not self.place.remote:
            self.mover.store(target, value, self.place)  # in stream order: nothing to wait for
            return
        self.mover.traffic.device_to_host += target.numel() * target.element_size()

        def copy() -> None:  # may run later, under another grad mode: never recorded
            with torch.no_grad():
                target.copy_(value, non_blocking=True)

        self._in_flight[key] = self.stores.submit(copy, [target], inputs=[value])

    def _load(self, key: tuple, source: torch.Tensor) -> torch.Tensor:
        """Loads a region once its store (if still in flight) has completed."""
        stored = self._in_flight.pop(key, None)
        if stored is not None:  # later loads of the region follow this wait in stream order
            self.stores.wait(stored)
        return self.mover.load(source, self.place)


def _region(t: torch.Tensor) -> tuple:
    """A kept region's key: where it starts in the buffer, and its size."""
    return ("kept", t.data_ptr(), t.numel() * t.element_size())

"""The step's gradients in their buffers: accumulated pass after pass, summed across pipeline
stages where tied, and read by the optimizer.

Gradients placed on the device accumulate in place. Gradients placed in host memory are
stored on the store side stream (:mod:`execution.engine.storage.streams`), like activations, so the
copy to the host runs behind the next phase's compute; the row's next load (the next pass's
accumulation) waits for the event of its store, and :meth:`GradientStore.settle` waits for all
of them once the phases are done, before the norm, the tied sum and the optimizer read them.

A host AdamW update of gradients kept on the device reads them through two pinned staging
buffers of at most :data:`STAGING_ELEMENTS` each (:meth:`GradientStore.host_update_pieces`):
the copy of the next piece runs on the update's own stream while the host updates this one,
instead of a blocking copy to pageable memory per row. That stream is the update thread's
alone: running behind the next step, its copies queue behind nothing the step issues.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from execution.engine.storage.buffers import FlatSpec, PartBuffers, Place
from execution.engine.storage.moves import Mover
from modelling.parallel import Axis

# Float32 elements per staging buffer: 16 MiB each, two of them; the copy of one piece runs
# while the host updates the other.
STAGING_ELEMENTS = 1 << 22


def staging_elements(specs: dict[str, dict[str, FlatSpec]], rows: dict[str, int]) -> int:
    """Elements of each staging buffer: the largest shard a host update reads, capped."""
    largest = max(
        (spec.shard for part, kinds in specs.items() if rows[part] for spec in kinds.values()),
        default=0,
    )
    return min(largest, STAGING_ELEMENTS)


def needs_staging(weights: str, grads: str) -> bool:
    """Host-placed weights are updated by the host, which then reads device-kept gradients."""
    return weights == "host" and grads == "device"


class GradientStore:
    """One rank's gradient buffers and every move in and out of them.

    Args:
        parts: The part buffers (their ``grads`` rows).
        specs: Per part and kind, how parameters pack into flat shards.
        places: Where weights and gradients live.
        mover: Copies to and from the device, counted.
        stores: The side stream of stores to host memory.
        staging_stream: The side stream of the host update's staging copies
            (:func:`~execution.engine.storage.streams.update_stream`; default: ``stores``).
    """

    def __init__(
        self,
        parts: dict[str, PartBuffers],
        specs: dict[str, dict[str, FlatSpec]],
        places: dict[str, Place],
        mover: Mover,
        stores,
        staging_stream=None,
    ):
        self.parts, self.specs, self.mover, self.stores = parts, specs, mover, stores
        self.staging_stream = staging_stream or stores
        self.place = places["grads"]
        self._in_flight: dict[tuple, object] = {}  # (part, kind, row) -> event of its store
        self.staging: list[torch.Tensor] = []
        if needs_staging("host" if places["weights"].remote else "device", self.place_name):
            size = staging_elements(specs, {p: b.rows for p, b in parts.items()})
            self.staging = [places["weights"].empty((size,), torch.float32) for _ in range(2)]

    @property
    def place_name(self) -> str:
        return "host" if self.place.remote else "device"

    def row(self, part: str, kind: str, row: int) -> torch.Tensor:
        """A row of the buffers, once its store (if one is in flight) has completed."""
        event = self._in_flight.pop((part, kind, row), None)
        if event is not None:
            self.stores.wait(event)
        return self.parts[part].grads[kind][row]

    def settle(self) -> None:
        """Waits (on the host) for every gradient store in flight: after the phases, before
        anything reads the gradients where they are (norm, tied sum, optimizer, checkpoint)."""
        for event in self._in_flight.values():
            self.stores.synchronize(event)
        self._in_flight.clear()

    def accumulate(
        self, part: str, row: int, shards: dict[str, torch.Tensor], first: bool
    ) -> dict[str, torch.Tensor]:
        """Adds reduced gradient shards to the part's accumulators (``first``: replaces them).

        Returns the accumulated shards on the device (for the global norm).
        """
        out = {}
        for kind, shard in shards.items():
            if not self.place.remote:  # in place: no new tensor per pass
                stored = self.parts[part].grads[kind][row]
                if first:
                    stored.copy_(shard)
                else:
                    stored.add_(shard)
                out[kind] = stored
                continue
            stored = self.row(part, kind, row)
            if not first:
                shard = self.mover.load(stored, self.place) + shard
            self._store((part, kind, row), stored, shard)
            out[kind] = shard
        return out

    def _store(self, key: tuple, target: torch.Tensor, value: torch.Tensor) -> None:
        self.mover.traffic.device_to_host += target.numel() * target.element_size()

        def copy() -> None:  # may run later, under another grad mode: never recorded
            with torch.no_grad():
                target.copy_(value, non_blocking=True)

        self._in_flight[key] = self.stores.submit(copy, [target], inputs=[value])

    def all_reduce(self, part: str, row: int, axis: Axis) -> list[torch.Tensor]:
        """Sums one row of a part's gradients over ``axis``, in place (the word embedding
        tied across the first and last pipeline stage); returns the sums on the device."""
        summed = []
        for kind in self.specs[part]:
            stored = self.row(part, kind, row)
            total = axis.all_reduce_(self.mover.load(stored, self.place).clone())
            self.mover.store(stored, total, self.place)
            summed.append(total)
        return summed

    def host_update_pieces(
        self, rows: list[tuple[str, int]]
    ) -> Iterator[tuple[str, str, int, slice, torch.Tensor]]:
        """(part, kind, row, piece, gradient) for every piece of every row, the gradient in
        host memory: the buffer itself where gradients live on the host, else a staging
        buffer that the piece was copied into while the caller updated the previous piece.

        The caller must be done with a piece before asking for the next: its staging buffer
        takes the piece after next.
        """
        if not self.staging:
            for part, row in rows:
                for kind in self.specs[part]:
                    grads = self.parts[part].grads[kind][row]
                    yield part, kind, row, slice(0, grads.numel()), grads
            return
        size = self.staging[0].numel()
        pieces = [
            (part, kind, row, slice(start, min(start + size, spec.shard)))
            for part, row in rows
            for kind, spec in self.specs[part].items()
            for start in range(0, spec.shard, max(size, 1))
        ]
        events = {0: self._stage(pieces[0], 0)} if pieces else {}
        for index, (part, kind, row, piece) in enumerate(pieces):
            if index + 1 < len(pieces):  # behind this piece's update on the host
                events[index + 1] = self._stage(pieces[index + 1], (index + 1) % 2)
            self.staging_stream.synchronize(events.pop(index))
            staged = self.staging[index % 2][: piece.stop - piece.start]
            yield part, kind, row, piece, staged

    def _stage(self, piece: tuple, buffer: int):
        """Copies one piece of a device-kept gradient row into a staging buffer, on the staging
        stream (the step's last accumulation was synchronised before the update began)."""
        part, kind, row, span = piece
        source = self.parts[part].grads[kind][row][span]
        target = self.staging[buffer][: span.stop - span.start]
        self.mover.traffic.device_to_host += source.numel() * source.element_size()

        def copy() -> None:
            target.copy_(source, non_blocking=True)

        return self.staging_stream.submit(copy, [target], inputs=[source])

    def nbytes(self) -> int:
        """Bytes of the staging buffers."""
        return sum(t.numel() * t.element_size() for t in self.staging)

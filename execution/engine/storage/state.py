"""Movement of state: every load to the compute device and every store back to a buffer.

The phase bodies (:mod:`execution.engine.phases.bodies`) only ever see device tensors; this module knows
where each state lives (:class:`~execution.engine.storage.buffers.Place`) and what a load costs there. A load
from host memory is a real copy; state held on the device is used in place. The RTS all-gather
of weights and the tp1 all-gather of the (tp1-sharded) activations x also happen here, so a
phase receives whole tensor-parallel shards.

Weights placed on the host are loaded from compute-dtype copies kept beside the float32 masters
(:func:`~execution.engine.storage.buffers.weight_copy_dtype`): half the bytes over the link, the same values,
since the cast is the same round-to-nearest whether done at the load or once after the update.

Prefetch: :meth:`StateStore.prefetch_weights` issues a part's load one phase early and keeps
it for the next :meth:`~StateStore.load_weights` of that part. On CUDA the copies run on a side
stream, which first waits for everything queued so far on the compute stream (for device
weights, the optimizer's updates of them), and records an event; ``load_weights`` makes the compute
stream wait for that event and marks the shards as used there (``record_stream``, so the
caching allocator does not hand their memory to the side stream while the phase still reads
them). With ``--overlap_communication`` the RTS all-gather of the shards is started at the
prefetch too, as an async collective (from the side stream on CUDA, so it waits for those
copies only; NCCL runs it on its own stream, gloo on its own thread), and ``load_weights`` waits
for it. Otherwise the all-gather runs at ``load_weights``, synchronously. Either way every rank
issues its collectives in the same order, since every rank runs the same schedule. The engine
prefetches the next phase's parts just before running the current phase, so at most two
phases' weights (two layers) are on the device: the running phase's and the next one's.

Activations, and the tensors layers keep for their backward, are stored to host memory on a
second side stream (:class:`~execution.engine.storage.moves.ActivationStore`, ``state.activations``).
Gradient stores stay on the compute stream, which reads them back in stream order. Host
weights are updated by the host itself, after the step's norm has synchronised the device;
with ``--overlap_update`` behind the next step, whose load of a row (or its prefetch) waits
for that row's update (:attr:`StateStore.updating`, :mod:`execution.engine.storage.row_updates`). On
a CPU or meta device there are no streams: prefetch is the same copy, one phase early, and
stores happen in program order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from execution.engine.storage.buffers import (
    GRAD_STATES,
    PART_STATES,
    WEIGHT_STATES,
    ActivationLayout,
    FlatSpec,
    PartBuffers,
    Place,
    rows_of,
    weight_copy_dtype,
)
from execution.engine.storage.fixed_buffers import FixedLayerBuffers
from execution.engine.storage.gradient_store import GradientStore
from execution.engine.storage.masks import SPARSE_KIND, SPARSE_PART, SparseMasks
from execution.engine.storage.moves import ActivationStore, Mover, Traffic
from execution.engine.storage.row_updates import RowUpdates
from execution.engine.storage.streams import side_streams, update_stream
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import LAYERS, PARTS
from modelling.parallel import Axis


def _traffic(direction: str) -> property:
    """Bytes copied over the host link one way, counted in the store's :class:`Traffic`
    (read and reset by the dry run and the tests)."""
    return property(
        lambda store: getattr(store.traffic, direction),
        lambda store, nbytes: setattr(store.traffic, direction, nbytes),
    )


class StateStore:
    """Buffers of one rank and the loads and stores between them and the compute device.

    Args:
        specs: Per part and kind, how parameters pack into flat shards.
        layers: Decoder layers this rank holds (its pipeline stage's).
        rts: RTS group of each kind.
        layout: This rank's parallel geometry.
        places: Place of ``weights`` (with the AdamW moments), ``grads`` and ``activations``.
        activations: Sizes of the activation buffers (their dtype is the compute dtype).
    """

    host_to_device = _traffic("host_to_device")
    device_to_host = _traffic("device_to_host")

    def __init__(
        self,
        specs: dict[str, dict[str, FlatSpec]],
        layers: int,
        rts: dict[str, Axis],
        layout: ParallelLayout,
        places: dict[str, Place],
        activations: ActivationLayout,
        rows: dict[str, int] | None = None,
        first_layer: int = 0,
        sparse: bool = False,
        fixed_layer_buffers: bool = False,
    ):
        """``rows``: buffer rows of each part (default: every part, ``layers`` decoder layers);
        a pipeline stage holds some parts only. ``first_layer``: the global index of its first
        decoder layer. ``sparse``: keep RigL's masks of the decoder layers' matrices (:attr:`masks`).
        ``fixed_layer_buffers``: load the decoder layers' weights into two fixed device
        buffers in turn (:mod:`~execution.engine.storage.fixed_buffers`)."""
        self.specs = specs
        self.first_layer = first_layer
        self.rts = rts
        self.device = layout.device
        self.places = places
        by_state = {s: places["weights"] for s in WEIGHT_STATES}
        by_state.update({s: places["grads"] for s in GRAD_STATES})
        self.copy_dtype = weight_copy_dtype(places["weights"].remote, activations.dtype)
        rows = rows or {part: rows_of(part, layers) for part in PARTS}
        self.parts = {
            part: PartBuffers(specs[part], rows[part], by_state, self.copy_dtype) for part in PARTS
        }
        # Bytes copied over the host link, by direction (the dry run reports them).
        self.traffic = Traffic()
        self.mover = Mover(self.device, self.traffic)
        # Loads issued ahead: (part, row, dtype) -> (device shards per kind, CUDA event or None,
        # the async RTS all-gathers of the shards per kind or None).
        self._prefetched: dict[tuple, tuple[dict[str, torch.Tensor], object, dict | None]] = {}
        self.prefetch_hits = 0  # loads served by a prefetch (tests check prefetch is used)
        # A side stream for loads issued ahead and one for activation stores to host.
        self.loads, self.stores = side_streams(self.device)
        self.activations = ActivationStore(
            activations, places["activations"], layout.tp1, self.mover, self.stores
        )
        staging = update_stream(self.device)  # the host update's, behind the next step
        self.grads = GradientStore(self.parts, specs, places, self.mover, self.stores, staging)
        # The host update of the last step, where it runs behind this one (row_updates.py).
        self.updating: RowUpdates | None = None
        self.fixed = FixedLayerBuffers(self.device) if fixed_layer_buffers else None
        self.masks: SparseMasks | None = None
        if sparse:
            spec = specs[SPARSE_PART][SPARSE_KIND]
            place = places["weights"]
            self.masks = SparseMasks(spec, rows[SPARSE_PART], place, self.mover)

    def host_buffers(self) -> Iterator[torch.Tensor]:
        """The buffers placed in host memory: what a copy crossing the host link reads or
        writes on the host side."""
        for buffers in self.parts.values():
            for state in (*PART_STATES, "weight_copies"):
                place = buffers.places["weights" if state == "weight_copies" else state]
                if place.remote:
                    yield from getattr(buffers, state).values()
        if self.places["activations"].remote:
            yield from (self.activations.x, self.activations.dx, self.activations.kept)
        if self.places["weights"].remote:
            yield from self.grads.staging
            if self.masks is not None:
                yield self.masks.rows

    # ------------------------------------------------------------------ weights

    def _weight_shards(self, part: str, row: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """This rank's RTS shard of each kind on the device in ``dtype``, not yet gathered:
        from the compute-dtype copies where kept, else cast from the float32 masters."""
        self.await_update(part, row)
        buffers, place = self.parts[part], self.places["weights"]
        if dtype == self.copy_dtype:
            return {
                kind: self.mover.load(t[row], place) for kind, t in buffers.weight_copies.items()
            }
        return {kind: self.mover.load(t[row], place, dtype) for kind, t in buffers.weights.items()}

    def prefetch_weights(self, part: str, row: int, dtype: torch.dtype, gather: bool) -> None:
        """Starts loading a part's weights for the next :meth:`load_weights` of it.

        Host-placed weights are copied ahead; with ``gather``, the RTS all-gather of the
        shards is started too (an async collective), so the whole load runs behind the current
        phase. Device weights with nothing to gather are used in place, not prefetched. A part
        already waiting to be loaded is not loaded twice.
        """
        key = (part, row, dtype)
        place = self.places["weights"]
        if key in self._prefetched or not (gather or place.remote):
            return
        # Its copy reads the updated weights. Waited for here, not skipped while pending: a
        # skip would depend on timing, and with gather, every rank must issue the same
        # collectives in the same order.
        self.await_update(part, row)
        buffers = self.parts[part]
        stored = buffers.weight_copies if dtype == self.copy_dtype else buffers.weights
        sources = {kind: t[row] for kind, t in stored.items()}
        if place.remote or any(t.dtype != dtype for t in sources.values()):
            with self.loads.allocating():  # on CUDA, memory of the copy stream
                shards = {
                    kind: torch.empty(t.shape, dtype=dtype, device=self.device)
                    for kind, t in sources.items()
                }
            if place.remote:
                self.host_to_device += sum(t.numel() * t.element_size() for t in sources.values())

            def copy() -> None:
                for kind, t in sources.items():
                    shards[kind].copy_(t, non_blocking=True)

            # After the compute stream's work so far (for device weights, the optimizer's
            # updates); the load waits for it.
            ready = self.loads.submit(copy, list(shards.values()))
        else:  # used in place: nothing to copy
            shards, ready = sources, None
        # Issued on the copy stream, so the collective runs after these copies only.
        with self.loads.issue():
            gathers = self._start_gathers(part, shards, gather)
        self._prefetched[key] = (shards, ready, gathers)

    def _start_gathers(self, part: str, shards: dict[str, torch.Tensor], gather: bool):
        """Async RTS all-gathers of a part's shards per kind (None: gathered at the load)."""
        if not gather:
            return None
        return {kind: self.rts[kind].start_all_gather(shards[kind]) for kind in self.specs[part]}

    def drop_prefetched(self) -> int:
        """Forgets loads issued ahead and never used (0 after a whole schedule); returns how many."""
        dropped = len(self._prefetched)
        self._prefetched.clear()
        return dropped

    def load_weights(self, part: str, row: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A part's weights on the device in ``dtype``, RTS shards gathered, named views."""
        weights = {}
        for kind, full in self.load_weight_vectors(part, row, dtype).items():
            weights.update(self.specs[part][kind].views(full))
        return weights

    def load_weight_vectors(
        self, part: str, row: int, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """A part's weights on the device in ``dtype``: per kind, the gathered packed vector
        (:meth:`load_weights` gives named views into them)."""
        prefetched = self._prefetched.pop((part, row, dtype), None)
        gathers = None
        if prefetched is None:
            shards = self._weight_shards(part, row, dtype)
        else:
            self.prefetch_hits += 1
            shards, ready, gathers = prefetched
            if ready is not None:
                self.loads.wait(ready, list(shards.values()))
        vectors = {}
        for kind in self.specs[part]:
            if gathers is None:
                full = self.rts[kind].all_gather(shards[kind])
            else:  # started a phase ago; on CUDA the compute stream now waits for it
                full = gathers[kind].wait()
                if full is not shards[kind]:  # made on the copy stream
                    self.loads.wait(None, [full])
            vectors[kind] = full
        if part == LAYERS and self.fixed is not None:
            return self.fixed.hold(vectors)
        return vectors

    def prefetch_would_wait(self, part: str, row: int, gather: bool) -> bool:
        """Whether a prefetch of (part, row) now would block on the update in flight, and
        issuing it later would change no collective's order (none to start: ``gather`` off,
        or an RTS group of one for each of the part's kinds). The engine then issues it after
        the current phase, which so waits only for its own rows (a timing-dependent order is
        safe only where no other rank has to match it)."""
        if self.updating is None or not self.updating.pending(part, row):
            return False
        return not gather or all(self.rts[kind].size == 1 for kind in self.specs[part])

    def prefetch_unless_waiting(
        self, loads: list[tuple[str, int]], dtype: torch.dtype, gather: bool
    ) -> list[tuple[str, int]]:
        """Prefetches each of ``loads`` but those :meth:`prefetch_would_wait` for, which it
        returns: the caller issues them after the phase it is about to run."""
        later = [(part, row) for part, row in loads if self.prefetch_would_wait(part, row, gather)]
        for part, row in loads:
            if (part, row) not in later:
                self.prefetch_weights(part, row, dtype, gather)
        return later

    def await_update(self, part: str, row: int) -> None:
        """Returns once the update in flight, if any, has written (part, row)."""
        if self.updating is not None:
            self.updating.wait(part, row)

    def await_updates(self) -> None:
        """Returns once the update in flight, if any, has written every row."""
        if self.updating is not None:
            self.updating.wait_all()

    def part_rows(self) -> list[tuple[str, int]]:
        """Every (part, row) held, in order: the embedding, each decoder layer, the head."""
        return [(part, row) for part in PARTS for row in range(self.parts[part].rows)]

    def logical_row(self, part: str, row: int) -> int:
        """The model's index of a buffer row: its global layer for the decoder layers."""
        return self.first_layer + row if part == LAYERS else row

    def write_shard(self, part: str, row: int, state: str, local: dict[str, torch.Tensor]) -> None:
        """Stores this rank's RTS slice of a part's tensor-parallel shards (padded, named as in
        :class:`modelling.gpt.GPT`) into one row of ``state``."""
        for kind, spec in self.specs[part].items():
            flat = spec.pack(local).view(spec.rts_size, spec.shard)[self.rts[kind].rank]
            self.write_row(part, state, kind, row, flat)

    def write_row(self, part: str, state: str, kind: str, row: int, flat: torch.Tensor) -> None:
        """Writes one row of a state from outside a step (initialisation, checkpoints); weights
        refresh their compute-dtype copy, and loads issued ahead are forgotten."""
        self.await_updates()
        buffers = self.parts[part]
        getattr(buffers, state)[kind][row].copy_(flat)
        if state == "weights" and buffers.weight_copies:
            buffers.weight_copies[kind][row].copy_(flat)
        self.drop_prefetched()

    def weights_written(self) -> None:
        """After weights were written into the buffers in place (a checkpoint load): refresh
        their compute-dtype copies, and forget loads issued ahead."""
        self.await_updates()
        for buffers in self.parts.values():
            for kind, copy in buffers.weight_copies.items():
                copy.copy_(buffers.weights[kind])
        self.drop_prefetched()

    # ------------------------------------------------------------------ optimizer state

    def load_optimizer_row(self, part: str, kind: str, row: int) -> list[torch.Tensor]:
        """Weights, gradient and both moments of one row of one kind, on the device (for
        device-placed weights; host-placed ones are updated where they are, see
        :meth:`host_update_pieces`)."""
        self.await_update(part, row)
        buffers = self.parts[part]
        self.grads.row(part, kind, row)  # its store to the host, if in flight, is done
        return [
            self.mover.load(getattr(buffers, s)[kind][row], self.places[_group(s)])
            for s in PART_STATES
        ]

    def host_update_pieces(
        self, rows: list[tuple[str, int]]
    ) -> Iterator[tuple[str, str, int, slice, list[torch.Tensor]]]:
        """(part, kind, row, piece, [weights, gradient, exp_avg, exp_avg_sq]) of each of
        ``rows`` in turn, piece by piece, all in host memory, for an update in place there: the
        gradient through staging where it is kept on the device
        (:meth:`GradientStore.host_update_pieces`), the rest the buffers themselves (nothing
        else crosses the host link)."""
        assert self.places["weights"].remote, "host update of weights that live on the device"
        for part, kind, row, piece, grad in self.grads.host_update_pieces(rows):
            buffers = self.parts[part]
            rest = (buffers.weights, buffers.exp_avg, buffers.exp_avg_sq)
            w, m, v = (state[kind][row][piece] for state in rest)
            yield part, kind, row, piece, [w, grad, m, v]

    def refresh_weight_copy(self, part: str, kind: str, row: int, piece: slice) -> None:
        """After a host update: the compute-dtype copy of a piece of a row, cast on the host
        (the same round-to-nearest as on a device), where copies are kept."""
        buffers = self.parts[part]
        if buffers.weight_copies:
            buffers.weight_copies[kind][row][piece].copy_(buffers.weights[kind][row][piece])

    # ------------------------------------------------------------------ accounting

    def nbytes(self) -> dict[str, int]:
        """Bytes of buffers held, by state: weights, optimizer, grads, weight_copies, masks,
        activations, staging."""
        out = {"weights": 0, "optimizer": 0, "grads": 0, "weight_copies": 0}
        if self.masks is not None:  # a sparse run's
            out["masks"] = self.masks.nbytes()
        for buffers in self.parts.values():
            for state, n in buffers.nbytes().items():
                key = state if state in ("weights", "grads", "weight_copies") else "optimizer"
                out[key] += n
        out["activations"] = self.activations.nbytes()
        out["staging"] = self.grads.nbytes()
        return out


def _group(state: str) -> str:
    return "grads" if state in GRAD_STATES else "weights"

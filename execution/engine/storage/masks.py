"""RigL's masks as a state of the store: one byte per weight of the sparse matrices.

The decoder layers' matrices (one kind, ``matrix``, of part ``layers``: qkv, out, fc, proj)
are the sparse weights, so a mask is a ``[rows, shard] bool`` tensor beside that kind's
weights, sharded exactly as they are (tensor-parallel shard, packed, this rank's RTS slice)
and placed where they are. The padding of the packed vector is never active.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from execution.engine.storage.buffers import FlatSpec, Place
from execution.engine.storage.moves import Mover
from execution.parallel.sharding import MATRIX
from modelling.gpt import LAYERS
from modelling.sparsity import LAYER_MATRICES

# (part, kind) of the buffers that are sparse.
SPARSE_PART, SPARSE_KIND = LAYERS, MATRIX


def check_sparse_spec(spec: FlatSpec) -> None:
    """The sparse kind packs only the layer's matrices (so a mask row is theirs alone)."""
    assert set(spec.names) <= set(LAYER_MATRICES), f"sparse kind holds {spec.names}"


class SparseMasks:
    """The masks of one rank's decoder layers, and their moves to the compute device.

    Args:
        spec: How the sparse kind's tensors pack into a row.
        rows: Decoder layers this rank holds.
        place: Where the weights live (the masks live with them).
        mover: Copies to the device, counted as host-link traffic.
    """

    @staticmethod
    def planned_nbytes(spec: FlatSpec, rows: int) -> int:
        """Bytes the masks of ``rows`` layers will take: one per element of a row's shard."""
        return rows * spec.shard

    def __init__(self, spec: FlatSpec, rows: int, place: Place, mover: Mover):
        check_sparse_spec(spec)
        self.spec, self.place, self.mover = spec, place, mover
        self.rows = place.zeros((rows, spec.shard), torch.bool)

    def row(self, row: int) -> torch.Tensor:
        """One layer's mask where it lives (for updates in host memory)."""
        return self.rows[row]

    def device_row(self, row: int) -> torch.Tensor:
        """One layer's mask on the compute device (a copy from host memory)."""
        return self.mover.load(self.rows[row], self.place)

    def of(self, part: str, kind: str, row: int, on_device: bool) -> torch.Tensor | None:
        """The mask of a (part, kind) row, or None where that kind is dense."""
        if (part, kind) != (SPARSE_PART, SPARSE_KIND):
            return None
        return self.device_row(row) if on_device else self.row(row)

    def masked(self, part: str, row: int, shards: dict[str, torch.Tensor]) -> Iterable:
        """Gradient shards of a (part, row) with the sparse kind's inactive entries zeroed:
        what the optimizer applies, and so what the global norm measures."""
        for kind, shard in shards.items():
            mask = self.of(part, kind, row, on_device=True)
            yield shard if mask is None else shard * mask

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

"""DCP planners that write and read the chunks a rank holds, straight from and into its buffers.

``torch.distributed.checkpoint`` saves a state dict by asking a *planner* what to write (write
items: a box of a logical tensor each) and, item by item, for the data; it loads by asking which
boxes are wanted and where to put each read. These planners answer with the rank's own
:class:`~execution.checkpoint.chunks.Chunk` boxes and with views of its buffer rows, so:

- a save writes each held byte once and exchanges only DCP's plans and metadata (objects);
  the data is copied one chunk (at most ``MAX_CHUNK_BYTES``) at a time as it is written;
- a load reads only the saved chunks that overlap the rank's boxes, one saved chunk at a
  time, and copies each straight into the buffers: no logical tensor is ever assembled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from execution.checkpoint.chunks import MAX_CHUNK_BYTES, Chunk, held_chunks
from execution.checkpoint.files import MASKS, SAVED_STATES, sparse_names
from execution.engine.engine import PhasedEngine
from execution.engine.storage.masks import SPARSE_KIND, SPARSE_PART
from modelling.gpt import EMBEDDING, logical_shapes, qualified_name


@dataclass(frozen=True)
class HeldItem:
    """One chunk of one saved state of one part row: a box of the logical tensor ``key``."""

    key: str
    chunk: Chunk
    state: str
    part: str
    row: int


def held_items(
    engine: PhasedEngine, max_chunk_bytes: int = MAX_CHUNK_BYTES, saving: bool = False
) -> list[HeldItem]:
    """Every chunk of the saved states (weights and AdamW moments) this rank's buffers hold.

    ``saving``: only those this rank writes. The last pipeline stage holds a copy of the word
    embedding (tied to its head), identical to the first stage's, which writes it; both read it.
    """
    layout = engine.layout
    tp = (layout.tp1.rank, layout.tp2.rank)
    rts = {kind: axis.rank for kind, axis in engine.rts.items()}
    per_part = {
        part: held_chunks(part, engine.specs[part], engine.shapes, tp, rts, max_chunk_bytes)
        for part in engine.specs
    }
    copy = saving and engine.stage.count > 1 and not engine.stage.is_first
    logical = engine.state.logical_row
    items = [
        HeldItem(f"{state}/{qualified_name(part, logical(part, row), c.name)}", c, state, part, row)
        for part, row in engine.state.part_rows()
        if not (copy and part == EMBEDDING)
        for state in SAVED_STATES
        for c in per_part[part]
    ]
    if engine.state.masks is not None:  # RigL's masks: chunks of the sparse kind's
        items += [
            HeldItem(
                f"{MASKS}/{qualified_name(part, logical(part, row), c.name)}", c, MASKS, part, row
            )
            for part, row in engine.state.part_rows()
            if part == SPARSE_PART
            for c in per_part[part]
            if c.kind == SPARSE_KIND
        ]
    return items


def item_bytes(items: list[HeldItem]) -> int:
    return sum(item.chunk.numel for item in items) * 4


# Where an item's buffer row is: (state, part, kind, row) -> a [shard] float32 tensor.
RowOf = Callable[[HeldItem], torch.Tensor]


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes ``items`` from the rows ``row_of`` gives, beside a plain state dict (RNG state).

    Args:
        items: This rank's chunks.
        logical: Logical shape of every saved tensor, by checkpoint key.
        row_of: The buffer row (live, or a staged copy) an item is read from.
        on_all_read: Called once every item has been copied out of its row (the rows may
            change from then on).
        before_writing: Called as the plan is made, before anything is written: an error it
            raises fails the save on every rank (DCP gathers it), with nothing written.
    """

    def __init__(
        self,
        items: list[HeldItem],
        logical: dict[str, torch.Size],
        row_of: RowOf,
        on_all_read: Callable[[], None],
        before_writing: Callable[[], None] | None = None,
    ):
        super().__init__()
        self._before_writing = before_writing
        self._items = {(i.key, i.chunk.offsets): i for i in items}
        self._logical = logical
        self._row_of = row_of
        self._on_all_read = on_all_read
        self._left = len(items)
        self._staging: torch.Tensor | None = None
        if not items:
            on_all_read()

    @staticmethod
    def writer(folder):
        """The storage writer these plans need: items resolved one at a time, in order."""
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(folder, thread_count=1, per_thread_copy_ahead=0)

    def create_local_plan(self):
        if self._before_writing is not None:
            self._before_writing()
        plan = super().create_local_plan()
        properties = TensorProperties(dtype=torch.float32)
        chunks = [
            WriteItem(
                index=MetadataIndex(item.key, torch.Size(item.chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(item.chunk.offsets), sizes=torch.Size(item.chunk.sizes)
                    ),
                    properties=properties,
                    size=self._logical[item.key],
                ),
            )
            for item in self._items.values()
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *chunks])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        item = self._items.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if item is None:
            return super().resolve_data(write_item)
        # Copied (the row may change once every item is read) into the one staging buffer:
        # items are resolved one at a time, each after the previous one is written (see
        # ``writer``). DCP's writer keeps a reference to every tensor it wrote until the file
        # is done (for a safetensors path we do not use); fresh copies would all stay alive,
        # views of the staging buffer cost nothing. The view owns exactly its bytes, so the
        # writer does not copy it again.
        n = item.chunk.numel
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(i.chunk.numel for i in self._items.values()))
        data = torch.frombuffer(self._staging.numpy(), dtype=torch.float32, count=n)
        data = data.view(item.chunk.sizes).copy_(item.chunk.view(self._row_of(item)))
        self._left -= 1
        if self._left == 0:
            self._on_all_read()
        return data


class ChunkLoadPlanner(LoadPlanner):
    """Reads the saved chunks that overlap ``items`` straight into the rows ``row_of`` gives."""

    def __init__(self, items: list[HeldItem], row_of: RowOf):
        self._by_key: dict[str, list[HeldItem]] = {}
        for item in items:
            self._by_key.setdefault(item.key, []).append(item)
        self._row_of = row_of

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        reads = []
        for key, items in self._by_key.items():
            wanted = [
                ChunkStorageMetadata(torch.Size(i.chunk.offsets), torch.Size(i.chunk.sizes))
                for i in items
            ]
            reads += create_read_items_for_chunk_list(key, stored[key], wanted)
        return LoadPlan(reads)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise AssertionError(f"no byte items are read: {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        item = self._by_key[read_item.dest_index.fqn][read_item.dest_index.index]
        box = item.chunk.view(self._row_of(item))
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            box = box.narrow(dim, start, length)
        return box

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # written in place


def logical_sizes(engine: PhasedEngine) -> dict[str, torch.Size]:
    """Checkpoint key -> logical shape of every saved tensor."""
    shapes = logical_shapes(engine.shapes)
    sizes = {
        f"{s}/{name}": torch.Size(shape) for s in SAVED_STATES for name, shape in shapes.items()
    }
    if engine.state.masks is not None:
        sizes.update(
            {f"{MASKS}/{name}": torch.Size(shapes[name]) for name in sparse_names(engine.shapes)}
        )
    return sizes

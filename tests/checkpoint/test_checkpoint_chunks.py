"""The chunks a rank holds are exactly the logical boxes its buffers store, each byte once.

Reference: the sharding the engine itself uses to fill its buffers (``shard_part``, packing,
the RTS slice), applied to logical tensors whose every element is distinct. Each chunk's view
of a rank's buffer row must equal its box of the logical tensor, and the boxes of all ranks
must cover every logical element exactly once (padding in none).
"""

from __future__ import annotations

import pytest
import torch

from execution.checkpoint.chunks import held_chunks
from execution.engine.storage.buffers import flat_specs
from execution.parallel.mesh import MeshShape
from execution.parallel.sharding import RTS_AXES, SHARD_KINDS, rts_sizes, shard_part
from modelling.gpt import PARTS, GPTShapes, logical_shapes, part_inits, qualified_name
from tests.distributed import small_config


@pytest.mark.parametrize(
    ("dp", "tp1", "tp2", "cp", "max_chunk_bytes"),
    [
        (1, 1, 1, 1, 1 << 30),
        (2, 2, 2, 1, 1 << 30),
        (4, 1, 2, 1, 1 << 30),
        (3, 4, 1, 1, 1 << 30),
        (2, 2, 1, 2, 96),
    ],
)
def test_chunks_tile_every_logical_tensor_once(dp, tp1, tp2, cp, max_chunk_bytes):
    config = small_config("--layers", "2")
    shapes = GPTShapes.from_config(config.model, tp1, tp2)
    specs = flat_specs(shapes, rts_sizes(dp, tp1, tp2, cp))
    logical = {
        name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 0.5
        for name, shape in logical_shapes(shapes).items()
    }
    covered = {name: torch.zeros(t.shape, dtype=torch.int64) for name, t in logical.items()}
    mesh = MeshShape(dp, tp1, tp2, cp)
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        rts = {kind: mesh.members(RTS_AXES[kind], rank).index(rank) for kind in SHARD_KINDS}
        for part in PARTS:
            chunks = held_chunks(part, specs[part], shapes, (c["i"], c["j"]), rts, max_chunk_bytes)
            for row in range(shapes.layers if part == "layers" else 1):
                full = {n: logical[qualified_name(part, row, n)] for n in part_inits(shapes, part)}
                local = shard_part(part, full, shapes, c["i"], c["j"])
                rows = {
                    kind: spec.pack(local).view(spec.rts_size, spec.shard)[rts[kind]]
                    for kind, spec in specs[part].items()
                }
                for chunk in chunks:
                    name = qualified_name(part, row, chunk.name)
                    box = tuple(
                        slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True)
                    )
                    assert chunk.numel * 4 <= max(max_chunk_bytes, 4 * chunk.sizes[-1])
                    assert torch.equal(chunk.view(rows[chunk.kind]), logical[name][box]), name
                    covered[name][box] += 1
    for name, count in covered.items():
        assert torch.all(count == 1), (name, count.min().item(), count.max().item())

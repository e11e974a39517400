"""What saving a checkpoint costs a rank, from its plan: the bytes it writes, what it stages on
the host, and how long training is held. The dry run prints it and ``--plan_for`` shows it
per layout."""

from __future__ import annotations

from execution.checkpoint.chunks import MAX_CHUNK_BYTES, held_chunks
from execution.engine.phases.schedule import Stage
from execution.engine.plan import MemoryPlan
from execution.engine.storage.buffers import WEIGHT_STATES, flat_specs
from execution.parallel.sharding import RTS_AXES, rts_sizes
from execution.planning.device_specs import DeviceSpec
from execution.planning.run_shape import RunShape
from modelling.gpt import EMBEDDING, PARTS


def checkpoint_figures(
    run: RunShape, plan: MemoryPlan, spec: DeviceSpec, rank: int = 0
) -> dict[str, float]:
    """What saving a checkpoint costs ``rank`` (:mod:`execution.checkpoint.save`).

    A rank writes exactly the chunks of logical tensors it holds (weights and both AdamW
    moments, padding excluded) and sends no tensor data to other ranks. State on the device is
    first copied to host memory (staged: the training loop waits for that copy); state on the
    host is written from its buffers, one chunk copied at a time.
    """
    mesh, shapes = run.mesh, run.shards()
    specs = flat_specs(shapes, rts_sizes(mesh.dp, mesh.tp1, mesh.tp2, mesh.cp))
    coords = mesh.coords(rank)
    rts = {kind: mesh.members(axis, rank).index(rank) for kind, axis in RTS_AXES.items()}
    # Counted whole: cut to MAX_CHUNK_BYTES, a model of terabytes per rank is a list of
    # millions of chunks, and the count is the same.
    per_row = {
        part: sum(
            c.numel
            for c in held_chunks(
                part, specs[part], shapes, (coords["i"], coords["j"]), rts, max_chunk_bytes=1 << 63
            )
        )
        for part in PARTS
    }
    # A stage writes the rows it holds; the last stage's copy of the tied embedding is the
    # first stage's to write.
    stage = Stage.of(run.stage_layers, coords["p"], run.model.task_head is not None)
    rows = {p: stage.rows(p) for p in PARTS}
    if stage.count > 1 and not stage.is_first:
        rows[EMBEDDING] = 0
    written = 4 * len(WEIGHT_STATES) * sum(per_row[p] * rows[p] for p in PARTS)
    on_device = plan.placement.weights == "device"
    held = written / (spec.host_link_gb_per_s * 1e9) if on_device else 0.0
    return {
        "bytes_written": written,
        "tensor_bytes_sent": 0,  # only DCP's plans and index travel (tests count it)
        "staging_bytes": (written if on_device else 0) + MAX_CHUNK_BYTES,
        "held_s": held,
        "save_s": held + written / (spec.storage_gb_per_s * 1e9),
        "storage_gb_per_s": spec.storage_gb_per_s,
    }

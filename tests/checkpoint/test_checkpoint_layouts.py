"""Checkpoints across layouts (forked gloo ranks on CPU): what a save sends, what it writes, and
what a resume on another layout computes.

Saved at (dp, tp1, tp2) = (2, 2, 2), everything on the host, 2 passes, after two steps. The
references are independent of the chunked save and load: an uninterrupted single-process run
of the same three steps, and, for a bfloat16 resume, the same layout started from the saved
state read whole by DCP's default planner and sharded through the logical path.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d

from execution.checkpoint.dcp_plans import held_items, item_bytes
from execution.checkpoint.files import dcp_load, resolve, stored_shapes
from execution.checkpoint.load import load_checkpoint
from execution.checkpoint.logical import full_state, write_part_state
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import logical_shapes, part_inits, qualified_name
from tests.distributed import (
    CPU,
    FLOAT32_TOLERANCE,
    assert_states_close,
    engine_batch,
    global_batches,
    layout_flags,
    learning_rates,
    planned_engine,
    run_ranks,
    single_process_run,
    small_config,
    train_steps,
    world_layout,
)

pytestmark = pytest.mark.distributed
STEPS = 3
SAVED_FLAGS = (*layout_flags(2, 2, 2), "--placement", "remote", "--passes", "2")
# Every collective that carries tensors, and those that carry pickled objects (DCP's plans).
TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
OBJECT_COLLECTIVES = (
    "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list",
)  # fmt: skip


class _CollectiveSpy:
    """Records every tensor collective issued outside an object collective, and every tensor
    found inside the objects sent, while installed in place of torch.distributed's functions."""

    def __init__(self):
        self.tensor_calls: list[str] = []
        self.tensors_in_objects: list[tuple] = []
        self._depth = 0
        self._saved = []

    def _patch(self, name, make):
        for module in (dist, distributed_c10d):
            if hasattr(module, name):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, make(getattr(module, name)))

    def __enter__(self):
        for name in TENSOR_COLLECTIVES:
            self._patch(name, self._tensor_wrapper(name))
        for name in OBJECT_COLLECTIVES:
            self._patch(name, self._object_wrapper)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)

    def _tensor_wrapper(self, name):
        def make(original):
            def wrapped(*args, **kwargs):
                if self._depth == 0:
                    self.tensor_calls.append(name)
                return original(*args, **kwargs)

            return wrapped

        return make

    def _object_wrapper(self, original):
        spy = self

        class Finder(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, dist.ProcessGroup):
                    return "group"  # an argument, not sent
                if isinstance(obj, torch.Tensor) and obj.numel():
                    spy.tensors_in_objects.append(tuple(obj.shape))
                return None

        def wrapped(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                Finder(_Sink()).dump(value)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapped


class _Sink:
    def write(self, data):
        pass


def _save(config, batches, folder):
    engine = planned_engine(config, world_layout(config))
    steps = train_steps(engine, batches[: STEPS - 1], engine.layout.dp.rank)
    checkpointer = Checkpointer(folder, engine, config, log=lambda _: None)
    before = {axis.name: sum(axis.calls.values()) for axis in engine.layout.axes()}
    with _CollectiveSpy() as spy:
        checkpointer.save(STEPS - 1, None)
        checkpointer.close()
    after = {axis.name: sum(axis.calls.values()) for axis in engine.layout.axes()}
    return {
        "steps": steps,
        "next": _next_step(engine, batches, STEPS - 1),  # uninterrupted
        "engine_collectives": {k: after[k] - before[k] for k in after},
        "tensor_calls": spy.tensor_calls,
        "tensors_in_objects": spy.tensors_in_objects,
        "held_bytes": item_bytes(held_items(engine)),
    }


def _resume(config, batches, folder, layout=None):
    engine = planned_engine(config, layout or world_layout(config))
    trainer = load_checkpoint(folder, engine)
    return _next_step(engine, batches, trainer["step"])


def _next_step(engine, batches, step):
    batch = engine_batch(engine, batches[step], engine.layout.dp.rank)
    result = engine.train_step(batch, step, learning_rates(STEPS)[step])
    return {"step": step, "loss": result.loss, "weights": full_state(engine, "weights")}


def _started_from(config, batches, state, optimizer_steps):
    """The reference for a resume: the same layout given the state by the logical path."""
    engine = planned_engine(config, world_layout(config))
    for part, row in engine.state.part_rows():
        for s, tensors in state.items():
            names = part_inits(engine.shapes, part)
            write_part_state(engine, part, row, s, {n: tensors[qualified_name(part, row, n)]
                                                     for n in names})  # fmt: skip
    engine.optimizer_steps = optimizer_steps
    return _next_step(engine, batches, STEPS - 1)


def _chunks_per_rank(folder):
    """Elements each rank's files hold, and how often each logical element is stored."""
    metadata = dcp.FileSystemReader(folder).read_metadata()
    per_rank: dict[int, int] = {}
    covered = {}
    for key, tensor in metadata.state_dict_metadata.items():
        if key.startswith("rng/"):
            continue
        count = covered[key] = torch.zeros(tuple(tensor.size), dtype=torch.int32)
        for chunk in tensor.chunks:
            index = dcp.metadata.MetadataIndex(key, chunk.offsets)
            rank = int(metadata.storage_data[index].relative_path.split("_")[2])
            per_rank[rank] = per_rank.get(rank, 0) + chunk.sizes.numel()
            count[
                tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            ] += 1
    return per_rank, covered


def test_save_sends_no_tensor_data_and_each_rank_writes_what_it_holds_once(tmp_path):
    config = small_config(*SAVED_FLAGS)
    batches = global_batches(config, STEPS)
    folder = tmp_path / "ckpt"
    saved = run_ranks(_save, 8, tmp_path / "save", config, batches, folder)
    for rank, got in enumerate(saved):
        assert got["tensor_calls"] == [], (rank, got["tensor_calls"])
        assert got["tensors_in_objects"] == [], (rank, got["tensors_in_objects"])
        assert not any(got["engine_collectives"].values()), (rank, got["engine_collectives"])

    per_rank, covered = _chunks_per_rank(folder / f"step_{STEPS - 1}")
    assert per_rank == {r: got["held_bytes"] // 4 for r, got in enumerate(saved)}
    shapes = planned_engine(small_config(), ParallelLayout.single(CPU)).shapes
    logical = logical_shapes(shapes)
    assert set(covered) == {f"{s}/{n}" for s in ("weights", "exp_avg", "exp_avg_sq")
                            for n in logical}  # fmt: skip
    for key, count in covered.items():
        assert torch.all(count == 1), (key, count.min().item(), count.max().item())
    total = sum(torch.Size(shape).numel() for shape in logical.values())
    assert sum(per_rank.values()) == 3 * total


def test_save_on_one_layout_resume_on_others(tmp_path):
    saved_config = small_config(*SAVED_FLAGS)
    batches = global_batches(saved_config, STEPS)
    reference = single_process_run(saved_config, batches)
    folder = tmp_path / "ckpt"
    saved = run_ranks(_save, 8, tmp_path / "save", saved_config, batches, folder)
    for got, want in zip(saved[0]["steps"], reference["steps"], strict=False):
        assert abs(got["loss"] - want["loss"]) <= FLOAT32_TOLERANCE * want["loss"]

    config_412 = small_config(*layout_flags(4, 1, 2))
    resident_111 = small_config("--placement", "resident", "--passes", "4")
    resumes = {
        "(1, 1, 1) resident, 4 passes": _resume(
            resident_111, batches, folder, ParallelLayout.single(CPU)
        ),
        "(4, 1, 2)": run_ranks(_resume, 8, tmp_path / "r412", config_412, batches, folder)[0],
        "sequence over 2 context ranks": run_ranks(
            _resume, 2, tmp_path / "cp2", small_config(*layout_flags(1, 1, 1, 2)), batches, folder
        )[0],
    }
    same = run_ranks(_resume, 8, tmp_path / "r222", saved_config, batches, folder)[0]
    assert same["loss"] == saved[0]["next"]["loss"], "a resume on the same layout is bitwise"
    for name, t in saved[0]["next"]["weights"].items():
        assert torch.equal(same["weights"][name], t), name
    expected_loss = reference["steps"][STEPS - 1]["loss"]
    for name, got in resumes.items():
        assert got["step"] == STEPS - 1, name
        assert abs(got["loss"] - expected_loss) <= FLOAT32_TOLERANCE * expected_loss, (
            name,
            got["loss"],
            expected_loss,
        )
        assert_states_close(got["weights"], reference["weights"], FLOAT32_TOLERANCE, name)


def test_a_float32_checkpoint_resumes_in_bfloat16_on_another_layout(tmp_path):
    """The resumed bfloat16 step at (1, 2, 1) equals the same step started from the saved
    state read whole by DCP's default planner and sharded through the logical path."""
    saved_config = small_config(*SAVED_FLAGS)
    batches = global_batches(saved_config, STEPS)
    folder = tmp_path / "ckpt"
    run_ranks(_save, 8, tmp_path / "save", saved_config, batches, folder)
    # The saved state as whole tensors, read by DCP's own planner (not the chunk planner).
    step = resolve(folder)
    keys = {k: torch.empty(shape) for k, shape in stored_shapes(step).items() if "/" in k}
    dcp_load(keys, step)
    state = {s: {} for s in ("weights", "exp_avg", "exp_avg_sq")}
    for key, t in keys.items():
        s, name = key.split("/", 1)
        if s in state:
            state[s][name] = t

    bf16 = small_config(*layout_flags(1, 2, 1), "--precision", "bfloat16")
    got = run_ranks(_resume, 2, tmp_path / "resume", bf16, batches, folder)[0]
    want = run_ranks(_started_from, 2, tmp_path / "ref", bf16, batches, state, STEPS - 1)[0]
    assert abs(got["loss"] - want["loss"]) <= FLOAT32_TOLERANCE * want["loss"]
    assert_states_close(got["weights"], want["weights"], FLOAT32_TOLERANCE, "bfloat16 resume")


def _rss_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field)))


def _load_memory(config, folder):
    engine = planned_engine(config, world_layout(config))
    share = item_bytes(held_items(engine))
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _rss_kib("VmRSS")
    load_checkpoint(folder, engine)
    return {"extra": (_rss_kib("VmHWM") - before) * 1024, "share": share}


def test_a_load_needs_little_more_memory_than_the_rank_s_share(tmp_path):
    """Saved by one process (whole tensors in the files), loaded by 8 ranks at (2, 2, 2): each
    reads only what overlaps its shards, so its peak extra memory (resident set, high-water
    mark reset before the load) stays under 1.5x its share. Reading a decoder layer's three
    states whole, as a load that assembles logical tensors does, would take 2x the share."""
    flags = ["--layers", "4", "--hidden_size", "512", "--heads", "8"]
    saved = small_config(*flags)
    engine = planned_engine(saved, ParallelLayout.single(CPU))
    checkpointer = Checkpointer(tmp_path / "ckpt", engine, saved, log=lambda _: None)
    checkpointer.save(1, None)
    checkpointer.close()
    config = small_config(*flags, *layout_flags(2, 2, 2))
    results = run_ranks(_load_memory, 8, tmp_path / "load", config, tmp_path / "ckpt")
    for rank, got in enumerate(results):
        assert got["extra"] < 1.5 * got["share"], (rank, got)

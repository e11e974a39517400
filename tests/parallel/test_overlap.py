"""Overlapped communication changes when collectives are waited for, never the numbers, and
every rank issues its collectives in the same order."""

from __future__ import annotations

import collections
import shlex

import pytest
import torch
import torch.distributed as dist

from execution.parallel import mesh
from execution.parallel.mesh import ParallelLayout
from tests.distributed import (
    CPU,
    global_batches,
    layout_flags,
    planned_engine,
    relative_error,
    replica_batch,
    run_ranks,
    small_config,
    world_layout,
)

STEPS = 3
# float32, dropout, two passes (so gradients are in flight across a pass boundary too).
FLAGS = shlex.split("--dropout_prob 0.1 --precision float32 --passes 2")
PLACEMENTS = {"device": ["--placement", "resident"], "host": ["--placement", "remote"]}


def _train(config, layout: ParallelLayout) -> dict:
    """3 steps; losses, norms and every buffer this rank holds (its own shards, bit for bit)."""
    engine = planned_engine(config, layout)
    batches = global_batches(config, STEPS)
    results = [
        engine.train_step(replica_batch(config, batches[s], layout.dp.rank), s, 2e-3 * (s + 1))
        for s in range(STEPS)
    ]
    buffers = {
        f"{part} {state} {kind}": t.clone()
        for part, b in engine.state.parts.items()
        for state in ("weights", "grads", "exp_avg", "exp_avg_sq")
        for kind, t in getattr(b, state).items()
    }
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "buffers": buffers,
        "async": sum(
            nbytes * count
            for a in layout.axes()
            for (_, nbytes, asynchronous), count in a.sized_calls.items()
            if asynchronous
        ),
        "recompute": engine.memory.recompute,
    }


def _assert_bitwise(on: dict, off: dict, what: str) -> None:
    assert on["losses"] == off["losses"], (what, on["losses"], off["losses"])
    assert on["norms"] == off["norms"], what
    assert on["buffers"].keys() == off["buffers"].keys()
    for name, t in off["buffers"].items():
        assert torch.equal(on["buffers"][name], t), (what, name)


def _on_and_off(flags: list[str], layout_of) -> dict:
    runs = {}
    for where, placement in PLACEMENTS.items():
        for overlap in ("true", "false"):
            config = small_config(*flags, *placement, "--overlap_communication", overlap)
            runs[where, overlap] = _train(config, layout_of(config))
    return runs


def test_overlap_is_bitwise_equal_in_one_process():
    """One process (every collective a no-op, gradients still completed a phase late):
    overlap on and off give the same losses, norms and buffers, on the device and all-host."""
    runs = _on_and_off(FLAGS, lambda config: ParallelLayout.single(CPU))
    for where in PLACEMENTS:
        _assert_bitwise(runs[where, "true"], runs[where, "false"], where)


def _on_and_off_rank(flags: list[str]) -> dict:
    runs = _on_and_off(flags, world_layout)
    # The planner keeps every activation here (auto: none); full recompute, too, at 2 x 2 x 2.
    full = small_config(*flags, *PLACEMENTS["device"], "--recompute", "full")
    runs["full recompute"] = _train(full, world_layout(full))
    return runs


@pytest.mark.distributed
def test_overlap_is_bitwise_equal_at_2x2x2(tmp_path):
    """(dp, tp1, tp2) = (2, 2, 2): every rank's losses, norms and own buffers are bitwise the
    same with overlap on and off, resident and all-host; with overlap the data-parallel
    traffic really was asynchronous, and without it none was. Layers that keep their
    activations (the planner's choice here) and full recompute agree within 1e-6."""
    flags = [*FLAGS, *layout_flags(2, 2, 2), "--global_batch_size", "8"]
    ranks = run_ranks(_on_and_off_rank, 8, tmp_path, flags, timeout=240)
    for rank, runs in enumerate(ranks):
        for where in PLACEMENTS:
            on, off = runs[where, "true"], runs[where, "false"]
            _assert_bitwise(on, off, f"rank {rank}, {where}")
            assert on["async"] > 0 and off["async"] == 0
        kept, full = runs["device", "true"], runs["full recompute"]
        assert kept["recompute"] != "full" and full["recompute"] == "full"
        for got, want in zip(kept["losses"], full["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (rank, got, want)
        for name, t in full["buffers"].items():
            assert relative_error(kept["buffers"][name], t) <= 1e-6, (rank, name)


# ----------------------------------------------------------------- issue order


def _issue_order_rank(flags: list[str]) -> dict:
    """Every collective this rank issues, in order, as (axis, op, elements, async), for one
    training step with overlap on and one with it off."""
    log: list[tuple] = []
    axis_of: dict = {}

    def recording(op: str, fn):
        def call(*args, group=None, async_op=False, **kwargs):
            tensor = args[0]
            log.append((axis_of.get(group, "world"), op, tensor.numel(), async_op))
            return fn(*args, group=group, async_op=async_op, **kwargs)

        return call

    class RecordingDist:  # torch.distributed with all_reduce recorded
        all_reduce = staticmethod(recording("all_reduce", dist.all_reduce))

        def __getattr__(self, name):
            return getattr(dist, name)

    # Wrap the process-group calls the mesh's axes make (this forked rank only).
    mesh.dist = RecordingDist()
    mesh._all_gather_flat = recording("all_gather", mesh._all_gather_flat)
    mesh._reduce_scatter_flat = recording("reduce_scatter", mesh._reduce_scatter_flat)
    out = {}
    for overlap in ("true", "false"):
        config = small_config(*flags, "--overlap_communication", overlap)
        layout = world_layout(config)
        axis_of.update({axis.group: axis.name for axis in layout.axes() if axis.group})
        engine = planned_engine(config, layout)
        batch = replica_batch(config, global_batches(config, 1)[0], layout.dp.rank)
        log.clear()
        engine.train_step(batch, 0, 2e-3)
        calls = sum(sum(axis.calls.values()) for axis in layout.axes())
        out[overlap] = {"order": list(log), "counted": calls}
    return out


@pytest.mark.distributed
def test_every_rank_issues_collectives_in_the_same_order(tmp_path):
    """Under overlap at (2, 2, 2), with host weights and 2 passes: each rank's sequence of
    (group, op, size, async) is identical on all 8 ranks. It holds every collective the axes
    counted; overlap issues the same collectives as without it, some of them asynchronously
    and in another order (the next phase's all-gathers before this phase's tensor-parallel
    all-reduces)."""
    flags = [*FLAGS, *layout_flags(2, 2, 2), "--global_batch_size", "8", "--placement", "remote"]
    ranks = run_ranks(_issue_order_rank, 8, tmp_path, flags, timeout=240)
    on = [r["true"]["order"] for r in ranks]
    for rank, order in enumerate(on):
        assert order == on[0], f"rank {rank} issues collectives in another order than rank 0"
        assert len(order) == ranks[rank]["true"]["counted"]
    off = ranks[0]["false"]["order"]
    assert any(call[3] for call in on[0]) and not any(call[3] for call in off)
    drop_async = collections.Counter(call[:3] for call in on[0])
    assert drop_async == collections.Counter(call[:3] for call in off)
    assert [call[:3] for call in on[0]] != [call[:3] for call in off]
    groups = {call[0] for call in on[0] if call[3]}
    assert groups <= {"dp", "dp_tp1", "dp_tp2"}, groups  # tensor-parallel traffic stays in line


# ----------------------------------------------------------------- host AdamW


@pytest.mark.parametrize("own_thread", [False, True])
def test_host_weights_are_updated_on_the_host_by_the_host_update_thread(monkeypatch, own_thread):
    """Weights (with their moments) on the host, gradients on the device: every row is
    updated on the host, the optimizer copies nothing to the device and only the gradients to
    the host, and the steps are bitwise those of an all-device run. Waited for, the update
    runs on the calling thread where its team would be the caller's (a second OpenMP team
    stops the first one's threads spinning), else on the host update's thread."""
    import threading

    from execution.engine.update import optimizer

    calls = []
    update = optimizer.adamw_

    def recorded(*args, **kwargs):
        calls.append((args[0].device, threading.current_thread().name))
        return update(*args, **kwargs)

    monkeypatch.setattr(optimizer, "adamw_", recorded)
    flags = [*FLAGS, "--grads_placement", "device", "--activations_placement", "device"]
    host = small_config(*flags, "--weights_placement", "host")
    engine = planned_engine(host, ParallelLayout.single(CPU))
    batch = replica_batch(host, global_batches(host, 1)[0], 0)
    calls.clear()  # the planner's measured step (meta tensors) ran the same code
    # The rank's share of the cores: the calling thread's team, or one more than it.
    engine.optimizer.host_threads = torch.get_num_threads() + own_thread
    engine.train_step(batch, 0, 2e-3)
    rows = sum(len(engine.specs[part]) for part, _ in engine.state.part_rows())
    assert engine.optimizer_steps == 1 and len(calls) == rows
    where = "host-adamw" if own_thread else threading.current_thread().name
    assert all(device.type == "cpu" and name.startswith(where) for device, name in calls)
    engine.state.host_to_device = engine.state.device_to_host = 0
    engine.optimizer.update(1e-3, 1.0)
    grads = sum(t.numel() * 4 for b in engine.state.parts.values() for t in b.grads.values())
    assert (engine.state.host_to_device, engine.state.device_to_host) == (0, grads)

    device = _train(
        small_config(*flags, "--weights_placement", "device"), ParallelLayout.single(CPU)
    )
    _assert_bitwise(_train(host, ParallelLayout.single(CPU)), device, "host AdamW")

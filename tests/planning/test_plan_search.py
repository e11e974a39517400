"""--plan_for's shortcuts give what the long way gives: replayed meta ops, working sets measured
only where a plan may fit, layouts measured in worker processes; which layouts it weighs, and
how it ranks them (by step time, one row per layout, pipelines among them)."""

from __future__ import annotations

import dataclasses
import functools
import shlex

import pytest

from execution.parallel.fake_job import fake_job
from execution.parallel.mesh_shape import MeshShape
from execution.planning import step_meter
from execution.planning.dry_run import measure_planned_step
from execution.planning.measure import Measurements
from execution.planning.memory import MemoryBudget
from execution.planning.micro_batch_limits import divisors_of
from execution.planning.plan_search import layouts, search, spans_nodes, tensor_parallel_floor
from execution.planning.plan_table import layout_rows, print_layouts
from execution.planning.planner import candidate_plans, choose, measured_plans
from execution.planning.run_shape import RunShape
from tests.distributed import layout_flags
from tests.distributed import small_config as distributed_config
from tests.reference import small_config


def _measured(config, monkeypatch, replay: bool):
    """One planned step of rank 0 on meta tensors, with meta results replayed or not."""
    measurements = Measurements()
    if not replay:
        monkeypatch.setattr(measurements.meta_results, "key", lambda *args: None)
    run = RunShape.of(config)
    plan = candidate_plans(run, "cuda")[0]
    with fake_job(0, run.world_size):
        return measure_planned_step(run, plan, run.spec, measurements), measurements


@pytest.mark.parametrize(
    "layout, flags",
    [
        ((2, 2, 2, 1), "--placement remote"),
        ((1, 2, 2, 1), "--placement resident --recompute selective"),
    ],
)
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_replayed_meta_ops_measure_the_same_step(monkeypatch, layout, flags):
    """Replaying recorded meta results (StepMeter) changes none of a step's figures: working
    set, FLOPs, each group's bytes, the per-phase windows and the buffers; and most ops were
    replayed (the cache is used)."""
    run = ["--layers", "3", "--global_batch_size", "8", "--dropout_prob", "0.1"]
    config = distributed_config(*layout_flags(*layout), *run, *shlex.split(flags))
    direct, _ = _measured(config, monkeypatch, replay=False)
    replayed, measurements = _measured(config, monkeypatch, replay=True)
    assert replayed.working_set == direct.working_set > 0
    assert replayed.flops == direct.flops > 0
    assert replayed.comm_bytes == direct.comm_bytes
    assert replayed.phases == direct.phases
    assert replayed.buffer_bytes == direct.buffer_bytes
    recorded = measurements.meta_results._results
    assert sum(result is not None for result in recorded.values()) > 20


def test_views_are_never_replayed_as_fresh_tensors(monkeypatch):
    """``_unsafe_view`` declares no alias but returns a view of its input: it is recorded as
    not replayable, so replaying does not count it as a new allocation."""
    import torch

    def peak(replay: bool) -> int:
        results = step_meter.MetaResults()
        if not replay:
            monkeypatch.setattr(results, "key", lambda *args: None)
        x = torch.empty(4, 6, device="meta")
        with step_meter.StepMeter(results) as meter:
            kept = [torch.ops.aten._unsafe_view(x * 2.0, [24]) for _ in range(3)]
            kept += [torch.ops.aten._unsafe_view(k, [4, 6]) for k in kept]
        view = torch.ops.aten._unsafe_view.default
        assert not any(key[0] is view and result for key, result in results._results.items())
        return meter.peak

    assert peak(replay=True) == peak(replay=False) == 3 * 4 * 6 * 4


def test_working_sets_measured_only_where_a_plan_may_fit_choose_the_same_plans():
    """Everything on the device, with a device budget that keeping every activation cannot fit
    even before a working set: --plan_for's planner call does not measure that mode's working
    set, and finds the same fitting plans, with the same bytes, as measuring every mode."""
    run = "--layers 12 --global_batch_size 16 --micro_batch_size 8 --passes 1 --placement resident"
    run = RunShape.of(distributed_config(*layout_flags(2, 2, 1), *shlex.split(run)))
    plans = measured_plans(run, "cuda")
    assert {p.recompute for p in plans} == {"full", "selective", "none"}
    full = min(p.bytes_on("device")["total"] for p in plans if p.recompute == "full")
    none = min(
        p.bytes_on("device")["total"] - p.working_set for p in plans if p.recompute == "none"
    )
    assert full < none
    budget = MemoryBudget((full + none) // 2, 1 << 50)
    measured = Measurements()
    searched = choose(run, budget, on_miss="nearest", measurements=measured)
    assert searched.fits
    assert [searched.plan, *searched.others] == [p for p in plans if budget.fits(p)]
    assert measured.working_sets and "none" not in {key[-1] for key in measured.working_sets}


@pytest.mark.slow
def test_workers_find_the_rows_one_process_finds():
    """Groups of layouts of 2 devices (dp, pp, cp, tp1, tp2 and micro-batch sizes) measured in
    two forked workers give the same rows, in the same order, as one process measuring them
    again from nothing."""
    run = RunShape.of(small_config("--layers", "1", "--global_batch_size", "2"))
    side_by_side, misfits_by_two, _ = search(run, 2, workers=2)
    alone, misfits, _ = search(run, 2, Measurements(), workers=1)  # from nothing
    assert [m["run"] for m in misfits_by_two] == [m["run"] for m in misfits]
    assert len(side_by_side) == len(alone) > 5

    def figures(row):
        return row["run"], row["plan"], row["step_time_s"], row["mfu"], row["checkpoint"]

    assert [figures(r) for r in side_by_side] == [figures(r) for r in alone]


def test_layouts_spanning_nodes_only_when_asked():
    """Nodes of 2 devices: tensor and context groups of 4 span two nodes, so --plan_for 4
    weighs them only with --plan_across_nodes."""
    flags = ("--layers", "2", "--global_batch_size", "8", "--devices_per_node", "2")
    run = RunShape.of(small_config(*flags))

    def inner_sizes(candidates):
        return {c.mesh.cp * c.mesh.tp1 * c.mesh.tp2 for c in candidates}

    assert inner_sizes(layouts(run, 4)) == {1, 2}
    assert inner_sizes(layouts(run, 4, across_nodes=True)) == {1, 2, 4}


def test_plan_for_where_nothing_fits_says_what_the_nearest_layout_needs(capsys):
    """No empty table: one line with the nearest layout's plan and memory, as --dry_run says."""
    config = small_config("--layers", "1", "--global_batch_size", "4", "--hidden_size", "256")
    config.execution.device_memory_gb = config.execution.host_memory_gb = 0.001
    print_layouts(RunShape.of(config), "small", 2)
    out = capsys.readouterr().out
    assert "0 layouts fit" in out and "step s" not in out  # no table header
    (line,) = [x for x in out.splitlines() if x.startswith("nothing fits")]
    assert "nothing fits on 2 devices: the nearest layout (dp " in line
    assert "GiB of device and" in line and "which may use 0.0 GiB of device memory" in line


def test_the_floor_prices_each_all_reduce_as_a_waited_for_call():
    """On a calibration that measured waiting for a collective (``waited_collective_us``),
    the time model adds that to every waited-for call, so the floor does to each of its
    eight all-reduces per layer and micro-batch: 8 x 1 ms x layers x micro-batches more."""
    flags = "--tensor_parallel_1 2 --tensor_parallel_2 2 --layers 3 --global_batch_size 8"
    run = RunShape.of(small_config(*shlex.split(flags), "--micro_batch_size", "2"))
    waited = dataclasses.replace(run.spec, waited_collective_us=1000.0)
    extra = tensor_parallel_floor(run, waited) - tensor_parallel_floor(run, run.spec)
    assert extra == pytest.approx(8 * 1e-3 * 3 * 4)


@pytest.mark.slow
def test_layouts_spanning_nodes_are_measured_only_where_their_floor_may_win():
    """--plan_across_nodes with nodes of 2 devices and a slow network: every layout's
    tensor-parallel floor is below its own measured estimate (it is a lower bound), and the
    search that prunes by it measures exactly the spanning layouts whose floor is below the
    fastest in-node step, and finds the same rows otherwise."""
    flags = "--layers 1 --global_batch_size 2 --devices_per_node 2 "
    flags += "--sequence_length 64 --max_positional_length 64"  # activations outweigh weights
    run = RunShape.of(small_config(*shlex.split(flags), "--inter_node_gb_per_s", "0.001"))
    spec, across = run.spec, {"across_nodes": True, "workers": 1}
    measurements = Measurements()
    every, _, none_pruned = search(run, 4, measurements, prune=False, **across)
    spans = {id(r): spans_nodes(r["run"].mesh, spec.devices_per_node) for r in every}
    floors = {id(r): tensor_parallel_floor(r["run"], spec) for r in every}
    assert none_pruned == 0 and any(spans.values()) and not all(spans.values())
    for row in every:
        assert floors[id(row)] <= row["step_time_s"], row["run"].describe()
    fastest_within = min(r["step_time_s"] for r in every if not spans[id(r)])
    dropped = [r for r in every if spans[id(r)] and floors[id(r)] >= fastest_within]
    assert dropped, "the slow network should leave some layout no chance"
    kept, _, pruned = search(run, 4, measurements, **across)
    assert pruned == len(dropped)

    def figures(row):
        return row["run"], row["plan"], row["step_time_s"]

    assert [figures(r) for r in kept] == [figures(r) for r in every if r not in dropped]


def test_divisors_come_in_pairs_up_to_the_square_root():
    assert divisors_of(1) == [1]
    assert divisors_of(97) == [1, 97]
    assert divisors_of(12) == [1, 2, 3, 4, 6, 12]
    assert divisors_of(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert len(divisors_of(720720)) == 240  # 2^4 3^2 5 7 11 13: 5 x 3 x 2 x 2 x 2 x 2


@pytest.mark.parametrize(
    "base, layout",
    [
        ("--passes 2", (2, 1, 2, 1, 1, 2)),  # dp, pp, cp, tp1, tp2, micro-batch
        ("--pipeline_parallel 2 --pipeline_layers 3,1", (1, 2, 1, 2, 1, 1)),
        ("--placement remote --recompute full", (1, 1, 1, 2, 2, 4)),
    ],
)
def test_a_layout_of_the_run_shape_is_the_run_shape_of_that_layout_s_config(base, layout):
    """What --plan_for weighs on a mesh (RunShape.with_layout, passes left to the planner and
    the layers split evenly) is what the config of that layout would plan: RunShape.of a copy
    of the config with those flags, as the search made its candidates before."""
    flags = shlex.split(f"--layers 4 --global_batch_size 16 {base}")
    dp, pp, cp, tp1, tp2, micro = layout
    run = RunShape.of(small_config(*flags))
    laid_out = run.with_layout(MeshShape(dp, tp1, tp2, cp, pp), micro, even_stages=True)
    config = small_config(*flags)
    config.execution = dataclasses.replace(
        config.execution,
        data_parallel=dp,
        pipeline_parallel=pp,
        context_parallel=cp,
        tensor_parallel_1=tp1,
        tensor_parallel_2=tp2,
        micro_batch_size=micro,
        passes=0,
        pipeline_layers="",
    )
    assert laid_out.with_request(passes=0) == RunShape.of(config)


def test_layouts_leave_out_steps_of_too_many_micro_batches():
    """131,072 sequences on 2 devices, at most 16,384 micro-batches per replica: a replica of
    dp 2 takes micro-batches of 4 and more, one of dp 1 (tensor, context or pipeline axis of
    2) 8 and more, so no pipeline layout (micro-batches of 1 or 2) is left."""
    candidates = layouts(RunShape.of(small_config("--global_batch_size", "131072")), 2)
    pairs = {(c.mesh.dp, c.micro_batch_size) for c in candidates}
    assert pairs == {(2, 4), (2, 8), (2, 16), (1, 8), (1, 16)}
    assert all(c.mesh.pp == 1 for c in candidates)


def test_layouts_of_a_count_with_many_divisors_keep_to_what_the_model_divides():
    """720720 devices (240 divisors: 240^4 combinations of the four axes before) and 16
    sequences per device: the small model's 4 heads allow tensor_parallel_1 of 1, 2 or 4, and
    with 8 devices a node the tensor and context axes stay within 8; a pipeline only beside
    axes that fill a node, and 720720 = 2^4 x 45045 leaves it 2 of them."""
    candidates = layouts(RunShape.of(small_config("--global_batch_size", str(720720 * 16))), 720720)
    assert candidates
    for c in candidates:
        mesh = c.mesh
        inner = mesh.tp1 * mesh.tp2 * mesh.cp
        assert mesh.world_size == 720720
        assert mesh.tp1 in (1, 2, 4) and inner in (1, 2, 4, 8)
        assert mesh.pp == 1 or (mesh.pp == 2 and inner == 8)
    assert {c.mesh.pp for c in candidates} == {1, 2}


@functools.cache
def _search_four_devices() -> tuple[list[dict], list[dict]]:
    """``--plan_for 4`` of a small model with 4 layers (pipelines of up to 4 stages), shared
    by the tests that read its rows."""
    run = RunShape.of(small_config("--layers", "4", "--global_batch_size", "4"))
    rows, misfits, _ = search(run, 4)
    return rows, misfits


@pytest.mark.slow
def test_plan_for_ranks_layouts_that_fit_by_step_time():
    rows, misfits = _search_four_devices()
    assert rows and not misfits
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)
    meshes = [r["run"].mesh for r in rows]
    layouts = {(m.dp, m.tp1, m.tp2) for m in meshes}
    assert {(4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)} <= layouts
    assert all(m.world_size == 4 for m in meshes)
    # The context axis is searched too: the 16-token sequence over 2 and 4 ranks, alone and
    # beside data parallelism (a 3-way split would not divide it).
    contexts = {(m.dp, m.cp) for m in meshes}
    assert {(1, 4), (2, 2), (1, 2)} <= contexts
    assert all(m.cp in (1, 2, 4) for m in meshes)


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_plan_for_lists_pipeline_layouts_one_row_each():
    """Pipelines of 2 and 4 stages are searched (tensor axes filling what is left of a node),
    with the bubble in their estimate; the table has one row per layout, with the micro-batch
    sizes that tie shown together."""
    rows, _ = _search_four_devices()
    stages = {r["run"].mesh.pp for r in rows}
    assert {1, 2, 4} <= stages
    for row in rows:
        mesh, passes = row["run"].mesh, row["plan"].passes
        s = mesh.pp
        assert row["bubble"] == (s - 1) / (passes + s - 1)
        if s > 1:
            assert mesh.tp1 * mesh.tp2 * mesh.cp == 4 // s
    shown = layout_rows(rows)
    keys = [r["run"].mesh for r in shown]
    assert len(keys) == len(set(keys)) and len(shown) < len(rows)
    assert all(r["micro_batches"] for r in shown)

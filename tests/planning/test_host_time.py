"""The host's time per phase: measured (benchmarks/host_time.py), carried by a device spec into
the time model, queued beside a GPU's kernels or added to a CPU's, and weighed by the planner.
Each figure against a hand computation; nothing here times anything."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex
from collections import Counter

import pytest
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from benchmarks import host_time
from config.loading import parse_config
from execution.engine.phases.binding import WeightSlots
from execution.engine.phases.selective import _RecomputedCore
from execution.engine.plan import MemoryPlan, Placement
from execution.parallel.mesh import ParallelLayout
from execution.planning.calibration import host_phases
from execution.planning.device_specs import SPECS
from execution.planning.dry_run_report import host_line
from execution.planning.measure import Window
from execution.planning.memory import RankShape
from execution.planning.op_costs import OpCosts
from execution.planning.plan_ranking import host_seconds
from execution.planning.run_shape import RunShape
from execution.planning.time_model import COST_INDEX, PHASE_COSTS, estimate_step, phase_costs
from modelling.layers import Attention
from modelling.parallel import LOCAL

LAYOUT = ParallelLayout.shapes_only(1, 1, 1)
# A layer forward measured at 300 us a phase and 200 us a micro-batch, whose phase ran 2
# kernels and 20 more per micro-batch; each kernel's launch 5 us.
MEASURED = (False, "full", False, "layer_forward", 300.0, 200.0, 2.0, 20.0)
SPEC = dataclasses.replace(
    SPECS["h100_sxm"], launch_overhead_us=5.0, phase_overhead_us=40.0, host_phase_us=(MEASURED,)
)


def _window(kind: str, kernels: int, micro_batches: int = 0, rows: int = 0) -> Window:
    calls = {axis.name: Counter() for axis in LAYOUT.axes()}
    return Window(
        kind,
        calls=calls,
        costs=OpCosts(kernels=kernels),
        micro_batches=micro_batches,
        rows=rows,
        run_as=(False, "full", False),
    )


def _host_us(spec, window: Window) -> float:
    costs = phase_costs([window], LAYOUT, spec)[window.kind]
    return (costs[COST_INDEX["launch_s"]] + costs[COST_INDEX["engine_s"]]) * 1e6


def test_a_phase_takes_the_host_time_measured_for_its_kind_and_micro_batches():
    """At the measured phase's kernels (2 + 4 x 20), four micro-batches take what was
    measured: 300 + 4 x 200 us. A phase of the same kind with 10 more kernels per micro-batch
    (another model's layer) adds their launches, 40 x 5 us; a spec without the measurement
    prices the launches and phase_overhead_us (40 us) as before."""
    measured = _window("layer_forward", kernels=2 + 4 * 20, micro_batches=4)
    assert _host_us(SPEC, measured) == pytest.approx(300 + 4 * 200)
    wider = _window("layer_forward", kernels=2 + 4 * 30, micro_batches=4)
    assert _host_us(SPEC, wider) == pytest.approx(300 + 4 * 200 + 40 * 5)
    unmeasured = dataclasses.replace(SPEC, host_phase_us=())
    assert _host_us(unmeasured, measured) == pytest.approx(82 * 5 + 40)


def test_the_update_is_priced_per_row_and_a_head_of_its_own_as_the_tied_one():
    update = (False, "none", True, "optimizer", 50.0, 30.0, 1.0, 4.0)
    head = (False, "full", False, "head", 400.0, 100.0, 4.0, 10.0)
    spec = dataclasses.replace(SPEC, host_phase_us=(update, head))
    assert _host_us(spec, _window("optimizer", kernels=1 + 6 * 4, rows=6)) == pytest.approx(
        50 + 6 * 30
    )
    untied = _window("untied_head", kernels=4 + 3 * 10, micro_batches=3)
    assert _host_us(spec, untied) == pytest.approx(400 + 3 * 100)
    # Looked up as run, else with the other dropout, else with another recompute mode.
    assert spec.host_row(False, "full", True, "optimizer") == update
    assert spec.host_row(True, "full", False, "optimizer") is None


def _costs(**seconds) -> tuple:
    return tuple(seconds.get(name, 0.0) for name in PHASE_COSTS)


def test_a_gpu_s_device_waits_only_where_its_host_falls_behind_a_cpu_adds_them():
    """Two kinds in a pass, kernels and host in ms: (5, 1) then (1, 3). A GPU's host issues
    the second phase by 4 ms while its device runs the first to 5 ms: no wait, 6 ms, where a
    phase taking the longer of each would give 5 + 3. In the other order the host is late
    from the start: the device waits 2 ms in the first phase, then runs to 3 + 5 = 8 ms. A
    CPU runs both on its cores: 10 ms either way."""
    device_bound = _costs(matmul_s=5e-3, engine_s=1e-3)
    host_bound = _costs(matmul_s=1e-3, engine_s=3e-3)
    ahead = estimate_step(
        {"embedding_forward": device_bound, "layer_forward": host_bound}, 1, 1, SPEC
    )
    assert ahead["step_time_s"] == pytest.approx(6e-3)
    assert ahead["host_wait_s"] == pytest.approx(0.0)
    late = estimate_step(
        {"layer_forward": host_bound, "embedding_forward": device_bound}, 1, 1, SPEC
    )
    assert late["step_time_s"] == pytest.approx(8e-3)
    assert late["host_by_kind"]["layer_forward"]["host_bound"] == pytest.approx(2 / 3)
    cpu = dataclasses.replace(SPEC, device_type="cpu")
    phases = {"embedding_forward": device_bound, "layer_forward": host_bound}
    assert estimate_step(phases, 1, 1, cpu)["step_time_s"] == pytest.approx(10e-3)


def test_the_host_runs_ahead_by_no_more_than_the_launch_queue_holds():
    """The first kind: 10 ms of 2,048 kernels (1 us each to launch), so the queue's 1,024
    hold 5 ms of them: the host, done at 2.048 ms, waits for a slot until 10 - 5 = 5 ms. The
    second kind's host then takes 7 ms to its device's 1: the device waits from 11 to 12 ms,
    half that phase's time (with an endless queue the host would have ended at 9.048 ms, and
    the step at 11)."""
    spec = dataclasses.replace(SPEC, launch_overhead_us=1.0)
    first = _costs(matmul_s=10e-3, launch_s=2048e-6)
    second = _costs(matmul_s=1e-3, engine_s=7e-3)
    estimate = estimate_step({"embedding_forward": first, "layer_forward": second}, 1, 1, spec)
    assert estimate["step_time_s"] == pytest.approx(12e-3)
    assert estimate["host_by_kind"]["layer_forward"]["host_bound"] == pytest.approx(1 / 2)


def test_the_planner_counts_each_phase_s_host_time_per_pass_and_micro_batch():
    """tiny (2 layers) at 8 micro-batches in 2 passes: each layer forward phase 300 us, each
    micro-batch 200 us, so 2 x (2 x 300 + 8 x 200) us; nothing measured for the backward."""
    config, _ = parse_config(
        shlex.split("--config tiny --global_batch_size 8 --micro_batch_size 1")
    )
    run = dataclasses.replace(RunShape.of(config), spec=SPEC, compile="false")
    plan = MemoryPlan(
        passes=2,
        micro_batches_per_pass=4,
        placement=Placement("device", "device", "device"),
        state_bytes={},
        working_set=0,
        traffic=0,
        shared_memory=False,
        recompute="full",
        kept=0,
    )
    host = host_seconds(run, RankShape.of(run), plan)
    assert host["forward"] == pytest.approx(2 * (2 * 300 + 8 * 200) * 1e-6)
    assert host["backward"] == 0.0


def test_the_fit_is_a_line_through_the_medians_and_never_below_zero():
    assert host_phases._fit({2: [7.0, 5.0, 6.0], 8: [9.0]}) == pytest.approx((5.0, 0.5))
    # A negative intercept puts it all on the slope, through the origin.
    assert host_phases._fit({2: [1.0], 8: [7.0]}) == pytest.approx((0.0, 58 / 68))


def _pass(per_unit_us: float) -> dict:
    """One pass of a way: a layer forward of 100 us a phase and ``per_unit_us`` a
    micro-batch (its total 100 + 8 x per_unit_us)."""
    fields = dict.fromkeys(("kernel_us_per_phase", "kernel_us_per_unit", "samples"), 0.0)
    fields |= {"kernels_per_phase": 1.0, "kernels_per_unit": 2.0}
    m = fields | {"per_phase_us": 100.0, "per_unit_us": per_unit_us, "trusted": True}
    return {"layer_forward": m}


def test_each_way_is_measured_in_passes_apart_until_two_agree(monkeypatch):
    """Way A's passes agree at once (totals 900 and 980: 8.9% apart); way B's first pass ran
    slow (1700, against 900 and 950: 89% and 5.6%), so a third is taken and the two that
    agree are used; way C never agrees (totals 500, 1000, 2000, 4000): the closest two,
    marked not to be trusted."""
    scripted = {"A": [100, 110], "B": [200, 100, 106.25], "C": [50, 112.5, 237.5, 487.5]}
    calls = []

    def measure(flags, device, steps, compiled, recompute, spec):
        way = recompute
        calls.append(way)
        return _pass(scripted[way][calls.count(way) - 1])

    monkeypatch.setattr(host_phases, "measure", measure)
    ways = [(False, name, 0.0) for name in "ABC"]
    result = host_phases.host_phase_rows(torch.device("cpu"), 2, ways, SPEC)
    # Every way's first pass before any second, and only the unsettled go on.
    assert calls == ["A", "B", "C", "A", "B", "C", "B", "C", "C"]
    rows = {row[1]: row for row in result["rows"]}
    assert rows["A"][4:8] == pytest.approx([100.0, 105.0, 1.0, 2.0])
    assert rows["B"][5] == pytest.approx((100 + 106.25) / 2)
    assert rows["C"][5] == pytest.approx((50 + 112.5) / 2)  # 500 and 1000: 100% apart
    timing = {run["recompute"]: run["timing"] for run in result["runs"]}
    assert timing["A"] == {"trusted": True, "spread": pytest.approx(80 / 900)}
    assert timing["B"] == {"trusted": True, "spread": pytest.approx(50 / 900)}
    assert timing["C"] == {"trusted": False, "spread": pytest.approx(1.0)}


def test_a_template_bound_once_computes_as_functional_call_and_holds_nothing_after():
    block = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Linear(3, 2))
    weights = {name: torch.randn_like(p) for name, p in block.named_parameters()}
    originals = {name: p for name, p in block.named_parameters()}
    x = torch.randn(5, 4)
    slots = WeightSlots(block)
    with slots.bound(weights):
        y = block(x)
    assert torch.equal(y, functional_call(block, weights, (x,)))
    assert all(p is originals[name] for name, p in block.named_parameters())


def test_the_recomputed_core_gives_checkpoint_s_output_and_gradients_to_the_bit():
    attention = Attention(16, 4, 4, 0.0, LOCAL, LOCAL)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 4, generator=generator) for _ in range(3))
    grad = torch.randn(2, 4, 8, 4, generator=generator)
    results = []
    for run in (
        lambda a, b, c: _RecomputedCore.apply(attention.core, None, a, b, c),
        lambda a, b, c: checkpoint(attention.core, a, b, c, None, use_reentrant=False),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, grad)])
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)


def test_the_dry_run_line_gives_device_over_host_and_says_when_nothing_was_measured():
    entry = {
        "host_by_kind": {
            "layer_forward": {"device_s": 3.0, "host_s": 1.5, "host_bound": 0.0},
            "optimizer": {"device_s": 0.2, "host_s": 0.0, "host_bound": 0.0},
        }
    }
    line = host_line(entry, measured=True)
    assert (
        line == "host (device / host time, host-bound share): layer_forward 2.0x 0%, optimizer - 0%"
    )
    assert "holds no measured host time per phase" in host_line(entry, measured=False)


@pytest.mark.slow  # two tiny models' steps, eager: about 5 s
def test_the_benchmark_prints_each_width_s_host_time_per_layer_and_micro_batch(tmp_path, capsys):
    out = tmp_path / "rows.json"
    flags = ["--widths", "gpt3_1.3B", "--compile", "false", "--steps", "1", "--json", str(out)]
    host_time.main(flags)
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [(r["width"], r["compile"], r["recompute"]) for r in rows] == [
        ("gpt3_1.3B", "false", "full")
    ]
    kinds = rows[0]["kinds"]
    assert {"layer_forward", "layer_backward", "optimizer"} <= kinds.keys()
    for kind in ("layer_forward", "layer_backward"):
        assert kinds[kind]["per_unit_us"] > 0 and kinds[kind]["kernels_per_unit"] > 0
    assert "gpt3_1.3B   false    full" in printed


@pytest.mark.slow  # four micro-batch sizes' probes, twice: about 10 s
def test_plan_for_ranks_a_host_bound_layout_s_larger_micro_batches_first():
    """tiny's one-device layout at micro-batches of 1 to 8 (global batch 8): with launches
    and the host's time free the rows differ only by their kernels' rates at each shape, by
    well under a millisecond; with a host measured at 2 ms per phase and micro-batch of every
    kind, a larger micro-batch is fewer of them, so the rows come fastest first from 8 down to
    1, each host-bound, apart by the host's time they save (tens of milliseconds)."""
    from execution.planning.plan_search import search

    config, _ = parse_config(shlex.split("--config tiny --global_batch_size 8 --compile false"))
    free = dataclasses.replace(SPECS["h100_sxm"], launch_overhead_us=0.0)
    kinds = ("embedding_forward", "layer_forward", "head", "layer_backward", "embedding_backward")
    rows = tuple(
        (False, mode, False, kind, 0.0, 2000.0, 0.0, 0.0)
        for mode in ("full", "selective", "none")
        for kind in kinds
    )
    results = {}
    for name, spec in (("free", free), ("host", dataclasses.replace(free, host_phase_us=rows))):
        run = dataclasses.replace(RunShape.of(config), spec=spec)
        found, _, _ = search(run, 1, workers=1)
        results[name] = {row["run"].micro_batch_size: row for row in found}
    free_steps = [row["step_time_s"] for row in results["free"].values()]
    host = results["host"]
    assert list(host) == [8, 4, 2, 1]  # fastest first
    host_steps = [row["step_time_s"] for row in host.values()]
    smallest_gap = min(b - a for a, b in itertools.pairwise(host_steps))
    assert (
        max(free_steps) - min(free_steps) < smallest_gap / 10
    )  # the host's order, not the kernels'
    layers = config.model.layers
    for size, row in host.items():
        # Each micro-batch: each layer's forward and backward, and the embedding's two phases
        # and the head's, 2 ms of host apiece; the device's own work adds at most its step.
        host_time = (2 * layers + 3) * (8 // size) * 2e-3
        free_step = results["free"][size]["step_time_s"]
        assert host_time <= row["step_time_s"] <= host_time + free_step
        assert row["host_wait_s"] > 0

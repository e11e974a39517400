"""The step-time model's arithmetic against hand computations: collectives priced call by call,
a pipeline's stages combined."""

from __future__ import annotations

import dataclasses
import shlex
from collections import Counter

import pytest

from config.loading import parse_config
from execution.parallel.mesh import ParallelLayout
from execution.planning.device_specs import SPECS
from execution.planning.measure import Window
from execution.planning.run_shape import RunShape
from execution.planning.time_model import (
    PHASE_COSTS,
    estimate_step,
    phase_costs,
    pipeline_step,
    update_lead_share,
)


def _phases(forward: float, optimizer: float) -> dict[str, tuple]:
    """Phase costs of a stage whose phases take ``forward`` seconds of matmuls (and the
    optimizer ``optimizer`` seconds of memory-bound work)."""

    def costs(**seconds) -> tuple:
        return tuple(seconds.get(name, 0.0) for name in PHASE_COSTS)

    return {
        "layer_forward": costs(matmul_s=forward),
        "optimizer": costs(memory_bound_s=optimizer),
    }


def test_waited_collectives_cost_each_call_and_background_ones_their_own_time():
    """Two ranks of tensor-parallel 1 on a CPU-like spec whose all-reduce takes 1 ms at 4 KB
    (all latency) and 1 ms at 1 MB (its bandwidth, 1 MB per ms). A layer waits for three 4 KB
    all-reduces: between idle ranks, 3 x 1 ms, not one 12 KB call's 1.008 ms; with waiting
    measured in real steps at 100 us per call, 3 x (100 us + 4 KB at the bandwidth). It also
    starts four 256 KB reduce-scatters in the background, whose latency is spent waiting while
    the cores compute where the copies overlap (a GPU's links): their 1 MB at the 1 MB rate,
    1 ms, runs in the next window. Where they do not (a CPU, whose gloo thread runs on the
    cores the ranks compute on), each of the four takes the pair's time for it, waited for a
    phase later: 4 x 1 ms, whether waiting was measured in steps or not (both ranks issue
    them at the same point: no peer arrives late at each). A pipeline's two background
    receives of 4 KB wait for the other stage: priced as waited calls on a CPU, 2 x (100 us +
    nothing sent) in steps; behind the kernels where the copies overlap (nothing sent)."""
    rates = [(op, n, n / 1e6) for op in ("all_reduce", "reduce_scatter") for n in (4096, 1 << 20)]
    idle = dataclasses.replace(
        SPECS["h100_sxm"], collective_gb_per_s=tuple(rates), copies_overlap=False
    )
    in_steps = dataclasses.replace(idle, waited_collective_us=100.0)
    layout = ParallelLayout.shapes_only(1, 2, 1)
    calls = Counter({("all_reduce_sum", 4096, False): 3, ("reduce_scatter", 1 << 18, True): 4})

    def window(kind: str, tp1: Counter) -> Window:
        return Window(kind, calls={a.name: tp1 if a.name == "tp1" else Counter() for a in axes})

    def costs(spec, kind: str) -> dict[str, float]:
        return dict(zip(PHASE_COSTS, phase_costs(windows, layout, spec)[kind], strict=True))

    axes = layout.axes()
    windows = [window("layer_forward", calls), window("optimizer", Counter())]
    assert costs(idle, "layer_forward")["critical_comm_s"] == pytest.approx(3e-3)
    waited = 3 * (1e-4 + 4096 / (1 << 20) * 1e-3)
    assert costs(in_steps, "layer_forward")["critical_comm_s"] == pytest.approx(waited)
    for spec in (idle, in_steps):
        assert costs(spec, "layer_forward")["overlappable_comm_s"] == 0.0
        assert costs(spec, "optimizer")["overlappable_comm_s"] == pytest.approx(4e-3)
        overlapping = dataclasses.replace(spec, copies_overlap=True)
        assert costs(overlapping, "optimizer")["overlappable_comm_s"] == pytest.approx(1e-3)
    receives = Counter({("receive", 4096, True): 2})
    windows = [window("layer_forward", receives), window("optimizer", Counter())]
    assert costs(in_steps, "optimizer")["overlappable_comm_s"] == pytest.approx(2e-4)
    overlapping = dataclasses.replace(in_steps, copies_overlap=True)
    assert costs(overlapping, "optimizer")["overlappable_comm_s"] == 0.0
    # One process: nothing to wait for.
    layout = ParallelLayout.shapes_only(1, 1, 1)
    axes = layout.axes()
    windows = [window("layer_forward", calls)]
    assert costs(in_steps, "layer_forward")["critical_comm_s"] == 0


@pytest.mark.parametrize("stages, passes", [(2, 4), (4, 8), (3, 3)])
def test_alike_stages_take_the_bubble_each_stage_is_priced_with(stages, passes):
    """Stages of the same work: (P + S - 1) / P of it, then the optimizer."""
    spec = SPECS["h100_sxm"]
    one = estimate_step(_phases(2.0, 0.5), stages, passes, spec)
    assert one["step_time_s"] == pytest.approx(2.0 * (passes + stages - 1) / passes + 0.5)
    combined = pipeline_step({s: [one] for s in range(stages)}, passes)
    assert combined == pytest.approx(one["step_time_s"])


def test_the_slowest_stage_sets_the_pace_and_the_others_add_one_pass_each():
    """Stages of 1 s and 3 s, 4 passes: the slow one's 3 s take 3 x 3/4 in the steady state,
    every stage's pass adds (1 + 3) / 4 of fill and drain, then the slower optimizer (0.2 s):
    3.45 s. Each stage alone would be priced 1.25 + 0.1 and 3.75 + 0.2."""
    spec = SPECS["h100_sxm"]
    fast = estimate_step(_phases(1.0, 0.1), 2, 4, spec)
    slow = estimate_step(_phases(3.0, 0.2), 2, 4, spec)
    assert (fast["step_time_s"], slow["step_time_s"]) == pytest.approx((1.35, 3.95))
    assert pipeline_step({0: [fast], 1: [slow]}, 4) == pytest.approx(3.45)
    # Several kinds of rank in a stage: its slowest counts.
    assert pipeline_step({0: [fast, fast], 1: [fast, slow]}, 4) == pytest.approx(3.45)


def test_a_pipeline_dry_run_gives_every_rank_the_pipeline_s_step(tmp_path):
    """tiny at 2 stages: the last stage holds the head's vocabulary matmuls and sets the
    pace; every rank's step is the pipeline's, and each rank's idle time is that step less its
    own work, so the first stage idles most."""
    from execution.planning.dry_run import dry_run

    flags = "--config tiny --pipeline_parallel 2 --micro_batch_size 1 --passes 4 --dry_run"
    config, _ = parse_config(shlex.split(flags + " --device_spec h100_sxm"))
    ranks = dry_run(RunShape.of(config), tmp_path)["ranks"]
    assert len(ranks) == 2 and len({r["step_time_s"] for r in ranks}) == 1
    first, last = ranks
    assert first["bubble_s"] > last["bubble_s"] > 0
    for r in ranks:
        assert r["bubble"] == pytest.approx(r["bubble_s"] / r["step_time_s"])


def test_the_ranking_check_holds_on_the_measured_order_or_a_fastest_within_5_percent():
    """benchmarks/time_model_check.py's verdict on --plan_for 2's order, by hand."""
    from benchmarks.time_model_check import ranking_verdict

    def rows(*measured):  # listed in the search's order
        return [{"layout": f"l{i}", "measured_s": m} for i, m in enumerate(measured)]

    same = ranking_verdict(rows(1.0, 1.5, 2.0))
    assert same["same_order"] and same["holds"] and same["fastest_gap"] == 0.0
    close = ranking_verdict(rows(1.04, 1.0, 2.0))  # first measures 4% over the fastest
    assert not close["same_order"] and close["holds"]
    assert close["fastest_gap"] == pytest.approx(0.04)
    wrong = ranking_verdict(rows(1.06, 1.0, 2.0))
    assert not wrong["holds"]
    tail = ranking_verdict(rows(1.0, 2.0, 1.5))  # the tail out of order, the fastest right
    assert not tail["same_order"] and tail["holds"]


def test_the_host_update_is_priced_by_its_elements_where_a_rate_was_measured():
    """3 M elements of host AdamW that move 68 bytes each: on the data sheet's 40 GB/s of host
    memory 3e6 x 68 / 40e9 = 5.1 ms; at a measured 2e8 elements/s, 3e6 / 2e8 = 15 ms, whatever
    the bytes. A window without a host update costs nothing either way."""
    layout = ParallelLayout.shapes_only(1, 1, 1)
    no_calls = {a.name: Counter() for a in layout.axes()}
    update = Window(
        "optimizer",
        calls=no_calls,
        host_update_elements=3_000_000,
        host_update_bytes=3_000_000 * 68,
    )
    windows = [Window("layer_forward", calls=no_calls), update]
    sheet = SPECS["h100_sxm"]
    measured = dataclasses.replace(sheet, host_adamw_elements_per_s=2e8)
    index = PHASE_COSTS.index("host_optimizer_s")
    for spec, seconds in ((sheet, 3e6 * 68 / 40e9), (measured, 3e6 / 2e8)):
        phases = phase_costs(windows, layout, spec)
        assert phases["optimizer"][index] == pytest.approx(seconds, rel=1e-12)
        assert phases["layer_forward"][index] == 0.0
        assert estimate_step(phases, 1, 1, spec)["host_optimizer_s"] == pytest.approx(seconds)


def test_a_dry_run_counts_the_elements_of_the_weights_on_the_host():
    """tiny with its weights on the host: the update's elements are the float32 masters the
    rank holds (its buffers' weight bytes / 4), priced at the measured rate; on the data
    sheet, what adamw_ moves per element over 40 GB/s, as before."""
    from execution.planning.dry_run import measure_rank
    from execution.planning.measure import Measurements, _adamw_bytes_per_element

    flags = "--config tiny --device cpu --placement remote --overlap_update false"
    config, _ = parse_config(shlex.split(flags))
    sheet = SPECS["h100_sxm"]
    measured = dataclasses.replace(sheet, host_adamw_elements_per_s=1e9)
    planning = Measurements()
    index = PHASE_COSTS.index("host_optimizer_s")
    by_sheet, by_rate = (
        measure_rank(RunShape.of(config), 0, s, planning) for s in (sheet, measured)
    )
    elements = by_rate.buffer_bytes["weights"] // 4
    assert by_rate.plan.placement.weights == "host" and elements > 0
    assert by_rate.phases["optimizer"][index] == pytest.approx(elements / 1e9, rel=1e-9)
    bytes_moved = elements * _adamw_bytes_per_element()
    assert by_sheet.phases["optimizer"][index] == pytest.approx(bytes_moved / 40e9, rel=1e-9)


def test_an_update_behind_the_next_step_waits_for_the_rows_its_first_loads_need():
    """Rows of 100 (the embedding), 50, 50 (two layers) and 10 (the head) elements, in the
    update's order; the next step's first phase loads the embedding and, a phase early, the
    first layer: 150 of 210 elements are written before it can start."""
    rows = (("embedding", 0, 100), ("layers", 0, 50), ("layers", 1, 50), ("head", 0, 10))
    first = [(("embedding", 0),), (("layers", 0),)]
    assert update_lead_share(rows, first) == pytest.approx(150 / 210)
    assert update_lead_share(rows, [(("head", 0),)]) == 1.0  # needed first, written last


@pytest.mark.parametrize(
    "passes, behind, lead, wait",
    [
        (1, 4.0, 1.0, 1.0),  # 4 s of update behind a 3 s forward: only its lead is waited for
        (2, 4.0, 1.0, 2.5),  # a pass's forward is 1.5 s: its last loads wait 4 - 1.5
        (1, 8.0, 1.0, 5.0),  # longer than the forward: the rest of it is waited for
        (1, 0.5, 0.5, 0.5),  # never more than the update itself
    ],
)
def test_the_step_waits_for_the_larger_of_the_lead_and_the_rest_of_the_forward(
    passes, behind, lead, wait
):
    """A stage whose forward takes 0.5 s (embedding) + 2.5 s (layers) over ``passes`` passes:
    the step is its phases plus the wait, and the rest of the update is hidden."""

    def costs(**seconds) -> tuple:
        return tuple(seconds.get(name, 0.0) for name in PHASE_COSTS)

    phases = {
        "embedding_forward": costs(matmul_s=0.5),
        "layer_forward": costs(matmul_s=2.5),
        "optimizer": costs(update_behind_s=behind, update_lead_s=lead),
    }
    out = estimate_step(phases, 1, passes, SPECS["h100_sxm"])
    assert out["step_time_s"] == pytest.approx(3.0 + wait)
    assert out["host_optimizer_s"] == pytest.approx(wait)
    assert out["hidden_update_s"] == pytest.approx(behind - wait)


def test_a_dry_run_prices_the_update_behind_the_next_step_where_it_runs_there():
    """tiny with its weights on the host, one pass: on a GPU's data sheet the update behind
    the next step shortens the step by what it hides; on a CPU (auto: not behind) and with
    --overlap_update false the step is the serial one."""
    from execution.planning.dry_run import estimate, measure_rank
    from execution.planning.measure import Measurements

    def step(spec, choice: str) -> dict:
        flags = (
            f"--config tiny --device cpu --placement remote --passes 1 --overlap_update {choice}"
        )
        run = RunShape.of(parse_config(shlex.split(flags))[0])
        return estimate(run, measure_rank(run, 0, spec, Measurements()), spec)

    sheet = dataclasses.replace(SPECS["h100_sxm"], host_adamw_elements_per_s=1e8)
    serial, behind = step(sheet, "false"), step(sheet, "auto")
    assert behind["hidden_update_s"] > 0 and serial["hidden_update_s"] == 0
    saved = serial["step_time_s"] - behind["step_time_s"]
    assert saved == pytest.approx(behind["hidden_update_s"], rel=1e-9)
    cpu = dataclasses.replace(sheet, device_type="cpu")
    assert step(cpu, "auto")["step_time_s"] == step(cpu, "false")["step_time_s"]


@pytest.mark.parametrize(("matmul", "launch"), [(1.0, 0.3), (0.1, 0.3)])
def test_a_gpu_launches_beside_the_kernels_before_and_a_cpu_after(matmul, launch):
    """A CUDA host queues kernels ahead: a phase takes the longer of its kernels and its
    launches, and the shorter is reported hidden. A CPU's cores launch and run each op in
    turn: the two add."""
    phases = {"layer_forward": tuple(0.0 for _ in PHASE_COSTS)}
    values = dict.fromkeys(PHASE_COSTS, 0.0) | {"matmul_s": matmul, "launch_s": launch}
    phases["layer_forward"] = tuple(values[name] for name in PHASE_COSTS)
    gpu = SPECS["h100_sxm"]
    queued = estimate_step(phases, 1, 1, gpu)
    assert queued["step_time_s"] == pytest.approx(max(matmul, launch))
    assert queued["hidden_overhead_s"] == pytest.approx(min(matmul, launch))
    cpu = estimate_step(phases, 1, 1, dataclasses.replace(gpu, device_type="cpu"))
    assert cpu["step_time_s"] == pytest.approx(matmul + launch)
    assert cpu["hidden_overhead_s"] == 0

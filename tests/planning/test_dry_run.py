"""The dry run: exact per-rank bytes at full scale, agreement with real CPU runs, --plan_for."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from execution.parallel.fake_job import fake_job
from execution.planning.checkpoint_cost import checkpoint_figures
from execution.planning.dry_run import (
    _step_probes,
    estimate,
    measure_planned_step,
    measure_rank,
    rank_kinds,
)
from execution.planning.measure import _adamw_bytes_per_element, measured_working_set
from execution.planning.plan_search import extrapolated_step
from execution.planning.planner import candidate_plans
from execution.planning.run_shape import RunShape
from execution.planning.step_meter import StepMeter
from modelling.gpt import GPTShapes, logical_shapes
from tests.distributed import (
    global_batches,
    layout_flags,
    planned_engine,
    real_step_traffic,
    replica_batch,
    run_ranks,
    world_layout,
)
from tests.distributed import small_config as distributed_config
from tests.entry_points import run_script
from tests.reference import LLAMA_VARIANTS, small_config

ROOT = Path(__file__).resolve().parents[2]


def entry_point(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """run_pretraining.py as a user runs it (a new interpreter: --plan_for forks its workers,
    which a forked child of the test process must not)."""
    command = [sys.executable, "run_pretraining.py", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def metered_adamw_once() -> None:
    """The step meter prices the host AdamW by metering one update on meta tensors, once per
    process, inside whichever step it first measures (9 kernels more in that step): done
    here first, the steps a test compares are measured alike whatever ran before."""
    _adamw_bytes_per_element()


@pytest.mark.slow
def test_175B_pod256_per_rank_bytes_equal_a_hand_calculation(tmp_path):
    """gpt3_175B_pod256 (dp 4 x tp1 8 x tp2 8, float16) through the entry point, in one CPU
    process: every rank's weights, gradients, optimizer state and activations, by hand.

    One micro-batch per replica (global batch 4, not the preset's 128), with full recompute
    as the preset plans it: the bytes are the same formulas (docs/dry_run_and_plan_for.md
    shows the whole preset's dry run)."""
    flags = ["--config", "gpt3_175B_pod256", "--dry_run", "--output_dir", str(tmp_path)]
    flags += ["--global_batch_size", "4", "--recompute", "full"]
    result = entry_point(*flags, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "verdict: FITS on 256 x h100_sxm" in result.stdout
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["world_size"] == 256
    assert len(report["ranks"]) == 1 and report["ranks"][0]["ranks"] == list(range(256))
    rank = report["ranks"][0]

    h, layers, dp, tp1, tp2 = 12288, 96, 4, 8, 8
    # Per decoder layer: the four matrices (12 h^2) over tp1 x tp2, then RTS over dp; six
    # h-vectors over tp2 (2 layer norms x 2, two output biases), RTS over dp x tp1; the qkv and
    # fc biases (7 h) over tp1, RTS over dp x tp2.
    per_layer = 12 * h * h // (tp1 * tp2 * dp) + 6 * h // tp2 // (dp * tp1)
    per_layer += 7 * h // tp1 // (dp * tp2)
    # Vocabulary padded to 8 shards of 6288 rows (6283 rounded up to 16) and 2048 positions.
    embedding = (8 * 6288 + 2048) * h // (tp1 * tp2 * dp)
    head = 2 * h // tp2 // (dp * tp1)  # ln_f
    elements = layers * per_layer + embedding + head
    assert elements == 682_050_144
    totals = {k: rank["device_bytes"][k] + rank["host_bytes"][k] for k in rank["device_bytes"]}
    assert totals["weights"] == 4 * elements
    assert totals["grads"] == 4 * elements
    assert totals["optimizer"] == 8 * elements
    entries = report["plan"]["micro_batches_per_pass"]
    tokens_hidden = 1 * 2048 * h // tp2  # micro-batch 1 x sequence 2048 x hidden / tp2
    x = (layers + 1) * entries * tokens_hidden // tp1  # sharded over tp1
    dx = 2 * entries * tokens_hidden
    assert totals["activations"] == 2 * (x + dx)  # float16
    assert rank["fits"] and rank["flops_per_step"] > 0 and 0 < rank["mfu"] < 1
    assert set(rank["comm_bytes"]) >= {"dp", "tp1", "tp2", "host_link"}
    # A checkpoint: each rank writes its weights and moments, less padding, and sends nothing.
    checkpoint = rank["checkpoint"]
    assert 0.999 * 12 * elements < checkpoint["bytes_written"] <= 12 * elements
    assert checkpoint["tensor_bytes_sent"] == 0 and checkpoint["save_s"] > 0


@pytest.mark.parametrize("layout", [(2, 2, 2, 1), (1, 4, 1, 1), (4, 1, 2, 1), (2, 1, 2, 2)])
def test_checkpoint_bytes_of_every_rank_add_up_to_the_logical_state_once(layout):
    """The dry run's per-rank checkpoint bytes, over every rank, are 12 bytes (float32 weights
    and two moments) per logical parameter: no padding, nothing twice."""
    config = distributed_config(*layout_flags(*layout))
    run = RunShape.of(config)
    plan = next(iter(candidate_plans(run, "cuda")))
    written = [
        checkpoint_figures(run, plan, run.spec, rank)["bytes_written"]
        for rank in range(run.world_size)
    ]
    shapes = GPTShapes.from_config(config.model)
    params = sum(math.prod(shape) for shape in logical_shapes(shapes).values())
    assert sum(written) == 12 * params


def _real_rank(config) -> dict:
    """One real CPU step of this rank: its buffers and the peak of what the step allocated."""
    layout = world_layout(config)
    engine = planned_engine(config, layout)
    batch = replica_batch(config, global_batches(config, 1)[0], layout.dp.rank)
    with StepMeter() as meter:
        engine.train_step(batch, 0, 1e-3)
    return {"buffers": engine.buffer_bytes(), "working_set": meter.peak}


LLAMA = " ".join([*LLAMA_VARIANTS, "--kv_heads", "2", "--intermediate_size", "88"])
# Weights and activations in host memory, gradients on the device.
STREAMED = "--weights_placement host --activations_placement host --grads_placement device"
ALL_HOST = "--weights_placement host --activations_placement host --grads_placement host --passes 2"
# The dry run plans for a GPU (flash attention), so a layer that keeps its activations keeps
# the kernel's outputs; selective recompute keeps only the core's inputs, the same on a CPU.
CASES = [
    ((1, 1, 1), "--placement resident --passes 1 --recompute full"),
    ((2, 2, 1), "--placement remote --passes 2 --recompute selective"),
    ((1, 2, 2), f"{STREAMED} --passes 4 --recompute full"),
    # The Llama variants: KV projections smaller than q's, SwiGLU's three matrices, an untied
    # head loading no embedding.
    ((2, 2, 1), f"--placement remote --passes 2 --recompute selective {LLAMA}"),
]


@pytest.mark.parametrize(("layout", "flags"), CASES, ids=["1x1x1", "2x2x1", "1x2x2", "llama-2x2x1"])
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_dry_run_equals_a_real_cpu_step(tmp_path, layout, flags):
    """Buffers exactly, and the working set within 10%, of a real CPU step of the same plan."""
    sizes = shlex.split("--global_batch_size 8 --micro_batch_size 1 --hidden_size 64")
    config = distributed_config(*layout_flags(*layout), *sizes, *shlex.split(flags))
    real = run_ranks(_real_rank, config.world_size, tmp_path, config)[0]
    run = RunShape.of(config)
    dry = measure_rank(run, 0, run.spec)
    assert dry.buffer_bytes == real["buffers"]
    assert abs(dry.working_set - real["working_set"]) <= 0.10 * real["working_set"], (
        dry.working_set,
        real["working_set"],
    )
    # The planner's own figure (three layers, two passes, everything on the host) is what a real
    # step with every state on the host allocates, to within the few bytes of per-micro-batch
    # losses, and bounds the case's own placement: loads from the host only add copies.
    planned = measured_working_set(run, "cpu", config.execution.recompute)
    host = distributed_config(*layout_flags(*layout), *sizes, *shlex.split(f"{flags} {ALL_HOST}"))
    (tmp_path / "host").mkdir()
    real_host = run_ranks(_real_rank, host.world_size, tmp_path / "host", host)[0]
    assert abs(planned - real_host["working_set"]) <= 0.01 * real_host["working_set"], (
        planned,
        real_host["working_set"],
    )
    assert planned >= 0.99 * real["working_set"], (planned, real["working_set"])


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_the_planned_working_set_counts_the_gradients_a_reduction_still_reads(tmp_path):
    """dp 8, communication overlapped: while a layer's gradient reduce-scatter runs, the next
    layer's backward starts beside the accumulator it reads. The planner measures on a layout
    whose collectives only shape their outputs; it holds that input until the reduction is
    waited for, as a real one does, and plans what a real gloo step allocates to the bytes
    (without holding it, the plan would be 53.7 MB for this step's 66.3 MB: one float32 layer
    accumulator less; gpt3_175B_h100x256 would plan 9.96 GiB for 13.3)."""
    flags = shlex.split(
        "--hidden_size 512 --global_batch_size 8 --micro_batch_size 1 --layers 3 "
        "--placement remote --recompute full --passes 1"
    )
    config = distributed_config(*layout_flags(8, 1, 1), *flags)
    assert config.execution.overlap_communication
    real = run_ranks(_real_rank, config.world_size, tmp_path, config)
    planned = measured_working_set(RunShape.of(config), "cpu")
    for rank in real:
        assert abs(planned - rank["working_set"]) <= 64, (planned, rank["working_set"])


@pytest.mark.parametrize("layout", [(1, 1, 1, 2), (1, 2, 1, 2)], ids=["cp2", "tp1_2-cp2"])
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_dry_run_context_axis_equals_a_real_gloo_step(tmp_path, layout):
    """With the sequence over 2 ranks, the dry run's buffers (activations: half those of one
    rank holding whole sequences) and the bytes each group sends, the context axis's
    all-to-alls included, equal a real gloo step's exactly."""
    flags = shlex.split(
        "--global_batch_size 4 --micro_batch_size 1 --sequence_length 8 --passes 1 --recompute full"
    )
    config = distributed_config(*layout_flags(*layout), *flags)
    real = run_ranks(real_step_traffic, config.world_size, tmp_path, config)[0]
    run = RunShape.of(config)
    dry = measure_rank(run, 0, run.spec)
    assert dry.buffer_bytes == real["buffers"]
    dry_sent = {k: v for k, v in dry.comm_bytes.items() if k != "host_link"}
    assert dry_sent == real["sent"]
    # By hand: per layer and micro-batch, q|k|v and the attention output cross the axis in the
    # forward, its recompute and the backward: 3 x 4 tokens x hidden / tp1 float32 values, of
    # which the half bound for the other piece leaves the rank.
    tp1, cp, m = layout[1], layout[3], config.model
    per_exchange = 4 * (m.sequence_length // cp) * m.hidden_size // tp1 * 4
    micro_batches = config.gradient_accumulation
    assert dry_sent["cp"] == 3 * m.layers * micro_batches * per_exchange * (cp - 1) // cp
    whole = RunShape.of(distributed_config(*layout_flags(*layout[:3]), *flags))
    whole_activations = measure_rank(whole, 0, whole.spec).buffer_bytes["activations"]
    assert dry.buffer_bytes["activations"] * cp == whole_activations


def test_extrapolated_step_equals_a_full_dry_run_step():
    """--plan_for's six shrunk steps give exactly the FLOPs and bytes of the full step."""
    run = shlex.split(
        "--layers 5 --global_batch_size 12 --micro_batch_size 1 --passes 3 --placement remote "
        "--grads_placement device"
    )
    run = RunShape.of(distributed_config(*layout_flags(2, 2, 1), *run))
    plan = candidate_plans(run, "cuda")[0]
    metered_adamw_once()
    flops, comm, _, _, phases = extrapolated_step(run, plan, run.spec)
    with fake_job(0, run.world_size):
        full = measure_planned_step(run, plan, run.spec, whole_step=True)
    assert flops == full.flops
    assert comm == full.comm_bytes
    assert comm["host_link"] > 0 and comm["dp"] > 0
    # Per kind of phase too (sums of seconds: equal to rounding), so the overlap model applies.
    assert phases.keys() == full.phases.keys()
    for kind, values in full.phases.items():
        assert phases[kind] == pytest.approx(values, rel=1e-9, abs=1e-12), kind
    assert sum(v[0] for v in full.phases.values()) == full.flops


@pytest.mark.parametrize(
    "layout, flags",
    [
        ((1, 1, 1), "--passes 1 --placement resident --global_batch_size 6"),
        ((1, 1, 1), "--passes 5 --placement remote --global_batch_size 17"),  # uneven passes
        ((2, 1, 1), "--passes 6 --placement remote --global_batch_size 12"),  # one per pass
        ((1, 2, 1), "--passes 2 --global_batch_size 34 --context_parallel 2"),
        ((1, 1, 1), "--passes 5 --global_batch_size 17 --pipeline_parallel 2"),
        # Probes of 3 and 4 layers too, each stage's where it holds more.
        ((1, 1, 1), "--layers 6 --passes 5 --placement remote --global_batch_size 17"),
        ((1, 1, 1), "--layers 10 --passes 5 --global_batch_size 17 --pipeline_parallel 2"),
    ],
)
@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_a_step_measured_from_probes_equals_the_whole_step(layout, flags):
    """The dry run's step of many micro-batches and layers, from steps of fewer passes,
    micro-batches and layers (measure_step), against every micro-batch and layer stepped:
    FLOPs, bytes of every group and of the host link, and buffers equal; the working set
    within the 4 bytes per micro-batch of a kept loss; each kind of phase's costs, and the
    estimate, to rounding."""
    sizes = ["--layers", "3", "--micro_batch_size", "1", *shlex.split(flags)]
    run = RunShape.of(distributed_config(*layout_flags(*layout), *sizes))
    spec = run.spec
    plan = candidate_plans(run, "cuda")[0]
    probes, _ = _step_probes(run.engine_plan(plan), run.mesh.pp)
    assert sum(m for _, m in probes) < run.gradient_accumulation  # the probes are taken
    metered_adamw_once()
    # A pipeline's last stage holds the head.
    for rank in sorted({0, run.world_size - 1 if "pipeline" in flags else 0}):
        with fake_job(rank, run.world_size):
            whole = measure_planned_step(run, plan, spec, whole_step=True)
            probed = measure_planned_step(run, plan, spec)
        assert probed.flops == whole.flops > 0
        assert probed.comm_bytes == whole.comm_bytes
        assert probed.buffer_bytes == whole.buffer_bytes
        # Each micro-batch keeps its 4-byte loss; a pipeline stage is priced up to one pass of
        # boundary tensors above the whole step, never below it (pass_boundary_bytes).
        margin = 0
        if "pipeline" in flags:  # float32 x and dx of a pass's micro-batches, by hand
            entries = run.engine_plan(plan).memory.micro_batches_per_pass
            tokens = run.micro_batch_size * run.sequence_length
            margin = 2 * entries * tokens * run.model.hidden * 4
        excess = probed.working_set - whole.working_set
        assert -4 * run.gradient_accumulation <= excess <= margin
        assert probed.phases.keys() == whole.phases.keys()
        for kind, values in whole.phases.items():
            # A pipeline's reductions carried into the next phase may land in another kind.
            assert probed.phases[kind] == pytest.approx(values, rel=1e-9, abs=1e-7), kind
        step = estimate(run, whole, spec)["step_time_s"]
        assert estimate(run, probed, spec)["step_time_s"] == pytest.approx(step, rel=1e-6)


def test_a_step_of_many_layers_is_measured_on_three_and_four():
    """Six layers of four micro-batches (too few to probe): two steps, of 3 and 4 layers,
    stand for the step, and give exactly what stepping all six gives (the working set too:
    from three layers on, each further layer repeats the middle one's)."""
    run = RunShape.of(small_config("--layers", "6", "--placement", "remote"))
    plan = candidate_plans(run, "cuda")[0]
    told: list[str] = []
    metered_adamw_once()
    with fake_job(0, run.world_size):
        whole = measure_planned_step(run, plan, run.spec, whole_step=True)
        probed = measure_planned_step(run, plan, run.spec, progress=told.append)
    assert told == [
        "step 1 of 2: 3 layers, 4 micro-batches in 1 pass(es)",
        "step 2 of 2: 4 layers, 4 micro-batches in 1 pass(es)",
    ]
    assert probed.flops == whole.flops > 0
    assert probed.comm_bytes == whole.comm_bytes and whole.comm_bytes["host_link"] > 0
    assert probed.buffer_bytes == whole.buffer_bytes
    assert probed.working_set == whole.working_set
    for kind, values in whole.phases.items():
        assert probed.phases[kind] == pytest.approx(values, rel=1e-9, abs=1e-12), kind


def _estimate(config, **spec):
    """The dry run's estimate of rank 0 of ``config``, on its spec with the fields ``spec``."""
    run = RunShape.of(config)
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, **spec))
    with fake_job(0, run.world_size):
        plan = candidate_plans(run, "cuda")[0]
        measured = measure_planned_step(run, plan, run.spec)
    return estimate(run, measured, run.spec)


def test_overlap_hides_data_parallel_traffic_in_the_estimate():
    """All on the device (no host copies), dp 2 x tp1 2: without overlap every collective is
    exposed (step = the device's work + collectives); with it the data-parallel part
    hides behind compute (by exactly what is reported hidden). With launches that cost the
    host nothing: a GPU's device waiting for its host (this small model's, at 5 us a kernel)
    runs the collectives in that wait whether they overlap or not."""
    run = shlex.split("--layers 3 --global_batch_size 8 --placement resident --passes 1")
    flags = [*layout_flags(2, 2, 1), *run, "--overlap_communication"]
    off = _estimate(distributed_config(*flags, "false"), launch_overhead_us=0.0)
    on = _estimate(distributed_config(*flags, "true"), launch_overhead_us=0.0)
    assert off["hidden_comm_s"] == 0
    assert off["exposed_comm_s"] == pytest.approx(off["collectives_s"], rel=1e-12)
    device = sum(off[k] for k in ("compute_s", "memory_bound_s", "overhead_s"))
    device -= off["hidden_overhead_s"]  # launched while the kernels before run
    assert off["step_time_s"] == pytest.approx(device + off["collectives_s"])
    assert on["compute_s"] == off["compute_s"]
    assert on["collectives_s"] == pytest.approx(off["collectives_s"], rel=1e-12)
    assert on["hidden_comm_s"] > 0
    assert on["exposed_comm_s"] == pytest.approx(off["exposed_comm_s"] - on["hidden_comm_s"])
    assert on["step_time_s"] < off["step_time_s"] and on["mfu"] > off["mfu"]


@pytest.mark.slow
def test_plan_for_through_the_entry_point():
    # tiny, smaller still: the search's rows are tested above; this is the entry point's path
    small = "--vocab_size 1024 --sequence_length 32 --max_positional_length 32"
    result = entry_point(
        *shlex.split(f"--config tiny {small} --plan_for 2 --device_spec a100_80gb")
    )
    assert result.returncode == 0, result.stderr
    assert "tiny on 2 x a100_80gb" in result.stdout
    assert "fastest: --data_parallel" in result.stdout


def test_kinds_of_rank_group_equal_shards_and_node_spans():
    config = distributed_config(*layout_flags(2, 4, 1))
    kinds = rank_kinds(RunShape.of(config), devices_per_node=8)
    assert sorted(r for kind in kinds for r in kind) == list(range(8))
    assert len(kinds) == 1  # padding keeps every shard the same shape; one node holds all
    # tp1 2 x tp2 3 over nodes of 8: rank 0's tp1 group {0, 3} is one node, rank 6's {6, 9}
    # spans two, so they are measured apart.
    shape = shlex.split("--global_batch_size 8 --micro_batch_size 1 --heads 6 --hidden_size 36")
    config = distributed_config(*layout_flags(4, 2, 3), *shape)
    kinds = rank_kinds(RunShape.of(config), devices_per_node=8)
    kind_of = {r: k for k, ranks in enumerate(kinds) for r in ranks}
    assert kind_of[0] != kind_of[6]
    assert sorted(r for kind in kinds for r in kind) == list(range(24))


@pytest.mark.parametrize(
    "flags",
    [
        "--layers 100000 --dry_run",
        "--config gpt3_1.3B --layers 100000 --dry_run",
        "--global_batch_size 1000000000 --dry_run",
        "--global_batch_size 1000000000",
        "--config gpt3_1.3B --global_batch_size 1000000000 --dry_run",
        "--config gpt3_1.3B --global_batch_size 1000000000",
        "--global_batch_size 1000000000 --plan_for 8",
    ],
)
def test_absurd_sizes_answer_or_are_refused_in_one_line(tmp_path, flags):
    """Sizes whose planning grew with the flag's value (a dry run stepping 100,000 layers, a
    planner trying each of 250,000,000 pass counts) now end: a dry run measures a few layers
    and extrapolates, and a step of more micro-batches than the planner takes is refused in
    one line, exit 2, with nothing written. The timeout is the guard, not a timing."""
    out = tmp_path / "out"
    result = run_script(
        "run_pretraining.py", *shlex.split(flags), "--output_dir", str(out), timeout=120
    )
    if "--layers" in flags:
        assert result.returncode == 0, result.stderr
        assert "dry run: 100000 layers x" in result.stdout
        assert "verdict: DOES NOT FIT on 1 x h100_sxm" in result.stdout
        assert json.loads((out / "plan.json").read_text())["world_size"] == 1
        return
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "the planner takes 1 to 16,384" in line and "--global_batch_size at most" in line
    assert not out.exists()

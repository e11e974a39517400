"""The dry run: the real set-up and one real training step of every kind of rank, on meta tensors.

``run_pretraining.py --dry_run`` builds the preset's full layout on a fake process group (one
process plays each rank in turn), plans its memory for ``--device_spec`` and runs one
:meth:`PhasedEngine.train_step` on meta tensors, so every shape, split and collective of the
real code runs without memory, data or devices. It measures, per kind of rank, the buffers, the
peak working set and the FLOPs executed (:class:`StepMeter`) (recomputation included), the bytes of every collective
and of the host link, and estimates the step time and MFU.

Kinds of rank: ranks whose tensor-parallel shards have the same shapes hold the same buffers,
run the same ops and send the same bytes, so one rank of each kind is measured.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from execution.engine.engine import PhasedEngine
from execution.engine.phases.recompute import attention_kernel
from execution.engine.plan import EnginePlan, MemoryPlan
from execution.engine.storage.buffers import DTYPES, ActivationLayout
from execution.parallel.fake_job import fake_job
from execution.parallel.mesh import MeshShape, ParallelLayout
from execution.parallel.sharding import shard_sizes
from execution.planning.checkpoint_cost import checkpoint_figures
from execution.planning.device_specs import DeviceSpec
from execution.planning.dry_run_report import STATE_KEYS, fit_line, format_report
from execution.planning.estimate_checks import check_mfu, check_rank
from execution.planning.measure import Measurements, meta_step
from execution.planning.memory import spec_budget
from execution.planning.pipeline_figures import bubble_fraction
from execution.planning.planner import choose
from execution.planning.run_shape import RunShape
from execution.planning.time_model import (
    COST_INDEX,
    axis_traffic,
    estimate_step,
    phase_costs,
    pipeline_step,
)
from modelling.gpt import PARTS
from utils.metrics import flops_per_token

META = torch.device("meta")
# The groups a step communicates over (the world only sums the norm and the loss).
COMMUNICATING_AXES = ("dp", "pp", "embedding", "cp", "tp1", "tp2", "dp_cp", "dp_tp1", "dp_tp2")


def rank_kinds(run: RunShape, devices_per_node: int) -> list[list[int]]:
    """Ranks grouped by pipeline stage (its layers, parts and passes in flight), by the
    shapes of their tensor-parallel shards (so of every buffer and activation) and by how many
    nodes each of their groups spans (so the speed of each collective). Padding keeps the
    vocabulary and position shards equal, so layouts whose groups align with nodes have one
    kind per stage; ranks of a kind differ only in values."""
    shapes, mesh = run.shards(), run.mesh

    @functools.cache
    def shard_signature(i: int, j: int) -> tuple:
        return tuple(
            (part, name, tuple(size))
            for part in PARTS
            for name, size in shard_sizes(part, shapes, i, j).items()
        )

    # Each group's span once, not once per member: a layout of 2^20 ranks in groups of 2^20
    # would otherwise walk 2^40 ranks.
    spans = [_node_spans(mesh, axis, devices_per_node) for axis in COMMUNICATING_AXES]
    kinds: dict[tuple, list[int]] = {}
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        signature = (
            coords["p"],
            shard_signature(coords["i"], coords["j"]),
            tuple(span[rank] for span in spans),
        )
        kinds.setdefault(signature, []).append(rank)
    return list(kinds.values())


def _node_spans(mesh: MeshShape, axis: str, devices_per_node: int) -> list[int]:
    """Per rank, how many nodes its group along ``axis`` spans (a rank alone in its group,
    as a middle stage is in ``embedding``'s, spans its own)."""
    spans = [1] * mesh.world_size
    for group in mesh.groups(axis):
        nodes = len({r // devices_per_node for r in group})
        for rank in group:
            spans[rank] = nodes
    return spans


@dataclass(kw_only=True)
class RankMeasurement:
    """What one real training step of one rank did, measured on meta tensors."""

    plan: MemoryPlan
    fits: bool
    why: str
    buffer_bytes: dict[str, int]
    working_set: int
    comm_bytes: dict[str, int]  # per group, bytes this rank sends; plus host_link
    comm_seconds: dict[str, float]
    flops: int
    # Per kind of phase, summed over its phases: time_model.PHASE_COSTS.
    phases: dict[str, tuple[float, ...]]


def measure_planned_step(
    run: RunShape,
    plan: MemoryPlan,
    spec: DeviceSpec,
    measurements: Measurements | None = None,
    whole_step: bool = False,
    progress: Callable[[str], None] | None = None,
) -> RankMeasurement:
    """Set-up and one training step of this fake job's rank under ``run`` and ``plan``
    (:func:`measure_step`; ``whole_step``: every micro-batch and layer stepped, however many;
    ``progress``: told what is being measured)."""
    if whole_step:
        return measure_engine_step(run.engine_plan(plan), run.mesh, spec, measurements)
    return measure_step(run.engine_plan(plan), run.mesh, spec, measurements, progress)


def measure_step(
    plan: EnginePlan,
    mesh: MeshShape,
    spec: DeviceSpec,
    measurements: Measurements | None = None,
    progress: Callable[[str], None] | None = None,
) -> RankMeasurement:
    """The rank's step as :func:`measure_engine_step` measures it, from a few steps of fewer
    layers, passes and micro-batches when that is quicker (stepping each of hundreds of
    micro-batches, or of thousands of layers, on meta tensors is what made a dry run take
    minutes).

    Every count of a step (FLOPs, bytes of each collective and of the host link, each kind of
    phase's costs) is c0 + c1 P + c2 M in its passes P and micro-batches M, since a phase
    repeats per pass and its body per micro-batch, and each of those terms is linear in the
    stage's decoder layers L, which all have the same shapes. So is the working set, within
    one regime: one pass or several (the pass boundary overlaps two), one micro-batch per pass
    or several (what overlaps the next micro-batch is there from the second on; each further
    one keeps its loss), at least as many passes as pipeline stages (the schedule's warm-up
    and cool-down), and at least three layers (the middle one computes beside a layer ahead
    and a layer behind; further layers repeat it). :func:`_step_probes` picks probes of the
    plan's regime, :data:`LAYER_PROBES` layers each where the stage holds more, and the counts
    are combined exactly; the buffers are the full plan's, built without a step.
    ``progress``: told which probe is being measured.
    """
    probes, columns = _step_probes(plan, mesh.pp)
    if sum(m for _, m in probes) >= plan.gradient_accumulation:
        probes, columns = [(plan.memory.passes, plan.gradient_accumulation)], lambda p, m: (1,)
    stage = _layout(mesh).pp.rank
    layers = plan.stage_layers[stage]
    layer_probes = LAYER_PROBES if layers > LAYER_PROBES[-1] else (layers,)
    if len(probes) == len(layer_probes) == 1:
        return measure_engine_step(plan, mesh, spec, measurements)

    def terms(n: int, p: int, m: int) -> np.ndarray:
        per_layer = (1, n) if len(layer_probes) > 1 else (1,)
        return np.outer(per_layer, columns(p, m)).ravel()

    points = [(n, p, m) for n in layer_probes for p, m in probes]
    steps = []
    for index, (n, p, m) in enumerate(points):
        if progress is not None:
            step = f"step {index + 1} of {len(points)}"
            progress(f"{step}: {n} layers, {m} micro-batches in {p} pass(es)")
        probe = _with_stage_layers(plan.with_micro_batches(m, p), stage, n)
        steps.append(measure_engine_step(probe, mesh, spec, measurements))
    basis = np.array([terms(*point) for point in points], dtype=np.float64)
    full = terms(layers, plan.memory.passes, plan.gradient_accumulation).astype(np.float64)
    weights = full @ np.linalg.inv(basis)

    def at_full(values) -> float:
        return float(weights @ np.array(values, dtype=np.float64))

    first = steps[0]
    engine = PhasedEngine(plan, _layout(mesh))
    working_set = round(at_full([s.working_set for s in steps]))
    if mesh.pp > 1 and len(probes) > 2:
        working_set += pass_boundary_bytes(engine.state.activations.layout)
    return RankMeasurement(
        plan=plan.memory,
        fits=True,
        why="",
        buffer_bytes=engine.buffer_bytes(),
        working_set=working_set,
        comm_bytes={k: round(at_full([s.comm_bytes[k] for s in steps])) for k in first.comm_bytes},
        comm_seconds={k: at_full([s.comm_seconds[k] for s in steps]) for k in first.comm_seconds},
        flops=round(at_full([s.flops for s in steps])),
        phases={
            kind: tuple(
                at_full(values) for values in zip(*(s.phases[kind] for s in steps), strict=True)
            )
            for kind in first.phases
        },
    )


# Decoder layers of the steps that stand for a stage of more: the working set's regime starts
# at three (see measure_step), and two counts fix a line.
LAYER_PROBES = (3, 4)


def _with_stage_layers(plan: EnginePlan, stage: int, layers: int) -> EnginePlan:
    """``plan`` with pipeline stage ``stage`` holding ``layers`` decoder layers (the other
    stages, and where this one's layers start, as they were)."""
    stage_layers = list(plan.stage_layers)
    stage_layers[stage] = layers
    model = dataclasses.replace(plan.model, layers=sum(stage_layers))
    return dataclasses.replace(plan, model=model, stage_layers=tuple(stage_layers))


def pass_boundary_bytes(activations: ActivationLayout) -> int:
    """A pipeline stage's x and dx of one pass's micro-batches, what its working set is
    priced above the probes' linear combination by. Its receives (one pass's tensor each)
    and its sends (held until the step ends) peak where the largest pass falls, which the
    probes' even passes do not reproduce; the difference stays under one pass of both (a
    planned stage then fits with that much to spare, never short of it)."""
    return 2 * activations.entries * activations.entry_numel * activations.dtype.itemsize


def _step_probes(plan: EnginePlan, stages: int):
    """(passes, micro-batches) of the steps that stand for ``plan``'s, of its regime (see
    :func:`measure_step`), and the basis their counts are linear in."""
    passes, micro_batches = plan.memory.passes, plan.gradient_accumulation
    if passes == 1:
        return ((1, 2), (1, 3)), lambda p, m: (1, m)
    least = max(2, stages)
    if micro_batches == passes:  # one micro-batch per pass
        return ((least, least), (least + 1, least + 1)), lambda p, m: (1, p)
    probes = ((least, 2 * least), (least, 3 * least), (least + 1, 2 * least + 2))
    return probes, lambda p, m: (1, p, m)


def _layout(mesh: MeshShape) -> ParallelLayout:
    return ParallelLayout.build(mesh.dp, mesh.tp1, mesh.tp2, META, cp=mesh.cp, pp=mesh.pp)


def measure_engine_step(
    plan: EnginePlan,
    mesh: MeshShape,
    spec: DeviceSpec,
    measurements: Measurements | None = None,
) -> RankMeasurement:
    """Set-up and one training step of this fake job's rank, on meta tensors, measured
    (``measurements``: the planning's, whose meta results it replays)."""
    layout = _layout(mesh)
    kernel = attention_kernel(spec.device_type, plan.model.dropout_prob, DTYPES[plan.precision])
    compiled = spec.device_type if plan.compiles_on(spec.device_type) else None
    step = meta_step(plan, layout, kernel, measurements=measurements, compiled_on=compiled)
    comm, seconds = {}, {}
    for axis in layout.axes():
        comm[axis.name], seconds[axis.name] = axis_traffic(axis, spec)
    store = step.engine.state
    comm["host_link"] = store.host_to_device + store.device_to_host
    seconds["host_link"] = comm["host_link"] / (spec.host_link_gb_per_s * 1e9)
    buffers = step.engine.buffer_bytes()
    phases = phase_costs(step.windows, layout, spec)
    return RankMeasurement(
        plan=plan.memory,
        fits=True,
        why="",
        buffer_bytes=buffers,
        working_set=step.working_set,
        comm_bytes=comm,
        comm_seconds=seconds,
        flops=step.flops,
        phases=phases,
    )


def measure_rank(
    run: RunShape,
    rank: int,
    spec: DeviceSpec,
    measurements: Measurements | None = None,
    progress: Callable[[str], None] | None = None,
) -> RankMeasurement:
    """The planner's plan for ``rank`` on ``spec`` and its measured step; whether it fits
    (``progress``: told what is being done)."""
    progress = progress or (lambda _: None)
    budget = spec_budget(run, spec)  # the rule a real run plans by
    stage = run.mesh.coords(rank)["p"]
    progress("planning")
    choice = choose(run, budget, stage, on_miss="least", measurements=measurements)
    plan, planned_fit = choice.plan, choice.fits
    with fake_job(rank, run.world_size):
        m = measure_planned_step(run, plan, spec, measurements, progress=progress)
    m.plan = dataclasses.replace(plan, working_set=m.working_set)  # the full step's, measured
    m.fits = planned_fit and budget.fits(m.plan)
    m.why = fit_line(m.plan, budget, planned_fit)
    return m


def estimate(run: RunShape, m: RankMeasurement, spec: DeviceSpec) -> dict:
    """Step time, its breakdown (:func:`~execution.planning.time_model.estimate_step`) and MFU
    from a rank's measurements."""
    passes = m.plan.passes
    stages = run.mesh.pp
    out = estimate_step(m.phases, stages, passes, spec)
    model_flops = flops_per_token(run.model, run.sequence_length)
    per_rank = model_flops * run.tokens_per_step / run.world_size
    out["mfu"] = per_rank / (out["step_time_s"] * spec.peak_tflops * 1e12)
    out["bubble"] = bubble_fraction(stages, passes)
    ran = sum(costs[COST_INDEX["attention_flops"]] for costs in m.phases.values())
    out["mfu_ceiling"] = check_rank(run, m, ran, spec, out, final=stages == 1)
    return out


def dry_run(run: RunShape, output_dir: Path) -> dict:
    """Measures every kind of rank, prints the report and writes ``plan.json``."""
    spec = run.spec
    entries, measurements = [], Measurements()
    kinds = rank_kinds(run, spec.devices_per_node)
    # On a terminal only (disable=None), and cleared when done: what stays is the report.
    progress = tqdm(
        total=len(kinds), desc="dry run", unit="kind", file=sys.stderr, disable=None, leave=False
    )
    with progress:
        for ranks in kinds:
            progress.set_description(f"dry run: rank {ranks[0]} (for {len(ranks)} ranks)")
            entries.append(_entry(run, ranks, spec, measurements, progress.set_postfix_str))
            progress.update()
    if run.mesh.pp > 1:
        _pipeline_estimates(run.mesh, entries)
    report = {
        "world_size": run.world_size,
        "device_spec": vars(spec),
        "plan": entries[0]["plan"],
        "ranks": entries,
        "fits": all(e["fits"] for e in entries),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "plan.json").write_text(json.dumps(report, indent=2))
    print(format_report(run, report))
    print(f"written: {output_dir / 'plan.json'}")
    return report


def _entry(
    run: RunShape,
    ranks: list[int],
    spec: DeviceSpec,
    measurements: Measurements,
    progress: Callable[[str], None],
) -> dict:
    """One kind of rank's figures in ``plan.json``, measured on its first rank."""
    m = measure_rank(run, ranks[0], spec, measurements, progress)
    device, host = m.plan.bytes_on("device"), m.plan.bytes_on("host")
    return {
        "ranks": ranks,
        "host_bytes": {k: host[k] for k in STATE_KEYS if k in host},
        "device_bytes": {k: device[k] for k in STATE_KEYS if k in device},
        "comm_bytes": m.comm_bytes,
        "flops_per_step": m.flops,
        "checkpoint": checkpoint_figures(run, m.plan, spec, ranks[0]),
        **estimate(run, m, spec),
        "fits": m.fits,
        "why": m.why,
        "plan": _plan_dict(m.plan),
    }


def _pipeline_estimates(mesh: MeshShape, entries: list[dict]) -> None:
    """Each rank's step, bubble and MFU as the whole pipeline sets them
    (:func:`~execution.planning.time_model.pipeline_step`): a stage that holds more (the head's
    vocabulary matmuls, say) sets the pace, and the others wait for it."""
    stages: dict[int, list[dict]] = {}
    for entry in entries:
        stages.setdefault(mesh.coords(entry["ranks"][0])["p"], []).append(entry)
    step = pipeline_step(stages, entries[0]["plan"]["passes"])
    for entry in entries:
        own = entry["step_time_s"] - entry["bubble_s"]
        entry["mfu"] *= entry["step_time_s"] / step
        entry["bubble_s"] = step - own
        entry["bubble"] = entry["bubble_s"] / step  # this rank's idle share
        entry["step_time_s"] = step
        check_mfu(entry["mfu"], max(e["mfu_ceiling"] for e in entries))


def _plan_dict(plan: MemoryPlan) -> dict:
    return {
        "passes": plan.passes,
        "micro_batches_per_pass": plan.micro_batches_per_pass,
        "placement": vars(plan.placement),
        "recompute": plan.recompute,
    }


def check_input_files(patterns: list[str], blend: list[str] = ()) -> None:
    """The dry run reads no data, but the files it would train on must exist (``--data_blend``'s
    corpora, else the shipped sample when no ``--input_files`` are given)."""
    from data.blend import parse_blend
    from data.dataset import expand_files
    from data.loader import SAMPLE_DATA_GLOB

    if blend:
        for _, pattern in parse_blend(blend, "--data_blend"):
            expand_files([pattern])
        return
    expand_files(patterns or [SAMPLE_DATA_GLOB])

"""``--plan_for N``: the layouts of N devices that fit a preset, fastest first.

Each candidate layout (data_parallel x pipeline_parallel x context_parallel x tensor_parallel_1
x tensor_parallel_2 = N, a micro-batch size) gets the planner's passes and placements for
``--device_spec`` (the same on every pipeline stage). Its step is then measured
with the dry run's instruments, on meta tensors, but on a shrunk copy of the step: every count
the estimate needs (FLOPs, bytes of each collective and of the host link) is exactly
``c0 + c1 L + c2 P + c3 P L + c4 M + c5 M L`` in the layers L, passes P and micro-batches M of
the step, so six steps of 1 or 3 layers and 1-2 micro-batches determine it for the full preset.
Three layers, because the working set (the largest of the six) needs them: with overlapped
communication the middle layer computes beside the next one's weights gathered ahead and the
previous one's gradients still being reduced (as the planner's measurement,
:func:`execution.planning.measure.measured_working_set`).
A test checks the extrapolation against a full dry-run step.

A pipeline stage is measured as a rank of its *sibling* layout without the pipeline axis (dp x
pp replicas, the same tensor and context axes and micro-batch, so the same probes as that
layout's, measured once for every pipeline size), holding the largest stage's layers with the
embedding and the head (an upper bound on every stage's work) and the stage's micro-batches
per replica. The sibling's data-parallel group is pp times larger, so its ring all-gathers
send slightly more per byte: a conservative estimate. The step then takes (P + S - 1) / P
times as long (the bubble), plus the point-to-point moves of the busiest stage, exposed.
Buffers and the fit stay exact per stage (the planner's formulas). Only layouts whose tensor
and context axes fill a node get a pipeline (it is the axis that crosses nodes), which keeps
the search within its time, as do the pipeline sizes (2, 4, 8) and micro-batch sizes (1, 2)
it weighs.

The search's time: tensor and context axes that span nodes are weighed only with
``--plan_across_nodes``; layouts that share probes are measured in one process, and such
groups in ``--plan_workers`` processes side by side; the planner measures only the working
sets that may fit; and the step meter replays meta ops it has seen
(:mod:`execution.planning.step_meter`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from execution.engine.plan import MemoryPlan, Placement
from execution.engine.storage.buffers import DTYPES
from execution.parallel.fake_job import fake_job
from execution.parallel.launch import usable_cores
from execution.parallel.mesh import MeshShape, ParallelLayout
from execution.planning.checkpoint_cost import checkpoint_figures
from execution.planning.device_specs import DeviceSpec
from execution.planning.dry_run import (
    RankMeasurement,
    estimate,
    measure_engine_step,
)
from execution.planning.measure import Measurements
from execution.planning.memory import spec_budget
from execution.planning.micro_batch_limits import (
    check_plan_for_batch,
    divisors_of,
)
from execution.planning.planner import choose, shortfall
from execution.planning.run_shape import RunShape
from execution.planning.time_model import COST_INDEX, PHASE_COSTS, waited_call_seconds

# (layers, micro-batches, passes) of the shrunk steps; the rows [1, L, P, PL, M, ML] are
# linearly independent.
PROBES = ((1, 1, 1), (3, 1, 1), (1, 2, 1), (3, 2, 1), (1, 2, 2), (3, 2, 2))


def _basis(layers: int, micro_batches: int, passes: int) -> list[int]:
    return [1, layers, passes, passes * layers, micro_batches, micro_batches * layers]


def extrapolated_step(
    run: RunShape, plan: MemoryPlan, spec: DeviceSpec, probes: tuple | None = None
):
    """Rank 0's FLOPs, bytes per group and working set for the full step, from six small ones.

    Returns:
        (flops, comm bytes by group incl. ``host_link``, comm seconds by group, working set,
        per kind of phase its summed FLOPs, overlappable and critical seconds). The phase sums
        are linear in the same terms: a kind's phases repeat per layer and pass, and their
        work per micro-batch. ``probes``: ``_probes(run, plan, spec)`` if already taken.
    """
    samples, working_set = probes or _probes(run, plan, spec, Measurements())
    keys = ["flops", *samples[0].comm_bytes]
    matrix = np.array([_basis(*probe) for probe in PROBES], dtype=np.float64)
    values = np.array([[s.flops, *s.comm_bytes.values()] for s in samples], dtype=np.float64)
    coefficients = np.linalg.solve(matrix, values)
    full = np.array(_basis(run.model.layers, run.gradient_accumulation, plan.passes))
    totals = dict(zip(keys, (full @ coefficients).round().astype(np.int64).tolist(), strict=True))
    seconds = {}
    for group, nbytes in totals.items():
        if group == "flops":
            continue
        rate = samples[-1].comm_seconds[group] / max(samples[-1].comm_bytes[group], 1)
        seconds[group] = nbytes * rate
    flops = totals.pop("flops")
    kinds = sorted({kind for sample in samples for kind in sample.phases})
    width = len(PHASE_COSTS)
    per_sample = [
        [v for kind in kinds for v in sample.phases.get(kind, (0.0,) * width)] for sample in samples
    ]
    sums = full @ np.linalg.solve(matrix, np.array(per_sample, dtype=np.float64))
    phases = {
        kind: tuple(float(v) for v in sums[width * i : width * (i + 1)])
        for i, kind in enumerate(kinds)
    }
    return flops, totals, seconds, working_set, phases


# The micro-batch sizes --plan_for weighs for a layout without a pipeline.
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
# The pipelines it weighs, and their micro-batch sizes: a pipeline's bubble shrinks with more,
# smaller micro-batches, and each further size would take as long to plan again.
PIPELINES = (2, 4, 8)
PIPELINE_MICRO_BATCHES = (1, 2)


def _probes(run: RunShape, plan: MemoryPlan, spec: DeviceSpec, measurements: Measurements):
    """The six shrunk steps of a layout under a plan's placement and recompute, measured once
    per distinct shape in a planning (layouts that differ only in layers, batch or passes
    share them)."""
    # The plan's placement and recompute; its bytes are the full step's, not the probes'.
    placed = dataclasses.replace(plan, state_bytes={}, working_set=0, traffic=0)
    whole = run.engine_plan(placed)
    smalls = [whole.shrunk(layers, micro, passes) for layers, micro, passes in PROBES]
    # One stage of any pipeline runs a subset of the whole model's phases: measured whole.
    mesh = dataclasses.replace(run.mesh, pp=1)
    key = repr((smalls[0], mesh, vars(spec)))
    known = measurements.probes
    if key not in known:
        samples, working_set = [], 0
        with fake_job(0, mesh.world_size):
            for small in smalls:
                step = measure_engine_step(small, mesh, spec, measurements)
                samples.append(step)
                working_set = max(working_set, step.working_set)
        known[key] = samples, working_set
    return known[key]


def layouts(run: RunShape, devices: int, across_nodes: bool = False) -> list[RunShape]:
    """Every (dp, pp, cp, tp1, tp2, micro-batch) of ``devices`` that the model and batch
    allow (:meth:`RunShape.allows`: even splits, no more micro-batches per replica than the
    planner takes); a pipeline only where the tensor and context axes fill a node (the
    pipeline is the axis that crosses nodes); tensor and context axes that span nodes only
    ``across_nodes`` (``--plan_across_nodes``: their per-layer collectives would wait on the
    network, which is why Megatron keeps tensor parallelism inside a node). Each is ``run`` on that layout, its passes and pipeline split left to the planner."""
    per_node = run.spec.devices_per_node
    out = []
    divisors = divisors_of(devices)
    # Each axis's sizes that the model allows alone, so that the product stays small however
    # many divisors ``devices`` has (720720 has 240).
    axes = (
        [n for n in divisors if run.splits_evenly(tp1=n)],
        [n for n in divisors if run.splits_evenly(tp2=n)],
        [n for n in divisors if run.splits_evenly(cp=n)],
        [n for n in divisors if n == 1 or n in PIPELINES],
    )
    for tp1, tp2, cp, pp in itertools.product(*axes):
        if devices % (tp1 * tp2 * cp * pp):
            continue
        mesh = MeshShape(devices // (tp1 * tp2 * cp * pp), tp1, tp2, cp, pp)
        if spans_nodes(mesh, per_node) and not across_nodes:
            continue
        if pp > 1 and _inner(mesh) != min(per_node, devices // pp):
            continue
        for micro in MICRO_BATCH_SIZES if pp == 1 else PIPELINE_MICRO_BATCHES:
            if run.allows(mesh, micro):
                out.append(run.with_layout(mesh, micro, even_stages=True).with_request(passes=0))
    return out


def _sibling(run: RunShape) -> RunShape:
    """What a pipeline stage's rank is measured as: the layout without its pipeline axis (pp
    times the replicas), holding the largest stage's layers (and the embedding and head) and
    the same micro-batches per replica."""
    mesh, layers = run.mesh, max(run.stage_layers)
    return dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, layers=layers),
        mesh=dataclasses.replace(mesh, dp=mesh.dp * mesh.pp, pp=1),
        stage_layers=(layers,),
        global_batch_size=run.global_batch_size * mesh.pp,
    )


def _moves(run: RunShape, plan: MemoryPlan, spec: DeviceSpec) -> tuple[int, float]:
    """Bytes the busiest stage sends to its neighbours per step (x slices forward, dx back, per
    micro-batch), and their seconds on the pipeline group's links."""
    mesh = run.mesh
    if mesh.pp == 1:
        return 0, 0.0
    entry = run.micro_batch_size * run.sequence_length // mesh.cp
    entry *= run.model.hidden // mesh.tp2
    x_slice = -(-entry // mesh.tp1)
    # A middle stage sends both ways; with two stages the busier sends the whole dx.
    per_micro = x_slice + entry if mesh.pp > 2 else entry
    nbytes = run.gradient_accumulation * per_micro
    nbytes *= DTYPES[run.precision].itemsize
    within = _inner(mesh) * mesh.pp <= spec.devices_per_node
    rate = spec.intra_node_gb_per_s if within else spec.inter_node_gb_per_s
    return nbytes, nbytes / (rate * 1e9)


def weighed_run(run: RunShape) -> RunShape:
    """The run a search weighs: with ``--compile auto``, its parts priced eager. Pricing a
    layout's compiled parts takes seconds of inductor's scheduling per shard shape, minutes
    over a search of hundreds (``gpt3_175B --plan_for 256``: over 7 minutes, against about
    one eager); compiling lowers every layout's memory-bound work, so the order changes
    little, and the dry run of the layout chosen prices it compiled. ``--compile true``
    prices every layout compiled."""
    return dataclasses.replace(run, compile="false") if run.compile == "auto" else run


def search(
    run: RunShape,
    devices: int,
    measurements: Measurements | None = None,
    prune: bool = True,
    *,
    across_nodes: bool = False,
    workers: int = 0,
) -> tuple[list[dict], list[dict], int]:
    """Layouts of ``run``'s model and batch on ``devices`` that fit, each with its plan and
    estimate, fastest first; those that do not, each with its least-memory plan (``run``,
    ``plan``, ``shortfall`` in bytes); and how many layouts spanning nodes were pruned
    unmeasured.

    Layouts whose tensor and context groups stay inside a node are measured first. A layout
    whose groups span nodes (``--plan_across_nodes``) is then measured only if its
    :func:`tensor_parallel_floor` is below the fastest step found (``prune``; without it,
    every one is measured, as the test of the floor does).

    Layouts that share probes (:func:`_probe_group`) are measured together, and groups side by
    side in ``workers`` (``--plan_workers``; 0: one per usable core) forked processes:
    measuring is single-threaded Python, so each further core shortens the search about as
    much as the first. ``across_nodes``: ``--plan_across_nodes`` (:func:`layouts`).
    ``measurements``: what this process measured in an earlier planning (forked workers each
    add to a copy)."""
    measurements = measurements or Measurements()
    run = weighed_run(run)
    spec = run.spec
    check_plan_for_batch(run.global_batch_size, devices, max(MICRO_BATCH_SIZES))
    candidates = layouts(run, devices, across_nodes)
    within = [c for c in candidates if not spans_nodes(c.mesh, spec.devices_per_node)]
    spanning = [c for c in candidates if spans_nodes(c.mesh, spec.devices_per_node)]
    rows, misfits = _measure_layouts(within, measurements, workers)
    pruned = 0
    if spanning:
        if prune and rows:
            fastest = min(row["step_time_s"] for row in rows)
            kept = [c for c in spanning if tensor_parallel_floor(c, spec) < fastest]
            pruned = len(spanning) - len(kept)
            spanning = kept
        more_rows, more_misfits = _measure_layouts(spanning, measurements, workers)
        rows, misfits = rows + more_rows, misfits + more_misfits
    rows.sort(key=lambda r: (r["step_time_s"], r["device_bytes"]))
    misfits.sort(key=lambda m: m["shortfall"])
    return rows, misfits, pruned


def _inner(mesh: MeshShape) -> int:
    """Ranks of a layout's tensor and context axes, the innermost of the rank formula: those
    that communicate every layer, so that belong inside a node."""
    return mesh.tp1 * mesh.tp2 * mesh.cp


def spans_nodes(mesh: MeshShape, devices_per_node: int) -> bool:
    """Whether a layout's tensor and context groups span nodes (``--plan_across_nodes``)."""
    return _inner(mesh) > devices_per_node


def _measure_layouts(
    candidates: list[RunShape], measurements: Measurements, workers: int
) -> tuple[list[dict], list[dict]]:
    """:func:`_search_group` of each probe group, in worker processes where there are several
    (``workers``; 0: one per usable core)."""
    measure_group = functools.partial(_search_group, measurements=measurements)
    groups: dict[tuple, list[RunShape]] = {}
    for candidate in candidates:
        groups.setdefault(_probe_group(candidate), []).append(candidate)
    workers = min(workers or usable_cores(), len(groups))
    if workers > 1:
        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=fork) as pool:
            results = list(pool.map(measure_group, groups.values()))
    else:
        results = [measure_group(group) for group in groups.values()]
    rows = [row for group_rows, _ in results for row in group_rows]
    return rows, [misfit for _, group_misfits in results for misfit in group_misfits]


def tensor_parallel_floor(run: RunShape, spec: DeviceSpec) -> float:
    """A lower bound on a layout's step time, from what no plan avoids: the tensor-parallel
    all-reduces of each decoder layer's four matmuls, which every rank waits for where they are
    issued (on the critical path, :func:`~execution.planning.time_model.phase_costs`).

    Per layer and micro-batch of ``t`` tokens (2D layout, docs/design.md): forward, over tp2
    the QKV output ``[t, 3h/tp1]`` and the first feed-forward output ``[t, 4h/tp1]``, over tp1
    the attention projection's and second feed-forward's ``[t, h/tp2]``; backward, the
    conjugates: over tp1 the QKV and first feed-forward inputs' gradients ``[t, h/tp2]``, over
    tp2 the projection's and second feed-forward's ``[t, h/tp1]`` and ``[t, 4h/tp1]``. (With
    grouped-query attention the QKV output is ``h + 2 kv`` wide; SwiGLU's first feed-forward
    output, gate and up, twice its intermediate size; an explicit head width makes the
    attention's ``h`` heads x head width.) Each is
    priced as the time model prices it (across nodes at the network's rate); recompute, layer
    norm statistics, the embedding and the head only add to it. A test checks the bound
    against measured steps."""
    mesh, m = run.mesh, run.model
    h, tp1, tp2 = m.hidden, mesh.tp1, mesh.tp2
    attention = m.attention_width  # h, unless an explicit head width makes it another
    qkv = attention + 2 * m.key_value_heads * m.head_dim
    ffn_in = m.components.mlp.ROWS_PER_FEATURE * m.ffn
    layout = ParallelLayout.shapes_only(mesh.dp, tp1, tp2, cp=mesh.cp, pp=mesh.pp)
    tokens = run.micro_batch_size * run.sequence_length // mesh.cp
    itemsize = DTYPES[run.precision].itemsize
    widths = {
        layout.tp1: (h // tp2,) * 4,
        layout.tp2: (qkv // tp1, ffn_in // tp1, attention // tp1, m.ffn // tp1),
    }
    per_layer = sum(
        waited_call_seconds(axis, "all_reduce", tokens * width * itemsize, spec)
        for axis, columns in widths.items()
        for width in columns
    )
    return per_layer * min(run.stage_layers) * run.gradient_accumulation


def _probe_group(candidate: RunShape) -> tuple:
    """What a layout's probes depend on besides its plan: a rank's shards and micro-batch,
    and the replicas of the layout without its pipeline (a stage's sibling)."""
    mesh = candidate.mesh
    return (mesh.dp * mesh.pp, mesh.cp, mesh.tp1, mesh.tp2, candidate.micro_batch_size)


def _search_group(
    candidates: list[RunShape], measurements: Measurements
) -> tuple[list[dict], list[dict]]:
    """The rows of the layouts of one probe group that fit, and those that do not.

    A pipeline layout's passes trade its bubble against a data-parallel all-gather of every
    weight per pass, which the planner's quick ranking does not weigh as the estimate does:
    every pass count that fits is estimated under the planner's placement and recompute, and
    all on the device with full recompute (the probes do not depend on
    passes, so each adds one measurement per stage shape), and the fastest kept."""
    rows, misfits = [], []
    spec = candidates[0].spec  # the planning flags, the same for every layout
    budget = spec_budget(candidates[0], spec)  # the rule a real run plans by
    for candidate in candidates:
        sibling = _sibling(candidate) if candidate.mesh.pp > 1 else None
        choice = choose(
            candidate, budget, on_miss="nearest", measurements=measurements, measure_as=sibling
        )
        if not choice.fits:
            misfits.append(_misfit(candidate, [choice.plan], budget))
            continue
        options = [choice.plan]
        if sibling is not None:
            fitting = [choice.plan, *choice.others]
            keys = [(choice.plan.placement, choice.plan.recompute)]
            keys.append((Placement("device", "device", "device"), "full"))
            options = [p for p in fitting if (p.placement, p.recompute) in keys]
        best, probes = None, {}
        for option in options:
            key = (option.placement, option.recompute)
            if key not in probes:
                probes[key] = _probes(sibling or candidate, option, spec, measurements)
            row = _estimated_row(candidate, sibling or candidate, option, spec, probes[key])
            if budget.fits(row["plan"]) and (
                best is None or row["step_time_s"] < best["step_time_s"]
            ):
                best = row
        if best is None:
            misfits.append(_misfit(candidate, options, budget))
            continue
        rows.append({**best, "checkpoint": checkpoint_figures(candidate, best["plan"], spec)})
    return rows, misfits


def _misfit(candidate: RunShape, plans: list[MemoryPlan], budget) -> dict:
    """A layout that does not fit, with its plan nearest to fitting (None: none measured)."""
    least = min(plans, key=lambda p: shortfall(p, budget), default=None)
    missing = shortfall(least, budget) if least is not None else float("inf")
    return {"run": candidate, "plan": least, "shortfall": missing}


def _estimated_row(
    candidate: RunShape, measured_as: RunShape, plan: MemoryPlan, spec, probes
) -> dict:
    """A layout's row under ``plan``: its step extrapolated from the probes of ``measured_as``
    (itself, or a pipeline stage's sibling), with the pipeline's moves and bubble."""
    flops, comm, seconds, working_set, phases = extrapolated_step(measured_as, plan, spec, probes)
    plan = dataclasses.replace(plan, working_set=working_set)  # the full step's, measured
    if candidate.mesh.pp > 1:
        comm["pp"], seconds["pp"] = _moves(candidate, plan, spec)
        moves = [0.0] * len(PHASE_COSTS)
        moves[COST_INDEX["critical_comm_s"]] = seconds["pp"]
        phases = {**phases, "pipeline_moves": tuple(moves)}
    measured = RankMeasurement(
        plan=plan,
        fits=True,
        why="",
        buffer_bytes={},
        working_set=working_set,
        comm_bytes=comm,
        comm_seconds=seconds,
        flops=flops,
        phases=phases,
    )
    return {
        "run": candidate,
        "plan": plan,
        "device_bytes": plan.bytes_on("device")["total"],
        "host_bytes": plan.bytes_on("host")["total"],
        **estimate(candidate, measured, spec),
    }

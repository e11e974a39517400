"""The memory planner: how many passes a step takes and where each state lives.

docs/design.md, "The memory model" and "The time model", says how plans are costed.

Every plan the flags allow is costed by :mod:`execution.planning.memory` (buffers, host
traffic) and :mod:`execution.planning.measure` (the working set, measured). Plans are ranked by
their estimated step time (:func:`step_seconds`, which weighs each phase's host copies against
its own compute), then by the bytes they move between host and device, then by fewest passes;
the first that fits this process's memory is taken. A run that fits under no plan gets one line naming the
least memory it needs and the single flag changes that would make it fit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from config.loading import ConfigError
from config.schema import plannable_recompute
from execution.engine.engine import PhasedEngine
from execution.engine.phases.compiled import compile_unavailable
from execution.engine.phases.recompute import MODES, attention_kernel
from execution.engine.plan import (
    PLACED_STATES,
    PLACES,
    GiB,
    MemoryPlan,
    Placement,
    compiles,
)
from execution.parallel.mesh import ParallelLayout
from execution.parallel.mesh_shape import MeshShape
from execution.planning.measure import Measurements, measured_working_set
from execution.planning.memory import (
    MemoryBudget,
    RankShape,
    cap_device_memory,
    host_traffic_by_phase,
    measure_budget,
    micro_batches_per_pass,
    state_bytes,
    working_set_bytes,
)
from execution.planning.micro_batch_limits import (
    check_micro_batches,
    pass_counts,
)
from execution.planning.pipeline_figures import deciding_stages
from execution.planning.plan_ranking import step_timer
from execution.planning.run_shape import RunShape


def candidate_plans(
    run: RunShape,
    device_type: str,
    stage: int = 0,
    measure_as: RunShape | None = None,
    budget: MemoryBudget | None = None,
    measurements: Measurements | None = None,
    measured: bool = True,
) -> list[MemoryPlan]:
    """Every plan the flags allow for a rank of pipeline stage ``stage``, fastest first
    (:func:`step_seconds`; then least host traffic, fewest states on the host, fewest passes,
    least kept), each with its working set measured on the real step (``measured``; else the
    quick formula's: the order does not depend on it).

    ``measure_as``: the run whose step measures the working set (``--plan_for`` shares one
    across pipeline sizes). ``budget``: measure a recompute mode's working set only if one of
    its plans fits ``budget`` before any working set (a plan that does not fit without one
    fits with none); the others get the quick formula's, so only whether they fit is exact.
    ``measurements``: what this planning measured before.
    """

    def working_set(mode: str, plans: list[MemoryPlan]) -> int | None:
        if not measured or (budget is not None and not any(budget.fits(p) for p in plans)):
            return None
        return measured_working_set(measure_as or run, device_type, mode, measurements)

    check_micro_batches(run)
    layers = measurements.layers if measurements is not None else None
    rank = RankShape.of(run, stage, layer_memo=layers)
    passes = pass_counts(rank.gradient_accumulation)
    return _plans(run, device_type, rank, passes, working_set)


def advisory_plans(
    run: RunShape, device_type: str, layer_memo: dict | None = None
) -> list[MemoryPlan]:
    """Per placement and recompute mode, the plan of least memory (the most passes), with the
    quick formula's working set: what a one-line suggestion weighs, for each flag it tries (a
    measured step for each would take minutes). ``layer_memo``: layer measurements shared by
    the suggestions' runs (:attr:`RankShape.layer_memo`)."""
    rank = RankShape.of(run, layer_memo=layer_memo)
    return _plans(run, device_type, rank, [rank.gradient_accumulation], lambda *_: None)


def _plans(
    run: RunShape,
    device_type: str,
    rank: RankShape,
    pass_options: list[int],
    working_set: Callable[[str, list[MemoryPlan]], int | None],
) -> list[MemoryPlan]:
    """The plans of every placement and recompute mode the flags allow, at ``pass_options``
    passes (``--passes`` where given), fastest first; ``working_set(mode, plans)`` gives a
    mode's measured working set, or None for the quick formula's."""
    request = run.request
    fixed = request.fixed_places()
    ga = rank.gradient_accumulation
    if request.passes:
        pass_options = [request.passes]
    places = [[fixed[s]] if fixed[s] else list(PLACES) for s in PLACED_STATES]
    kernel = attention_kernel(device_type, run.model.dropout_prob, rank.dtype)
    asked = MODES if request.recompute == "auto" else (request.recompute,)
    plannable = plannable_recompute(run.mesh.cp)
    # A layout that cannot run the mode asked for (one --plan_for tries) runs the one it can.
    modes = [m for m in asked if m in plannable] or [plannable[0]]
    shared = device_type == "cpu"

    # On a CPU device a host placement only adds copies: prefer the device, then fewer passes.
    def hosted(plan: MemoryPlan) -> int:
        return sum(getattr(plan.placement, s) == "host" for s in PLACED_STATES)

    seconds = step_timer(run, rank, kernel)
    ranked = []
    for mode in modes:
        kept = rank.kept(mode, kernel, compiles(run.compile, device_type))
        mode_plans, mode_copies = [], []
        for where, passes in itertools.product(itertools.product(*places), pass_options):
            placement, entries = Placement(*where), micro_batches_per_pass(ga, passes)
            copies = None
            if not shared:  # by phase once: the ranking weighs each phase's copies too
                copies = host_traffic_by_phase(rank, placement, passes, entries, kept)
            entry = kept.bytes_for(placement.activations)
            state = state_bytes(rank, entries, placement, entry, passes)
            mode_plans.append(
                MemoryPlan(
                    passes=passes,
                    micro_batches_per_pass=entries,
                    placement=placement,
                    state_bytes=state,
                    working_set=0,
                    traffic=sum(copies.values()) if copies else 0,
                    shared_memory=shared,
                    recompute=mode,
                    kept=entry,
                )
            )
            mode_copies.append(copies)
        measured = working_set(mode, mode_plans)
        quick: dict[Placement, int] = {}  # the formula depends on the placement alone
        for plan, copies in zip(mode_plans, mode_copies, strict=True):
            working = measured
            if working is None:
                if plan.placement not in quick:
                    quick[plan.placement] = working_set_bytes(
                        rank,
                        plan.placement,
                        kernel != "math",
                        run.prefetch,
                        run.overlap_communication,
                    )
                working = quick[plan.placement]
            plan = dataclasses.replace(plan, working_set=working)
            key = (seconds(plan, copies), plan.traffic, hosted(plan), plan.passes)
            ranked.append((*key, MODES.index(mode), plan))
    ranked.sort(key=lambda entry: entry[:-1])
    return [entry[-1] for entry in ranked]


def fastest_fitting(plans: list[MemoryPlan], budget: MemoryBudget) -> MemoryPlan | None:
    """The first plan of ``plans`` (ranked fastest first) that fits ``budget``."""
    return next((plan for plan in plans if budget.fits(plan)), None)


def _same_choice(plan: MemoryPlan) -> tuple:
    """What every stage of a pipeline must choose alike: passes, placement, recompute."""
    return plan.passes, plan.placement, plan.recompute


def plans_fitting_every_stage(
    run: RunShape,
    device_type: str,
    budget: MemoryBudget,
    stage: int,
    measure_as: RunShape | None = None,
    fitting_only: bool = False,
    measurements: Measurements | None = None,
) -> tuple[list[MemoryPlan], list[MemoryPlan]]:
    """Stage ``stage``'s plans, fastest first, and those of them whose choices fit on every
    stage, in the first stage's order: every stage then picks the same passes, placement and
    recompute (their steps must match), with its own bytes. ``fitting_only`` (``--plan_for``,
    where plans that do not fit are of no interest): measure the working sets of only the
    recompute modes that may fit (the ``budget`` of :func:`candidate_plans`)."""
    plan_options = {
        "measure_as": measure_as,
        "budget": budget if fitting_only else None,
        "measurements": measurements or Measurements(),  # the stages share what they measure
    }
    plans = candidate_plans(run, device_type, stage=stage, **plan_options)
    if run.mesh.pp == 1:
        return plans, plans
    deciding = deciding_stages(run.stage_layers)
    by_stage = {
        s: plans if s == stage else candidate_plans(run, device_type, stage=s, **plan_options)
        for s in {0, *deciding}
    }
    fitting = [{_same_choice(p) for p in ps if budget.fits(p)} for ps in by_stage.values()]
    mine = {_same_choice(p): p for p in plans}
    order = [_same_choice(p) for p in by_stage[0]]
    everywhere = [mine[c] for c in order if all(c in f for f in fitting)]
    return plans, everywhere


def first_fitting_every_stage(
    run: RunShape,
    device_type: str,
    budget: MemoryBudget,
    stage: int = 0,
    measurements: Measurements | None = None,
) -> MemoryPlan | None:
    """What ``fastest_fitting(plans_fitting_every_stage(...)[1], budget)`` chooses, measuring
    only the working sets it needs to get there.

    The ranking does not depend on the working sets, and a recompute mode's working set is the
    same on every stage (:func:`measured_working_set`), so the choices are walked fastest
    first and a mode is measured when a choice of it comes up: a run with memory to spare
    measures one mode instead of every one (a step on meta tensors each)."""
    measurements = measurements or Measurements()
    stages = {stage}
    if run.mesh.pp > 1:
        stages |= {0, *deciding_stages(run.stage_layers)}
    unmeasured = {
        s: candidate_plans(run, device_type, s, measurements=measurements, measured=False)
        for s in stages
    }
    by_stage = {s: {_same_choice(p): p for p in plans} for s, plans in unmeasured.items()}
    order = unmeasured[0 if len(stages) > 1 else stage]
    working_sets: dict[str, int] = {}
    for choice in map(_same_choice, order):
        mode = choice[2]
        if mode not in working_sets:
            working_sets[mode] = measured_working_set(run, device_type, mode, measurements)
        measured = {
            s: dataclasses.replace(plans[choice], working_set=working_sets[mode])
            for s, plans in by_stage.items()
            if choice in plans
        }
        if len(measured) == len(by_stage) and all(map(budget.fits, measured.values())):
            return measured[stage]
    return None


def choose_plan(
    run: RunShape,
    device_type: str,
    budget: MemoryBudget,
    stage: int = 0,
    measurements: Measurements | None = None,
) -> MemoryPlan:
    """The fastest plan that fits ``budget``; a one-line ConfigError when none does.

    With a pipeline, the stages hold different layers and passes in flight but must run the
    same passes: the plan is the fastest whose choices fit on every stage (stage ``stage``'s
    bytes are returned)."""
    measurements = measurements or Measurements()
    plan = first_fitting_every_stage(run, device_type, budget, stage, measurements)
    if plan is not None:
        return plan
    plans, _ = plans_fitting_every_stage(run, device_type, budget, stage, measurements=measurements)
    least = min(plans, key=lambda p: shortfall(p, budget))
    need = least.bytes_on("device")["total"], least.bytes_on("host")["total"]
    if budget.device is None:
        needed = f"{sum(need) / GiB:,.1f} GiB"
    else:
        needed = f"{need[0] / GiB:,.1f} GiB of device and {need[1] / GiB:,.1f} GiB of host memory"
    raise ConfigError(
        f"this run needs at least {needed} per process (with {least.passes} pass(es), "
        f"{least.placement.describe()}), but it may use {budget.describe()}; "
        f"{_suggestions(run, device_type, budget)}"
    )


def plan_for_process(
    run: RunShape,
    layout: ParallelLayout,
    measurements: Measurements | None = None,
) -> tuple[MemoryPlan, MemoryBudget]:
    """The fastest plan that fits the memory this process may use, and that budget
    (``measurements``: what an earlier planning in this process measured, to reuse).

    Raises:
        ConfigError: no plan fits (one line with the least memory needed and what would fit).
    """
    budget = measure_budget(run, layout.device, layout.local_world_size)
    cap_device_memory(run, layout.device)
    device_type = layout.device.type
    if compiles(run.compile, device_type) and compile_unavailable(device_type):
        run = dataclasses.replace(run, compile="false")  # the engine will run eager: plan that
    plan = choose_plan(run, device_type, budget, layout.pp.rank, measurements)
    return plan, budget


def planned_engine(
    run: RunShape,
    layout: ParallelLayout,
    measurements: Measurements | None = None,
) -> PhasedEngine:
    """This rank's engine under the plan :func:`plan_for_process` chooses."""
    plan, _ = plan_for_process(run, layout, measurements)
    return PhasedEngine(run.engine_plan(plan), layout)


def choose_or_least(
    run: RunShape,
    budget: MemoryBudget,
    stage: int = 0,
    measurements: Measurements | None = None,
) -> tuple[MemoryPlan, bool]:
    """The planner's choice for a GPU of ``budget`` and True, or, when nothing fits, the plan
    that needs the least device memory and False (so a dry run can show what it would take);
    for a rank of pipeline stage ``stage``."""
    measurements = measurements or Measurements()
    plan = first_fitting_every_stage(run, "cuda", budget, stage, measurements)
    if plan is not None:
        return plan, True
    plans, _ = plans_fitting_every_stage(run, "cuda", budget, stage, measurements=measurements)
    return min(plans, key=lambda p: (p.bytes_on("device")["total"], p.traffic)), False


def shortfall(plan: MemoryPlan, budget: MemoryBudget) -> float:
    device, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
    if budget.device is None:
        return device + host - budget.host
    return max(device - budget.device, 0) + max(host - budget.host, 0)


def _suggestions(run: RunShape, device_type: str, budget: MemoryBudget) -> str:
    """Flags that would make the run fit, tried one change at a time: first letting the planner
    choose what the flags fixed, then smaller micro-batches, then more processes."""
    request, mesh, micro = run.request, run.mesh, run.micro_batch_size
    changes: list[tuple[str, RunShape, str]] = []
    if request.passes:
        changes.append(("passes", run.with_request(passes=0), f"without --passes {request.passes}"))
    fixed = request.placement_flags()
    if fixed:
        flags = " ".join(f"--{n} {v}" for n, v in fixed.items())
        changes.append(
            ("placements", run.with_request(**dict.fromkeys(fixed, "auto")), f"without {flags}")
        )
    smaller = micro // 2
    while smaller >= 1:
        shown = f"--micro_batch_size {smaller}"
        changes.append(("micro_batch_size", _relaid(run, mesh, smaller), shown))
        smaller //= 2
    for factor in (2, 4, 8, 16, 32, 64):
        for name, axis in AXIS_FLAGS.items():
            grown = dataclasses.replace(mesh, **{axis: getattr(mesh, axis) * factor})
            shown = f"--{name} {getattr(grown, axis)} ({grown.world_size} processes)"
            changes.append((name, _relaid(run, grown, micro), shown))
    found: dict[str, str] = {}
    layer_memo: dict = {}  # the changed runs share most of their layers' shapes
    for name, changed, text in changes:
        if name in found or changed is None:
            continue
        plans = advisory_plans(changed, device_type, layer_memo)
        if any(budget.fits(p) for p in plans):
            found[name] = text
    if not found:
        return "no single change of passes, placement, micro-batch size or parallelism makes it fit"
    return "it would fit " + " or ".join(
        t if t.startswith("without") else f"with {t}" for t in found.values()
    )


# The flags of the axes a suggestion grows, by the mesh's name of each.
AXIS_FLAGS = {
    "data_parallel": "dp",
    "tensor_parallel_1": "tp1",
    "tensor_parallel_2": "tp2",
    "context_parallel": "cp",
}


def _relaid(run: RunShape, mesh: MeshShape, micro_batch_size: int) -> RunShape | None:
    """``run`` on ``mesh`` in micro-batches of ``micro_batch_size``; None where the model or
    batch does not split over it."""
    if not run.allows(mesh, micro_batch_size):
        return None
    return run.with_layout(mesh, micro_batch_size)

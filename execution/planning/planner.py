"""The memory planner: how many passes a step takes and where each state lives.

docs/design.md, "The memory model" and "The time model", says how plans are costed.

Every plan the flags allow is costed by :mod:`execution.planning.memory` (buffers, host
traffic) and :mod:`execution.planning.measure` (the working set, measured). Plans are ranked by
their estimated step time (:func:`step_seconds`, which weighs each phase's host copies against
its own compute), then by the bytes they move between host and device, then by fewest passes;
:func:`choose` takes the first that fits this process's memory. A run's start, the dry run
and ``--plan_for`` all choose through it, differing only in what a miss gives: a run that
fits under no plan gets one line naming the least memory it needs and the single flag changes
that would make it fit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

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
    measurements: Measurements | None = None,
) -> list[MemoryPlan]:
    """Every plan the flags allow for a rank of pipeline stage ``stage``, fastest first
    (:func:`step_seconds`; then least host traffic, fewest states on the host, fewest passes,
    least kept), each with the quick formula's working set: the order does not depend on it,
    and :func:`choose` measures the working sets it needs (``measurements``: what this
    planning measured before)."""
    check_micro_batches(run)
    layers = measurements.layers if measurements is not None else None
    rank = RankShape.of(run, stage, layer_memo=layers)
    return _plans(run, device_type, rank, pass_counts(rank.gradient_accumulation))


def measured_plans(
    run: RunShape,
    device_type: str,
    stage: int = 0,
    measurements: Measurements | None = None,
) -> list[MemoryPlan]:
    """:func:`candidate_plans` with each recompute mode's working set measured (a step on meta
    tensors each): every plan's exact bytes."""
    measurements = measurements or Measurements()
    plans = candidate_plans(run, device_type, stage, measurements)
    return _measured(plans, _working_sets(run, device_type, measurements))


def advisory_plans(
    run: RunShape, device_type: str, layer_memo: dict | None = None
) -> list[MemoryPlan]:
    """Per placement and recompute mode, the plan of least memory (the most passes), with the
    quick formula's working set: what a one-line suggestion weighs, for each flag it tries (a
    measured step for each would take minutes). ``layer_memo``: layer measurements shared by
    the suggestions' runs (:attr:`RankShape.layer_memo`)."""
    rank = RankShape.of(run, layer_memo=layer_memo)
    return _plans(run, device_type, rank, [rank.gradient_accumulation])


def _plans(
    run: RunShape,
    device_type: str,
    rank: RankShape,
    pass_options: list[int],
) -> list[MemoryPlan]:
    """The plans of every placement and recompute mode the flags allow, at ``pass_options``
    passes (``--passes`` where given), fastest first, with the quick formula's working sets."""
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

    quick: dict[Placement, int] = {}  # the formula depends on the placement alone

    def working_set(placement: Placement) -> int:
        if placement not in quick:
            quick[placement] = working_set_bytes(
                rank,
                placement,
                kernel != "math",
                run.prefetch,
                run.overlap_communication,
                run.fixed_weight_buffers,
            )
        return quick[placement]

    seconds = step_timer(run, rank, kernel)
    ranked = []
    for mode in modes:
        kept = rank.kept(mode, kernel, compiles(run.compile, device_type))
        for where, passes in itertools.product(itertools.product(*places), pass_options):
            placement, entries = Placement(*where), micro_batches_per_pass(ga, passes)
            copies = None
            if not shared:  # by phase once: the ranking weighs each phase's copies too
                copies = host_traffic_by_phase(rank, placement, passes, entries, kept)
            entry = kept.bytes_for(placement.activations)
            plan = MemoryPlan(
                passes=passes,
                micro_batches_per_pass=entries,
                placement=placement,
                state_bytes=state_bytes(rank, entries, placement, entry, passes),
                working_set=working_set(placement),
                traffic=sum(copies.values()) if copies else 0,
                shared_memory=shared,
                recompute=mode,
                kept=entry,
            )
            key = (seconds(plan, copies), plan.traffic, hosted(plan), plan.passes)
            ranked.append((*key, MODES.index(mode), plan))
    ranked.sort(key=lambda entry: entry[:-1])
    return [entry[-1] for entry in ranked]


# What :func:`choose` gives when no plan fits: raise a one-line ConfigError (a run's start);
# the plan that needs the least device memory, every working set measured (a dry run shows
# what it would take); or the plan nearest to fitting, measuring only the working sets that
# may fit (a ``--plan_for`` layout that does not fit, among hundreds).
ON_MISS = ("raise", "least", "nearest")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the planner chose for a rank.

    Attributes:
        plan: The fastest plan whose choices fit on every stage, with its measured working
            set; when none does, the plan :data:`ON_MISS` names.
        fits: Whether ``plan`` is the planner's choice (False: nothing fits).
        others: The further plans whose choices fit on every stage, fastest first, found as
            they are drawn (each recompute mode measured when first reached); empty on a miss.
    """

    plan: MemoryPlan
    fits: bool
    others: Iterator[MemoryPlan] = dataclasses.field(
        default_factory=lambda: iter(()), compare=False, repr=False
    )


def choose(
    run: RunShape,
    budget: MemoryBudget,
    stage: int = 0,
    on_miss: str = "raise",
    *,
    device_type: str = "cuda",
    measurements: Measurements | None = None,
    measure_as: RunShape | None = None,
) -> Choice:
    """The planner's one choice: the fastest plan that fits ``budget``, for a rank of pipeline
    stage ``stage``; ``on_miss`` (:data:`ON_MISS`) says what comes back when none does.

    With a pipeline, the stages hold different layers and passes in flight but must run the
    same passes: the plan is the fastest whose passes, placement and recompute fit on every
    stage that decides (in the first stage's order), with stage ``stage``'s bytes. The ranking
    does not depend on the working sets, and a recompute mode's working set is the same on
    every stage (:func:`measured_working_set`), so the choices are walked fastest first and a
    mode is measured when a choice of it that fits before any working set comes up: a run with
    memory to spare measures one mode (a step on meta tensors each), not three.

    ``measure_as``: the run whose step measures the working sets (``--plan_for`` measures a
    pipeline stage as its sibling without the pipeline). ``measurements``: what this planning
    measured before, kept for the rest of it.

    Raises:
        ConfigError: nothing fits and ``on_miss`` is ``raise`` (one line with the least memory
            needed and the single flag changes that would make it fit).
    """
    if on_miss not in ON_MISS:
        raise ValueError(f"on_miss must be one of {ON_MISS}, not {on_miss!r}")
    measurements = measurements or Measurements()
    working_set = _working_sets(measure_as or run, device_type, measurements)
    stages = {stage}
    if run.mesh.pp > 1:
        stages |= {0, *deciding_stages(run.stage_layers)}
    by_stage = {s: candidate_plans(run, device_type, s, measurements) for s in stages}
    walk = _fitting_every_stage(by_stage, stage, budget, working_set)
    plan = next(walk, None)
    if plan is not None:
        return Choice(plan, True, walk)
    plans = by_stage[stage]
    if on_miss == "nearest":
        may_fit = {p.recompute for p in plans if budget.fits(_unmeasured(p))}
        plans = _measured(plans, working_set, may_fit)
        return Choice(min(plans, key=lambda p: shortfall(p, budget)), False)
    plans = _measured(plans, working_set)
    if on_miss == "least":
        return Choice(min(plans, key=lambda p: (p.bytes_on("device")["total"], p.traffic)), False)
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


def _fitting_every_stage(
    by_stage: dict[int, list[MemoryPlan]],
    stage: int,
    budget: MemoryBudget,
    working_set: Callable[[str], int],
) -> Iterator[MemoryPlan]:
    """Stage ``stage``'s plans whose passes, placement and recompute fit ``budget`` on every
    stage of ``by_stage`` (each stage's plans, unmeasured), in the first stage's order, each
    with its mode's measured working set."""
    choices = {s: {_same_choice(p): p for p in plans} for s, plans in by_stage.items()}
    order = by_stage[0] if 0 in by_stage else by_stage[stage]
    for choice in map(_same_choice, order):
        plans = {s: found.get(choice) for s, found in choices.items()}
        if any(p is None or not budget.fits(_unmeasured(p)) for p in plans.values()):
            continue  # a plan that does not fit without a working set fits with none
        working = working_set(choice[2])
        measured = {s: dataclasses.replace(p, working_set=working) for s, p in plans.items()}
        if all(map(budget.fits, measured.values())):
            yield measured[stage]


def _same_choice(plan: MemoryPlan) -> tuple:
    """What every stage of a pipeline must choose alike: passes, placement, recompute."""
    return plan.passes, plan.placement, plan.recompute


def _unmeasured(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` before any working set: what fits with one fits without."""
    return dataclasses.replace(plan, working_set=0)


def _working_sets(run: RunShape, device_type: str, measurements: Measurements):
    """Each recompute mode's working set as ``run``'s step measures it, once per mode."""
    known: dict[str, int] = {}

    def working_set(mode: str) -> int:
        if mode not in known:
            known[mode] = measured_working_set(run, device_type, mode, measurements)
        return known[mode]

    return working_set


def _measured(
    plans: list[MemoryPlan], working_set: Callable[[str], int], modes: set[str] | None = None
) -> list[MemoryPlan]:
    """``plans`` with the measured working sets of ``modes`` (None: every mode's); the others
    keep the quick formula's."""
    return [
        dataclasses.replace(p, working_set=working_set(p.recompute))
        if modes is None or p.recompute in modes
        else p
        for p in plans
    ]


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
    choice = choose(run, budget, layout.pp.rank, device_type=device_type, measurements=measurements)
    return choice.plan, budget


def planned_engine(
    run: RunShape,
    layout: ParallelLayout,
    measurements: Measurements | None = None,
) -> PhasedEngine:
    """This rank's engine under the plan :func:`plan_for_process` chooses."""
    plan, _ = plan_for_process(run, layout, measurements)
    return PhasedEngine(run.engine_plan(plan), layout)


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

"""Runs a list of phases over one step: each phase's body (:data:`~execution.engine.phases.bodies.BODIES`),
with the next phase's weights loading behind it (``--prefetch``, ``--overlap_communication``)
and the pipeline's transfers posted before the first and waited for after the last. The
engine runs a training step's phases and an evaluation's through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from execution.engine.phases import schedule
from execution.engine.phases.bodies import BODIES
from execution.engine.phases.compiled import CompileWatch
from execution.engine.phases.schedule import LAYER_BACKWARD, LAYER_FORWARD, Phase
from execution.engine.phases.step import Step
from execution.parallel.collective_errors import CollectiveError
from utils.torch_private import eager_where_compiling_fails


def run_phases(
    run: Step,
    phases: list[Phase],
    watch: CompileWatch,
    on_phase: Callable[[Phase | None], None] | None = None,
) -> int:
    """Runs each phase's body; with ``--prefetch`` or ``--overlap_communication``, first
    starts loading the next phase's weights, so that their copy (and with overlap, their
    all-gather) runs behind this phase's compute. Returns how many graphs of the compiled
    parts failed to compile and ran eagerly (0 when the parts run eager)."""
    ctx = run.context
    state, dtype, overlap = ctx.state, ctx.dtype, ctx.plan.overlap_communication
    state.drop_prefetched()  # none left by a step that raised half-way
    ctx.link.start(phases)
    # The next phase that loads weights (a pipeline's moves load none).
    loading = [n for n, phase in enumerate(phases) if schedule.weights_loaded(phase)]
    following = dict(zip(loading, [*loading[1:], None], strict=True))
    current = "the phases"
    # A compiled part whose graph fails to compile runs eagerly, and the run goes on.
    compiling = eager_where_compiling_fails() if ctx.compiled else contextlib.nullcontext()
    watch.failed_since_last()  # none left by a step that raised half-way
    try:
        with compiling:
            for n, phase in enumerate(phases):
                current = _phase_name(phase)
                if on_phase is not None:
                    on_phase(phase)
                ahead = following.get(n, loading[0] if n < loading[0] else None)
                later = []  # prefetches that would wait for the update: after this phase
                if (ctx.plan.prefetch or overlap) and ahead is not None and n < ahead:
                    loads = schedule.weights_loaded(phases[ahead])
                    later = state.prefetch_unless_waiting(loads, dtype, overlap)
                BODIES[phase.kind](run, phase)
                for part, row in later:
                    state.prefetch_weights(part, row, dtype, gather=overlap)
        current = "the last transfers of the phases"
        run.in_flight.finish()  # the norm and the optimizer read every gradient
        ctx.link.finish()  # every boundary activation sent has arrived
    except CollectiveError as err:
        err.during(current)
        raise
    if on_phase is not None:
        on_phase(None)
    failed = watch.failed_since_last() if ctx.compiled else 0
    # Every prefetch is used by the phase it was issued for; none may outlive the schedule
    # (the optimizer is about to change the weights it copied).
    unused = state.drop_prefetched()
    assert unused == 0, f"{unused} prefetched part(s) never loaded"
    return failed


def _phase_name(phase: Phase) -> str:
    """How a one-line error names a phase: "layer_forward phase of layer 2"."""
    layer = f" of layer {phase.layer}" if phase.kind in (LAYER_FORWARD, LAYER_BACKWARD) else ""
    return f"{phase.kind} phase{layer}"

"""How the planner ranks plans: a quick step time from FLOPs and each phase's host copies.

The dry run's per-op model (:mod:`execution.planning.time_model`) needs a step measured on
meta tensors per plan; the planner ranks every placement, pass count and recompute mode of a
rank before it measures anything, so it weighs them by what separates them: compute against
each phase's host copies, recompute, and the all-gathers that every further pass repeats.
"""

from __future__ import annotations

import dataclasses

from execution.engine.phases import schedule
from execution.engine.plan import MemoryPlan, compiles
from execution.planning.measure import recompute_flops
from execution.planning.memory import RankShape, host_traffic_by_phase
from execution.planning.pipeline_figures import step_stretch
from execution.planning.run_shape import RunShape
from modelling.gpt import EMBEDDING, HEAD, LAYERS
from utils.metrics import flops_per_token


def step_seconds(run: RunShape, rank: RankShape, kernel: str, plan: MemoryPlan):
    """What the planner ranks plans by, at ``--device_spec``'s rates (on a CPU device only the
    relative sizes matter): the forward phases' compute, their host copies or their host's
    own time, whichever is longest, the same of the backward phases (recompute included),
    the optimizer's copies, and the data-parallel weight all-gathers that every pass after
    the first repeats. The host's time is the calibration's per phase and micro-batch
    (:func:`host_seconds`), where it measured it: more passes are more phases, and a mode
    that keeps a layer's graph costs its host more than a recompute; on a device whose
    cores are the host's (a CPU) it adds to the rest.

    Forward and backward are weighed apart because a phase's copies hide behind its own
    compute only, as the dry run estimates them: weights streamed in many passes load each
    layer twice per pass while the forward holds a third of the compute, so copies that
    would fit behind the step's whole compute still leave the forward waiting on the link
    (gpt3_1.3B on an H100: 658 GiB a step, 6 s of forward copies behind 4.6 s of compute)."""
    return step_timer(run, rank, kernel)(plan)


def step_timer(run: RunShape, rank: RankShape, kernel: str):
    """:func:`step_seconds` of the plans of one rank, with what they share worked out once."""
    spec = run.spec
    model = flops_per_token(run.model, rank.sequence)
    model_flops = model * run.tokens_per_step / run.world_size
    rate = spec.peak_tflops * 1e12 * spec.compute_efficiency
    link = spec.host_link_gb_per_s * 1e9
    pass_gathers = _pass_gather_seconds(run, rank, spec)
    stages = run.mesh.pp

    def seconds(plan: MemoryPlan, copies: dict[str, int] | None = None) -> float:
        """``copies``: the plan's :func:`host_traffic_by_phase`, where already worked out."""
        recompute = recompute_flops(rank, plan.recompute, kernel)
        recompute *= rank.shapes.layers * rank.gradient_accumulation
        if plan.shared_memory:
            copies = {"forward": 0, "backward": 0, "optimizer": 0}
        elif copies is None:
            kept = rank.kept(plan.recompute, kernel)
            entries = plan.micro_batches_per_pass
            copies = host_traffic_by_phase(rank, plan.placement, plan.passes, entries, kept)
        # The forward is a third of a step's model FLOPs (a backward is twice its forward).
        forward = max(model_flops / 3 / rate, copies["forward"] / link)
        backward = max((2 * model_flops / 3 + recompute) / rate, copies["backward"] / link)
        host = host_seconds(run, rank, plan)
        if spec.queues_kernels:  # the host runs beside the kernels
            forward, backward = max(forward, host["forward"]), max(backward, host["backward"])
        else:
            forward, backward = forward + host["forward"], backward + host["backward"]
        # A pipeline's P passes take P + S - 1 pass-times (the bubble).
        bubble = step_stretch(stages, plan.passes)
        step = (forward + backward) * bubble + copies["optimizer"] / link
        return step + (plan.passes - 1) * pass_gathers

    return seconds


# The kinds of phase of a pass's forward and backward, by the quick estimate's halves.
HOST_HALVES = {
    "forward": (schedule.EMBEDDING_FORWARD, schedule.LAYER_FORWARD, schedule.HEAD_PHASE),
    "backward": (schedule.LAYER_BACKWARD, schedule.EMBEDDING_BACKWARD),
}


def host_seconds(run: RunShape, rank: RankShape, plan: MemoryPlan) -> dict[str, float]:
    """The host's own time in a step's forward and backward phases under ``plan``, as the
    calibration measured it per phase and micro-batch (``DeviceSpec.host_row``; 0 where the
    spec holds none): each layer's phases once per pass, the embedding's and the head's
    once per pass, each over its micro-batches."""
    spec = run.spec
    way = (compiles(run.compile, spec.device_type), plan.recompute, run.model.dropout_prob > 0)
    layers, micro_batches = rank.shapes.layers, rank.gradient_accumulation
    out = {}
    for half, kinds in HOST_HALVES.items():
        seconds = 0.0
        for kind in kinds:
            row = spec.host_row(*way, kind)
            if row is None:
                continue
            per_phase, per_unit = row[4], row[5]
            count = layers if kind in (schedule.LAYER_FORWARD, schedule.LAYER_BACKWARD) else 1
            seconds += count * (plan.passes * per_phase + micro_batches * per_unit) * 1e-6
        out[half] = seconds
    return out


def _pass_gather_seconds(run: RunShape, rank: RankShape, spec) -> float:
    """Seconds of one pass's RTS all-gathers: each layer twice, the embedding three times,
    the head once, in the compute dtype, over the data-parallel group's links."""
    loads = {LAYERS: 2, EMBEDDING: 3, HEAD: 1}
    sent = 0.0
    for part, specs in rank.specs.items():
        rows = rank.rows(part)
        for spec_ in specs.values():
            share = (spec_.rts_size - 1) / spec_.rts_size
            sent += loads[part] * rows * spec_.padded * rank.dtype.itemsize * share
    # The data-parallel group of rank 0 in the layout without its pipeline and context axes.
    mesh = dataclasses.replace(run.mesh, cp=1, pp=1)
    nodes = {member // spec.devices_per_node for member in mesh.members("dp", 0)}
    rate = spec.intra_node_gb_per_s if len(nodes) == 1 else spec.inter_node_gb_per_s
    return sent / (rate * 1e9)

"""What every step estimate must satisfy, checked where it is made.

A figure that breaks one of these is a bug in the time model, never a result to print (a dry
run once printed MFU 441.6% and "memory-bound -635 s": compiling was priced as saving more
than the eager ops it replaces ever cost):

- every time component is >= 0 (:func:`non_negative_phases`, :func:`check_step`);
- the step is at least its compute time (:func:`check_step`);
- MFU is at most the device's calibrated efficiency on the model's FLOPs (:func:`mfu_ceiling`);
- the host link carries at least the bytes the placement must move
  (:func:`placement_link_floor`).

A check that fails raises :class:`EstimateError`, naming the component.
"""

from __future__ import annotations

from execution.engine.plan import MemoryPlan
from execution.engine.storage.buffers import DTYPES
from execution.planning.device_specs import DeviceSpec
from execution.planning.run_shape import RunShape
from utils.metrics import attention_flops_per_token

# Sums and a linear combination of measured steps (the dry run's probes) leave a figure that
# is 0 by construction a few ulps either side of it: below this share of the largest figure of
# its kind, a negative value is rounding, and is set to 0.
ROUNDING = 1e-9
# Phase costs counted in FLOPs; the others are seconds.
FLOP_COSTS = ("flops", "attention_flops")


class EstimateError(AssertionError):
    """A step estimate broke one of its invariants (see the module docstring): a bug in the
    time model, not the user's input, so no entry point turns it into a one-line refusal."""


def non_negative_phases(phases: dict[str, tuple], names: tuple[str, ...]) -> dict[str, tuple]:
    """``phases`` (per kind of phase, the costs ``names``) with rounding's negatives set to 0.

    Raises:
        EstimateError: a cost is negative beyond rounding, naming the kind and the cost.
    """
    scale = dict.fromkeys(("flops", "seconds"), 0.0)
    for values in phases.values():
        for name, value in zip(names, values, strict=True):
            unit = "flops" if name in FLOP_COSTS else "seconds"
            scale[unit] = max(scale[unit], abs(value))
    cleaned = {}
    for kind, values in phases.items():
        row = []
        for name, value in zip(names, values, strict=True):
            floor = -ROUNDING * scale["flops" if name in FLOP_COSTS else "seconds"]
            if value < floor:
                raise EstimateError(f"phase {kind!r}: {name} is {value:.6g}, below 0")
            row.append(max(value, 0.0))
        cleaned[kind] = tuple(row)
    return cleaned


def check_step(estimate: dict) -> dict:
    """``estimate`` (:func:`~execution.planning.time_model.estimate_step`'s) with rounding's
    negatives set to 0, once its seconds are all >= 0 and its step covers its compute.

    Raises:
        EstimateError: naming the figure that broke its invariant.
    """
    seconds = {k: v for k, v in estimate.items() if k.endswith("_s")}
    by_kind = estimate["by_kind"]
    floor = -ROUNDING * max(map(abs, [*seconds.values(), *by_kind.values(), 0.0]))
    for name, value in [*seconds.items(), *((f"by_kind[{k!r}]", v) for k, v in by_kind.items())]:
        if value < floor:
            raise EstimateError(f"the step's {name} is {value:.6g} s, below 0")
    step, compute = estimate["step_time_s"], estimate["compute_s"]
    if step < compute * (1 - ROUNDING):
        raise EstimateError(
            f"the step ({step:.6g} s) is shorter than its compute ({compute:.6g} s)"
        )
    return {
        **{k: max(v, 0.0) if k in seconds else v for k, v in estimate.items()},
        "by_kind": {k: max(v, 0.0) for k, v in by_kind.items()},
    }


def mfu_ceiling(
    spec: DeviceSpec, model_attention_flops: float, run_attention_flops: float
) -> float:
    """The highest MFU a rank can reach on ``spec``: the faster of its best matmul rate (the
    fastest shape measured, or the data sheet's ``compute_efficiency``) and its attention
    kernel's rate on the model's count of attention FLOPs.

    MFU counts attention as the whole ``[S, S]`` square (``12 L h S`` per token), while a
    causal kernel executes half of it (and a recompute it again): the rank's
    ``model_attention_flops`` over the ``run_attention_flops`` its fused kernels ran scales the
    kernel's efficiency to the model's count. Every other model FLOP is a matmul's, at no more
    than the best matmul rate; so MFU, a weighted harmonic mean of the two rates over peak,
    cannot exceed the faster one.
    """
    rates = [rate for *_, rate in spec.matmul_tflops]
    matmul = max(rates) / spec.peak_tflops if rates else spec.compute_efficiency
    attention = 0.0
    if run_attention_flops > 0:
        efficiency = spec.attention_efficiency or spec.compute_efficiency
        attention = efficiency * model_attention_flops / run_attention_flops
    return max(matmul, attention)


def check_mfu(mfu: float, ceiling: float) -> None:
    """Raises :class:`EstimateError` where ``mfu`` exceeds ``ceiling`` (:func:`mfu_ceiling`)."""
    if mfu > ceiling * (1 + ROUNDING):
        raise EstimateError(f"MFU {mfu:.1%} exceeds the device's calibrated {ceiling:.1%}")


def placement_link_floor(
    plan: MemoryPlan, itemsize: int, micro_batches: int, boundaries: int, x_bytes: int
) -> int:
    """The fewest bytes a step under ``plan`` moves between host and device, whatever the
    engine's schedule: weights on the host are loaded at least once a pass in the compute
    dtype (``itemsize`` bytes an element), gradients on the host are stored at least once,
    gradients reach an update on the other side of the link at least once, and activations on
    the host take each micro-batch's x at each of its ``boundaries`` (a stage's layers + 1),
    ``x_bytes`` each (a rank's slice), at least once.
    """
    states, placement = plan.state_bytes, plan.placement
    floor = 0
    if placement.weights == "host":  # float32 master weights' bytes, loaded as copies
        floor += plan.passes * states["weights"] * itemsize // 4
    if placement.grads == "host":
        floor += states["grads"]
    if placement.weights != placement.grads:
        floor += states["weights"]
    if placement.activations == "host":
        floor += micro_batches * boundaries * x_bytes
    return floor


def check_link(sent: int, link_s: float, floor: int, spec: DeviceSpec) -> None:
    """Raises :class:`EstimateError` where the host link carries less than ``floor``
    (:func:`placement_link_floor`): ``sent`` bytes measured, or, where the link runs beside
    the kernels (a GPU), ``link_s`` seconds priced at its rate."""
    if sent < floor:
        raise EstimateError(
            f"the host link carries {sent:,} bytes, below the placement's {floor:,}"
        )
    rate = spec.host_link_gb_per_s * 1e9
    if spec.copies_overlap and link_s * rate < floor * (1 - ROUNDING):
        raise EstimateError(
            f"the host link's {link_s:.6g} s carry less than the placement's {floor:,} bytes "
            f"at {spec.host_link_gb_per_s} GB/s"
        )


def check_rank(
    run: RunShape, measured, ran_attention: float, spec: DeviceSpec, estimate: dict, final: bool
) -> float:
    """Checks one rank's ``estimate`` of ``run`` on ``spec`` (its MFU where ``final``: a
    pipeline stage's is settled by the whole pipeline) against the rank's ``measured`` step
    (a :class:`~execution.planning.dry_run.RankMeasurement`, whose fused attention kernels
    ran ``ran_attention`` FLOPs); returns its MFU ceiling (:func:`mfu_ceiling`).

    Raises:
        EstimateError: MFU above the ceiling, or the host link short of the placement's bytes.
    """
    attention = attention_flops_per_token(run.model, run.sequence_length)
    model_attention = attention * run.tokens_per_step / run.world_size
    ceiling = mfu_ceiling(spec, model_attention, ran_attention)
    if final:
        check_mfu(estimate["mfu"], ceiling)
    shards, itemsize = run.shards(), DTYPES[run.precision].itemsize
    tokens = run.micro_batch_size * run.sequence_length // run.mesh.cp
    x_bytes = tokens * shards.hidden // shards.tp2 // shards.tp1 * itemsize
    boundaries = min(run.stage_layers) + 1
    floor = placement_link_floor(
        measured.plan, itemsize, run.gradient_accumulation, boundaries, x_bytes
    )
    # The update behind the next step carries its gradients' copies, beside it on a GPU.
    behind = estimate["host_optimizer_s"] + estimate["hidden_update_s"]
    check_link(measured.comm_bytes["host_link"], estimate["copies_s"] + behind, floor, spec)
    return ceiling

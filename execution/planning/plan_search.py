"""``--plan_for N``: the layouts of N devices that fit a preset, fastest first.

Each candidate layout (data_parallel x context_parallel x tensor_parallel_1 x tensor_parallel_2
= N, a micro-batch size) gets the planner's passes and placements for ``--device_spec``. Its step is then measured
with the dry run's instruments, on meta tensors, but on a shrunk copy of the step: every count
the estimate needs (FLOPs, bytes of each collective and of the host link) is exactly
``c0 + c1 L + c2 P + c3 P L + c4 M + c5 M L`` in the layers L, passes P and micro-batches M of
the step, so six steps of 1-2 layers and 1-2 micro-batches determine it for the full preset.
A test checks the extrapolation against a full dry-run step.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np

from config.loading import validate
from config.schema import PretrainingConfig
from execution.engine.plan import GiB, MemoryPlan
from execution.planning.device_specs import DeviceSpec, resolve_spec
from execution.planning.dry_run import (
    RankMeasurement,
    checkpoint_figures,
    estimate,
    fake_job,
    measure_planned_step,
    spec_budget,
)
from execution.planning.measure import shrunk_config
from execution.planning.planner import candidate_plans, fastest_fitting

# (layers, micro-batches, passes) of the shrunk steps; the rows [1, L, P, PL, M, ML] are
# linearly independent.
PROBES = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2))


def _basis(layers: int, micro_batches: int, passes: int) -> list[int]:
    return [1, layers, passes, passes * layers, micro_batches, micro_batches * layers]


def extrapolated_step(config: PretrainingConfig, plan: MemoryPlan, spec: DeviceSpec):
    """Rank 0's FLOPs, bytes per group and working set for the full step, from six small ones.

    Returns:
        (flops, comm bytes by group incl. ``host_link``, comm seconds by group, working set,
        per kind of phase its summed FLOPs, overlappable and critical seconds). The phase sums
        are linear in the same terms: a kind's phases repeat per layer and pass, and their
        work per micro-batch.
    """
    placement = vars(plan.placement)
    samples, working_set = [], 0
    with fake_job(0, config.world_size):
        for layers, micro, passes in PROBES:
            small = shrunk_config(config, layers, micro, passes)
            for state, where in placement.items():
                setattr(small.execution, f"{state}_placement", where)
            small.execution.recompute = plan.recompute  # the plan's, not the probe's own pick
            small_plan = next(iter(candidate_plans(small, "cuda")))
            step = measure_planned_step(small, small_plan, spec)
            samples.append(step)
            working_set = max(working_set, step.working_set)
    keys = ["flops", *samples[0].comm_bytes]
    matrix = np.array([_basis(*probe) for probe in PROBES], dtype=np.float64)
    values = np.array([[s.flops, *s.comm_bytes.values()] for s in samples], dtype=np.float64)
    coefficients = np.linalg.solve(matrix, values)
    full = np.array(_basis(config.model.layers, config.gradient_accumulation, plan.passes))
    totals = dict(zip(keys, (full @ coefficients).round().astype(np.int64).tolist(), strict=True))
    seconds = {}
    for group, nbytes in totals.items():
        if group == "flops":
            continue
        rate = samples[-1].comm_seconds[group] / max(samples[-1].comm_bytes[group], 1)
        seconds[group] = nbytes * rate
    flops = totals.pop("flops")
    kinds = sorted({kind for sample in samples for kind in sample.phases})
    per_sample = [
        [v for kind in kinds for v in sample.phases.get(kind, (0.0, 0.0, 0.0))]
        for sample in samples
    ]
    sums = full @ np.linalg.solve(matrix, np.array(per_sample, dtype=np.float64))
    phases = {
        kind: tuple(float(v) for v in sums[3 * i : 3 * i + 3]) for i, kind in enumerate(kinds)
    }
    return flops, totals, seconds, working_set, phases


def layouts(config: PretrainingConfig, devices: int) -> list[PretrainingConfig]:
    """Every (dp, cp, tp1, tp2, micro-batch) of ``devices`` that the model and batch allow."""
    m, t = config.model, config.training
    out = []
    for tp1, tp2, cp in itertools.product(range(1, devices + 1), repeat=3):
        if devices % (tp1 * tp2 * cp) or m.heads % tp1 or m.hidden_size % tp2:
            continue
        if m.sequence_length % cp or (m.heads // tp1) % cp:
            continue
        dp = devices // (tp1 * tp2 * cp)
        for micro in (1, 2, 4, 8, 16):
            if t.global_batch_size % (micro * dp):
                continue
            candidate = copy.deepcopy(config)
            ex = candidate.execution
            ex.data_parallel, ex.tensor_parallel_1, ex.tensor_parallel_2 = dp, tp1, tp2
            ex.context_parallel, ex.micro_batch_size, ex.passes = cp, micro, 0
            validate(candidate)
            out.append(candidate)
    return out


def search(config: PretrainingConfig, devices: int) -> tuple[list[dict], int]:
    """Layouts that fit, each with its plan and estimate, fastest first; and how many did not."""
    spec = resolve_spec(config)
    budget = spec_budget(spec)
    rows, misfits = [], 0
    for candidate in layouts(config, devices):
        plan = fastest_fitting(candidate_plans(candidate, "cuda"), budget)
        if plan is None:
            misfits += 1
            continue
        flops, comm, seconds, working_set, phases = extrapolated_step(candidate, plan, spec)
        plan = dataclasses.replace(plan, working_set=working_set)  # the full step's, measured
        if not budget.fits(plan):
            misfits += 1
            continue
        measured = RankMeasurement(plan, True, "", {}, working_set, comm, seconds, flops, phases)
        rows.append(
            {
                "config": candidate,
                "plan": plan,
                "device_bytes": plan.bytes_on("device")["total"],
                "host_bytes": plan.bytes_on("host")["total"],
                "checkpoint": checkpoint_figures(candidate, plan, spec),
                **estimate(candidate, measured, spec),
            }
        )
    rows.sort(key=lambda r: (r["step_time_s"], r["device_bytes"]))
    return rows, misfits


def print_layouts(config: PretrainingConfig, preset: str) -> None:
    devices = config.planning.plan_for
    spec = resolve_spec(config)
    rows, misfits = search(config, devices)
    tokens = config.tokens_per_step
    print(
        f"{preset} on {devices} x {spec.name} ({spec.memory_gb:g} GiB, host "
        f"{spec.host_memory_gb:g} GiB each): global batch {config.training.global_batch_size} "
        f"x {config.model.sequence_length}; {len(rows)} layouts fit, {misfits} do not; "
        f"ckpt GB: checkpoint bytes rank 0 writes, save s: at {spec.storage_gb_per_s:g} GB/s"
    )
    header = (
        f"{'dp':>3} {'cp':>3} {'tp1':>4} {'tp2':>4} {'mbs':>4} {'passes':>6}  "
        f"{'placement (w/g/a)':<21}{'recompute':<10}"
        f"{'device GiB':>11} {'host GiB':>9} {'step s':>9} {'tokens/s':>10} {'MFU':>6}"
        f"{'ckpt GB':>9} {'save s':>7}"
    )
    print(header)
    for row in rows:
        ex, plan = row["config"].execution, row["plan"]
        where = "/".join(vars(plan.placement).values())
        print(
            f"{ex.data_parallel:>3} {ex.context_parallel:>3} {ex.tensor_parallel_1:>4} "
            f"{ex.tensor_parallel_2:>4} "
            f"{ex.micro_batch_size:>4} {plan.passes:>6}  {where:<21}{plan.recompute:<10}"
            f"{row['device_bytes'] / GiB:>11.1f} {row['host_bytes'] / GiB:>9.1f} "
            f"{row['step_time_s']:>9.2f} {tokens / row['step_time_s']:>10,.0f} "
            f"{row['mfu']:>6.1%}{row['checkpoint']['bytes_written'] / 1e9:>9.2f}"
            f"{row['checkpoint']['save_s']:>7.1f}"
        )
    if not rows and not misfits:
        m = config.model
        print(
            f"no layout of {devices} devices suits this model: tensor_parallel_1 must divide "
            f"--heads {m.heads}, tensor_parallel_2 --hidden_size {m.hidden_size}, "
            f"context_parallel --sequence_length {m.sequence_length} and the heads per "
            "tensor_parallel_1 rank, and "
            f"micro-batch x data_parallel --global_batch_size "
            f"{config.training.global_batch_size}"
        )
    if rows:
        ex = rows[0]["config"].execution
        print(
            f"fastest: --data_parallel {ex.data_parallel} --context_parallel "
            f"{ex.context_parallel} --tensor_parallel_1 {ex.tensor_parallel_1} "
            f"--tensor_parallel_2 {ex.tensor_parallel_2} --micro_batch_size {ex.micro_batch_size}"
        )

"""The dry run's report as printed: per kind of rank, its plan, memory, time and checkpoint
figures (:func:`execution.planning.dry_run.dry_run` measures them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from execution.engine.plan import GiB, MemoryPlan
from execution.planning.memory import MemoryBudget

if TYPE_CHECKING:
    from execution.planning.run_shape import RunShape

# The states a report shows per kind of rank, in order.
STATE_KEYS = (
    "weights",
    "grads",
    "optimizer",
    "weight_copies",
    "masks",  # a sparse run's only (RigL), so the report keeps those present
    "activations",
    "working_set",
    "total",
)


def format_report(run: RunShape, report: dict) -> str:
    """The console table: one block per kind of rank, then the verdict."""
    spec = report["device_spec"]
    lines = [
        f"dry run: {run.model.layers} layers x {run.model.hidden}, "
        f"{run.mesh.describe()} = {report['world_size']} ranks of {spec['name']} "
        f"({spec['peak_tflops']:g} TFLOPS, "
        f"{spec['memory_gb']:g} GiB, host {spec['host_memory_gb']:g} GiB), "
        f"global batch {run.global_batch_size} x {run.sequence_length}"
    ]
    for entry in report["ranks"]:
        plan = entry["plan"]
        ranks = entry["ranks"]
        shown = ", ".join(map(str, ranks[:6])) + (", ..." if len(ranks) > 6 else "")
        lines.append(
            f"\nranks {shown} ({len(ranks)} ranks): {plan['passes']} pass(es) of "
            f"{plan['micro_batches_per_pass']} micro-batch(es), "
            + ", ".join(f"{k} on {v}" for k, v in plan["placement"].items())
            + f", recompute {plan['recompute']}"
        )
        lines.append(f"  {'GiB':<12}" + "".join(f"{k:>14}" for k in entry["host_bytes"]))
        for where in ("device", "host"):
            values = entry[f"{where}_bytes"]
            lines.append(f"  {where:<12}" + "".join(f"{v / GiB:14.2f}" for v in values.values()))
        comm = entry["comm_bytes"]
        lines.append(
            "  sent per step GB: " + ", ".join(f"{k} {v / 1e9:,.2f}" for k, v in comm.items() if v)
        )
        lines.append(
            f"  {entry['flops_per_step'] / 1e15:,.1f} PFLOP per step (recompute included); "
            f"estimated step {entry['step_time_s']:,.2f} s, MFU {entry['mfu']:.1%}"
            + (f", pipeline bubble {entry['bubble']:.1%}" if entry["bubble"] else "")
        )
        lines.append("  " + time_breakdown(entry))
        lines.append("  " + host_line(entry, bool(spec["host_phase_us"])))
        ckpt = entry["checkpoint"]
        lines.append(
            f"  checkpoint: {ckpt['bytes_written'] / 1e9:,.2f} GB written by this rank, "
            f"{ckpt['tensor_bytes_sent']} B of tensor data sent to other ranks, "
            f"{ckpt['staging_bytes'] / GiB:,.2f} GiB host staging; est. save "
            f"{ckpt['save_s']:,.1f} s at {ckpt['storage_gb_per_s']:g} GB/s "
            f"(training held {ckpt['held_s']:,.2f} s)"
        )
        lines.append(f"  {entry['why']}")
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    lines.append(f"\nverdict: {verdict} on {report['world_size']} x {spec['name']}")
    return "\n".join(lines)


def fit_line(plan: MemoryPlan, budget: MemoryBudget, planned_fit: bool) -> str:
    """The report's last line of a kind of rank: whether its plan fits ``budget`` and, if not,
    what to try (``planned_fit``: whether the planner found a plan that fits)."""
    device_total, host = plan.bytes_on("device")["total"], plan.bytes_on("host")["total"]
    if planned_fit and budget.fits(plan):
        return (
            f"fits: {device_total / GiB:,.1f} of {budget.device / GiB:,.1f} GiB device, "
            f"{host / GiB:,.1f} of {budget.host / GiB:,.1f} GiB host"
        )
    needs = (
        f"does not fit: needs {device_total / GiB:,.2f} GiB device (of "
        f"{budget.device / GiB:,.2f}) and {host / GiB:,.2f} GiB host (of "
        f"{budget.host / GiB:,.2f})"
    )
    if planned_fit:  # the full step allocated more than the planner's one-layer measurement
        return (
            f"{needs}: the full step's working set exceeds the plan's; try --passes or more memory"
        )
    return (
        f"{needs} even with its least-memory plan; add data or tensor parallelism (see "
        "--plan_for) or use a larger device"
    )


def time_breakdown(entry: dict) -> str:
    """Where an estimated step's seconds go (:func:`~execution.planning.time_model.estimate_step`)."""
    hidden = entry["hidden_update_s"]
    behind = f" waited for ({hidden:,.3f} s behind the next step)" if hidden else ""
    queued = entry["hidden_overhead_s"]
    queued = f" ({queued:,.3f} s behind the kernels)" if queued else ""
    return (
        f"time: compute {entry['compute_s']:,.3f} s, memory-bound {entry['memory_bound_s']:,.3f} s, "
        f"launch and host overhead {entry['overhead_s']:,.3f} s{queued}, host AdamW "
        f"{entry['host_optimizer_s']:,.3f} s{behind}, copies {entry['copies_s']:,.3f} s and collectives "
        f"{entry['collectives_s']:,.3f} s ({entry['hidden_comm_s']:,.3f} s hidden, "
        f"{entry['exposed_comm_s']:,.3f} s exposed), bubble {entry['bubble_s']:,.3f} s"
    )


def host_line(entry: dict, measured: bool) -> str:
    """Each kind of phase's device time over its host's, and the share of its time the host
    sets (on a GPU, the device waits for it; on a CPU, whose cores do both, the host's own
    share); ``measured``: the spec holds the host's time per phase (``host_phase_us``)."""
    parts = []
    for kind, figures in entry["host_by_kind"].items():
        host, device = figures["host_s"], figures["device_s"]
        ratio = f"{device / host:,.1f}x" if host else "-"
        parts.append(f"{kind} {ratio} {figures['host_bound']:.0%}")
    line = "host (device / host time, host-bound share): " + ", ".join(parts)
    if not measured:
        line += (
            "; this spec holds no measured host time per phase (host_phase_us): priced as its "
            "kernels x launch_overhead_us + phase_overhead_us (calibrate.py measures it)"
        )
    return line

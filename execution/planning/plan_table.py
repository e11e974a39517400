"""``--plan_for``'s table as printed: the layouts that fit, fastest first, or what the nearest
misfit needs (:func:`execution.planning.plan_search.search` measures them)."""

from __future__ import annotations

import itertools

from execution.engine.plan import GiB
from execution.planning.memory import spec_budget
from execution.planning.plan_search import layouts, search, weighed_run
from execution.planning.run_shape import RunShape

# Micro-batch sizes of one layout whose step times are within this fraction of its fastest
# are shown as one row.
TIE = 0.005


def layout_rows(rows: list[dict]) -> list[dict]:
    """One row per layout (dp, pp, cp, tp1, tp2): its fastest micro-batch size, with
    ``micro_batches`` naming every size that ties with it (e.g. ``1-4``)."""
    best: dict[tuple, dict] = {}
    ties: dict[tuple, list[int]] = {}
    for row in rows:  # fastest first
        key = row["run"].mesh
        if key not in best:
            best[key], ties[key] = row, []
        if row["step_time_s"] <= best[key]["step_time_s"] * (1 + TIE):
            ties[key].append(row["run"].micro_batch_size)
    out = []
    for key, row in best.items():
        sizes = sorted(ties[key])
        contiguous = all(b == 2 * a for a, b in itertools.pairwise(sizes))
        text = (
            f"{sizes[0]}-{sizes[-1]}"
            if contiguous and len(sizes) > 1
            else ",".join(map(str, sizes))
        )
        out.append({**row, "micro_batches": text})
    return out


def print_layouts(
    run: RunShape, preset: str, devices: int, across_nodes: bool = False, workers: int = 0
) -> None:
    """``--plan_for devices``: the table of the layouts of ``run``'s model and batch
    (``across_nodes``: ``--plan_across_nodes``; ``workers``: ``--plan_workers``)."""
    spec = run.spec
    rows, misfits, pruned = search(run, devices, across_nodes=across_nodes, workers=workers)
    shown = layout_rows(rows)
    tokens = run.tokens_per_step
    print(
        f"{preset} on {devices} x {spec.name} ({spec.memory_gb:g} GiB, host "
        f"{spec.host_memory_gb:g} GiB each): global batch {run.global_batch_size} "
        f"x {run.sequence_length}; {len(shown)} layouts fit ({len(rows)} with their "
        f"micro-batch sizes), {len(misfits)} do not; mbs: micro-batch sizes within "
        f"{TIE:.1%} of the layout's fastest; bubble: (S - 1) / (P + S - 1); "
        f"ckpt GB: checkpoint bytes rank 0 writes, save s: at {spec.storage_gb_per_s:g} GB/s; "
        "host: the share of the step the device waits for its host (a host-bound row: more "
        "than 0; a CPU's host is its device, so all of its host time)"
    )
    if weighed_run(run).compile != run.compile:
        print(
            "weighed with the parts eager (--compile auto: a search prices no compiled graph; "
            "--compile true prices each layout's, --dry_run of a row prices that one's)"
        )
    header = (
        f"{'dp':>3} {'pp':>3} {'cp':>3} {'tp1':>4} {'tp2':>4} {'mbs':>6} {'passes':>6} "
        f"{'bubble':>6}  {'placement (w/g/a)':<21}{'recompute':<10}"
        f"{'device GiB':>11} {'host GiB':>9} {'step s':>9} {'tokens/s':>10} {'MFU':>6}"
        f"{'ckpt GB':>9} {'save s':>7} {'host':>5}"
    )
    if shown:
        print(header)
    for row in shown:
        mesh, plan = row["run"].mesh, row["plan"]
        where = "/".join(vars(plan.placement).values())
        print(
            f"{mesh.dp:>3} {mesh.pp:>3} {mesh.cp:>3} {mesh.tp1:>4} {mesh.tp2:>4} "
            f"{row['micro_batches']:>6} {plan.passes:>6} {row['bubble']:>6.1%}  "
            f"{where:<21}{plan.recompute:<10}"
            f"{row['device_bytes'] / GiB:>11.1f} {row['host_bytes'] / GiB:>9.1f} "
            f"{row['step_time_s']:>9.2f} {tokens / row['step_time_s']:>10,.0f} "
            f"{row['mfu']:>6.1%}{row['checkpoint']['bytes_written'] / 1e9:>9.2f}"
            f"{row['checkpoint']['save_s']:>7.1f} {row['host_wait_s'] / row['step_time_s']:>5.0%}"
        )
    if not across_nodes:
        spanning = len(layouts(run, devices, across_nodes=True)) - len(layouts(run, devices))
        if spanning:
            print(
                f"not weighed: {spanning} layouts (with their micro-batch sizes) whose tensor "
                "or context groups would span nodes; --plan_across_nodes weighs them too"
            )
    if pruned:
        print(
            f"not measured: {pruned} layouts (with their micro-batch sizes) whose groups span "
            "nodes and whose tensor-parallel all-reduces alone take longer than the fastest step"
        )
    if not rows and not misfits:
        m = run.model
        print(
            f"no layout of {devices} devices suits this model: tensor_parallel_1 must divide "
            f"--heads {m.heads}, tensor_parallel_2 --hidden_size {m.hidden}, "
            f"context_parallel --sequence_length {run.sequence_length} and the heads per "
            "tensor_parallel_1 rank, and "
            f"micro-batch x data_parallel --global_batch_size "
            f"{run.global_batch_size}"
        )
    if not rows and misfits and misfits[0]["plan"] is not None:
        print(_nearest_misfit_line(misfits[0], spec_budget(run, spec), devices))
    if rows:
        fastest = rows[0]["run"]
        mesh = fastest.mesh
        print(
            f"fastest: --data_parallel {mesh.dp} --pipeline_parallel {mesh.pp} "
            f"--context_parallel {mesh.cp} --tensor_parallel_1 {mesh.tp1} "
            f"--tensor_parallel_2 {mesh.tp2} --micro_batch_size {fastest.micro_batch_size}"
        )


def _nearest_misfit_line(misfit: dict, budget, devices: int) -> str:
    """What the layout nearest to fitting needs, as ``--dry_run`` says it for one layout."""
    plan = misfit["plan"]
    layout = misfit["run"].describe()
    device, host = (plan.bytes_on(where)["total"] / GiB for where in ("device", "host"))
    return (
        f"nothing fits on {devices} devices: the nearest layout ({layout}; {plan.passes} "
        f"pass(es), {plan.placement.describe()}, recompute {plan.recompute}) needs "
        f"{device:,.1f} GiB of device and {host:,.1f} GiB of host memory per process, which may "
        f"use {budget.describe()}; plan for more devices, or check --device_memory_gb and "
        "--host_memory_gb"
    )

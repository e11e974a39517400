"""The step-time model: a measured step's ops, copies and collectives, priced on a device spec.

Per phase, the device runs the phase's ops, each at the larger of its FLOPs over the matmul
rate of its shape and its bytes over memory bandwidth (:mod:`execution.planning.op_costs`),
and the host launches them and adds the engine's own time: per phase and per micro-batch as
the calibration measured it on its host (:func:`host_seconds`). On a CPU the same cores do
both, one after the other; a GPU's host queues kernels ahead on its stream, so the device
waits for it only where it falls behind: the phases run in a queue from the step's start to
its first synchronisation (the norm's read), the host running ahead by as much as the
launch queue holds (:func:`queued_phases`). Host
copies and asynchronous collectives (the next phase's all-gathers, the previous phase's
reductions) run behind that where the device has engines of its own for them
(``DeviceSpec.copies_overlap``: a GPU) and add to it where the same cores do both (a CPU),
each at the pair's own time for it (a pipeline's sends and receives as waited-for calls).
Collectives waited for where they are issued (tensor-parallel ones, and every one without
``--overlap_communication``) are on the critical path, call by call
(:func:`waited_call_seconds`). A pipeline stage's phases take
``(P + S - 1) / P`` of their time (the bubble) where every stage is alike; a dry run of a
pipeline, which measures each stage, combines them (:func:`pipeline_step`). The optimizer's
window is outside it, and the host AdamW runs there (:func:`host_update_seconds`), or, with
``--overlap_update``, behind the next step, which waits only where it needs a row before the
update has written it (:func:`update_wait_seconds`).
"""

from __future__ import annotations

from collections import Counter

from execution.engine.phases.schedule import EMBEDDING_FORWARD, LAYER_FORWARD
from execution.parallel.mesh import GroupAxis, ParallelLayout
from execution.planning.device_specs import DeviceSpec
from execution.planning.estimate_checks import check_step, non_negative_phases
from execution.planning.op_costs import device_seconds
from execution.planning.pipeline_figures import step_stretch

# Bytes each rank sends per byte of payload, for ring algorithms over n ranks.
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # every chunk but its own leaves the rank
    # A pipeline stage's point-to-point moves: what it sends leaves it, what it receives not.
    "send": lambda n: 1.0,
    "receive": lambda n: 0.0,
}

# A pipeline's point-to-point ops (mesh.py counts them asynchronous).
POINT_TO_POINT = frozenset({"send", "receive"})

# What phase_costs gives per kind of phase, in order: FLOPs, then seconds by what spends them.
PHASE_COSTS = (
    "flops",
    "attention_flops",
    "matmul_s",
    "attention_s",
    "memory_bound_s",
    "launch_s",
    "engine_s",
    "fresh_memory_s",
    "host_optimizer_s",
    "update_behind_s",
    "update_lead_s",
    "copies_s",
    "overlappable_comm_s",
    "critical_comm_s",
)
COST_INDEX = {name: index for index, name in enumerate(PHASE_COSTS)}
# What a phase's kernels spend on the device, and what its host spends issuing them: the
# device waits for the host where the host falls behind (a GPU, which queues kernels ahead:
# queued_phases), their sum where the same cores do both (a CPU). engine_s: the host's time
# beyond its launches, measured per phase and micro-batch where the calibration measured it.
KERNEL_WORK = ("matmul_s", "attention_s", "memory_bound_s", "fresh_memory_s")
HOST_WORK = ("launch_s", "engine_s")
# Kernels a CUDA stream's launch queue holds before a launch blocks the host (the driver's
# pending-launch limit, about a thousand): how far ahead of the device the host can run.
LAUNCH_QUEUE = 1024
# Of a step of more passes, the passes queued_phases runs one by one before it extends the
# last one's times to the rest (a pass's queue settles in one or two).
QUEUED_PASSES = 8


def phase_costs(windows, layout: ParallelLayout, spec: DeviceSpec) -> dict[str, tuple]:
    """Per kind of phase, summed over its phases (:class:`~execution.planning.measure.Window`):
    the :data:`PHASE_COSTS`. A window's asynchronous all-gathers run behind it, its
    asynchronous reductions behind the next window (they are waited for a phase later)."""
    axes = {axis.name: axis for axis in layout.axes()}
    out: dict[str, list[float]] = {}
    carried = 0.0  # async reductions of the previous window
    loading = [window.loads for window in windows if window.loads]
    for window in windows:
        gathers = reductions = critical = 0.0
        for name, axis in axes.items():
            # Waited for: each call's own time, latency and all, is on the critical path. In
            # the background: a call's latency is waiting, hidden; what its bytes take is
            # priced at the rate of the window's total of that op. Where the cores that would
            # carry it compute (a CPU, gloo's thread), a call started in the background takes
            # the pair's own time for it, waited for a phase later, call by call: both ranks
            # issue it at the same point of the same phases, so the peer's lateness at a call
            # waited for where it is issued (waited_collective_us, fitted on tensor-parallel
            # steps) is not paid at each. A pipeline's receive waits for the other stage to
            # reach its send: it is priced as a waited call.
            in_background = Counter()
            for (op, nbytes, asynchronous), count in window.calls[name].items():
                if not asynchronous:
                    critical += count * waited_call_seconds(axis, op, nbytes, spec)
                elif spec.copies_overlap:
                    in_background[op] += nbytes * count
                elif op in POINT_TO_POINT:  # waits for the other stage to reach its send
                    reductions += count * waited_call_seconds(axis, op, nbytes, spec)
                elif op == "all_gather":
                    gathers += count * collective_seconds(axis, op, nbytes, spec)
                else:
                    reductions += count * collective_seconds(axis, op, nbytes, spec)
            for op, nbytes in in_background.items():
                if op == "all_gather":
                    gathers += collective_seconds(axis, op, nbytes, spec)
                else:
                    reductions += collective_seconds(axis, op, nbytes, spec)
        device = device_seconds(window.costs, window.attention_flops, spec)
        host_update = host_update_seconds(window, spec)
        copies = _copy_seconds(window.host_bytes, spec)
        behind = lead = 0.0
        if window.kind == "optimizer" and updates_behind(window, spec):
            # The update and its gradients' copies (the staging) run on its thread, behind
            # the next step; the copies beside the update where the device copies on its own.
            both = max if spec.copies_overlap else sum
            behind, host_update, copies = both((host_update, copies)), 0.0, 0.0
            lead = behind * update_lead_share(window.host_update_rows, loading[:1])
        costs = {
            "flops": window.flops,
            "attention_flops": window.attention_flops,
            "matmul_s": device["matmul"],
            "attention_s": device["attention"],
            "memory_bound_s": device["memory_bound"],
            "launch_s": device["launch"],
            "fresh_memory_s": device["fresh_memory"],
            "engine_s": host_seconds(window, spec),
            "host_optimizer_s": host_update,
            "update_behind_s": behind,
            "update_lead_s": lead,
            "copies_s": copies,
            "overlappable_comm_s": gathers + carried,
            "critical_comm_s": critical,
        }
        carried = reductions
        sums = out.setdefault(window.kind, [0.0] * len(PHASE_COSTS))
        for name, value in costs.items():
            sums[COST_INDEX[name]] += value
    if carried:  # reductions started in the last window: nothing is left to hide them
        out.setdefault("optimizer", [0.0] * len(PHASE_COSTS))[COST_INDEX["critical_comm_s"]] += (
            carried
        )
    return {kind: tuple(sums) for kind, sums in out.items()}


def host_seconds(window, spec: DeviceSpec) -> float:
    """The host's time in a window beyond its kernels' launches (``launch_overhead_us``
    each): as measured on the calibrated host for a phase of its kind run as it runs
    (``DeviceSpec.host_row``: per phase, and per micro-batch or, of the update, per row),
    less the launches of the kernels the measured phase ran, each part at least 0; where
    nothing was measured, ``phase_overhead_us`` a phase."""
    row = spec.host_row(*window.run_as, window.kind)
    if row is None:
        return spec.phase_overhead_us * 1e-6 if window.kind != "optimizer" else 0.0
    *_, per_phase, per_unit, kernels_per_phase, kernels_per_unit = row
    launch = spec.launch_overhead_us
    units = window.rows if window.kind == "optimizer" else window.micro_batches
    own = max(per_phase - kernels_per_phase * launch, 0.0)
    return (own + units * max(per_unit - kernels_per_unit * launch, 0.0)) * 1e-6


def updates_behind(window, spec: DeviceSpec) -> bool:
    """Whether the host update of the optimizer's ``window`` runs behind the next step on
    the device ``spec`` describes (``--overlap_update``; auto: on a GPU)."""
    choice = window.overlap_update
    return bool(window.host_update_rows) and (
        choice == "true" or (choice == "auto" and spec.device_type == "cuda")
    )


def update_lead_share(rows: tuple, first_loads: list[tuple]) -> float:
    """The share of a host update (``rows``: (part, row, elements), in its order) written
    before the rows the next step loads first are (``first_loads``: those of its first phase;
    a prefetch that would wait for the update is issued after the phase, not before). The
    next step starts that late at least."""
    total = sum(elements for *_, elements in rows)
    needed = {key for loads in first_loads for key in loads}
    if not total:
        return 0.0
    done = last = 0
    for part, row, elements in rows:
        done += elements
        if (part, row) in needed:
            last = done
    return last / total


def update_wait_seconds(behind: float, lead: float, first_pass_forward: float) -> float:
    """How long the next step waits for a host update of ``behind`` seconds that runs behind
    it, in the order the step first loads the rows: the rows of its first phase (``lead``
    seconds of the update) before it starts, the last rows by the end of its first pass's
    forward (``first_pass_forward``), the first load of the head. The update's rows are
    spread evenly over that forward as its loads are, so the larger of the two bounds the
    wait (to within a layer's forward: the last loads are issued a phase early)."""
    return min(behind, max(lead, behind - first_pass_forward, 0.0))


def host_update_seconds(window, spec: DeviceSpec) -> float:
    """The host AdamW of a window: its elements at the rate calibrate.py measured on the
    engine's own update (thread pool, chunks, the 16-bit copy), or, where nothing was
    measured (a data sheet), its bytes at host memory bandwidth. A bandwidth leaves out what
    the update spends besides streaming memory: Python per chunk, the pool's hand-offs, the
    cast of the weight copy."""
    if spec.host_adamw_elements_per_s:
        return window.host_update_elements / spec.host_adamw_elements_per_s
    if not window.host_update_bytes:
        return 0.0
    return window.host_update_bytes / (spec.memory_rate(spec.host_memory_gb_per_s) * 1e9)


def _copy_seconds(nbytes: int, spec: DeviceSpec) -> float:
    """Host-link seconds; none on a device without a link of its own (a CPU: its copies are
    memory-bound ops, priced among them)."""
    if not spec.copies_overlap:
        return 0.0
    return nbytes / (spec.host_link_gb_per_s * 1e9)


def estimate_step(phases: dict[str, tuple], pipeline_stages: int, passes: int, spec) -> dict:
    """Step time and its breakdown from :func:`phase_costs`' sums (see the module docstring).

    Returns seconds per step: ``step_time_s``; ``compute_s`` (matmuls and attention, at the
    rates of their shapes); ``memory_bound_s``; ``overhead_s`` (launches, the engine's host
    time and first touches of fresh memory) and ``hidden_overhead_s`` (the host's time run
    beside the kernels, where the device queues them); ``host_wait_s`` (the device's time
    waiting for its host: a GPU's host fell behind; on a CPU, whose cores do both, the
    host's whole time); ``host_optimizer_s`` (the host AdamW the step waits for) and
    ``hidden_update_s`` (the rest of it, behind the next step: ``--overlap_update``);
    ``copies_s`` and ``collectives_s`` (all of them, hidden or not); ``hidden_comm_s``
    (copies and collectives behind device work); ``exposed_comm_s`` (the rest); ``bubble_s``
    (the pipeline's idle share of the phases); ``by_kind`` (each kind of phase's seconds in
    the step); ``host_by_kind`` (each kind's ``device_s``, ``host_s`` and ``host_bound``, the
    share of its time the host set).

    Raises:
        EstimateError: a cost or figure is negative, or the step shorter than its compute
            (:mod:`~execution.planning.estimate_checks`): a bug, never a figure to print.
    """
    phases = non_negative_phases(phases, PHASE_COSTS)
    bubble = step_stretch(pipeline_stages, passes)
    totals = dict.fromkeys(PHASE_COSTS, 0.0)
    work = {}  # per kind: kernels, host, device beside the host (copies, collectives), behind
    for kind, values in phases.items():
        costs = dict(zip(PHASE_COSTS, values, strict=True))
        for name, value in costs.items():
            totals[name] += value
        kernels = sum(costs[name] for name in KERNEL_WORK)
        host = sum(costs[name] for name in HOST_WORK)
        behind = costs["copies_s"] + costs["overlappable_comm_s"]
        if spec.copies_overlap:  # copy engines and NCCL run beside the kernels
            device = max(kernels + costs["host_optimizer_s"], behind) + costs["critical_comm_s"]
        else:
            device = kernels + costs["host_optimizer_s"] + behind + costs["critical_comm_s"]
        kernel_count = costs["launch_s"] / (spec.launch_overhead_us * 1e-6 or 1.0)
        work[kind] = (kernels, host, device, behind, kernel_count)
    waits = _host_waits(work, passes, spec)
    step = bubble_s = hidden = 0.0
    forward = 0.0  # the forward phases' seconds, every pass
    by_kind, host_by_kind = {}, {}
    for kind, (kernels, host, device, behind, _) in work.items():
        seconds = device + waits[kind]
        hidden += min(kernels + waits[kind], behind) if spec.copies_overlap else 0.0
        if kind in (EMBEDDING_FORWARD, LAYER_FORWARD):
            forward += seconds
        host_by_kind[kind] = {
            "device_s": kernels,
            "host_s": host,
            "host_bound": waits[kind] / seconds if seconds else 0.0,
        }
        if kind != "optimizer":
            bubble_s += seconds * (bubble - 1.0)
            seconds *= bubble
        by_kind[kind] = seconds
        step += seconds
    behind_update = totals["update_behind_s"]
    wait = update_wait_seconds(behind_update, totals["update_lead_s"], forward / passes)
    if behind_update:
        by_kind["optimizer"] = by_kind.get("optimizer", 0.0) + wait
        step += wait
    compute = totals["matmul_s"] + totals["attention_s"]
    copies = totals["copies_s"]
    collectives = totals["overlappable_comm_s"] + totals["critical_comm_s"]
    host = sum(totals[name] for name in HOST_WORK)
    host_wait = sum(waits.values())
    return check_step(
        {
            "step_time_s": step,
            "compute_s": compute,
            "memory_bound_s": totals["memory_bound_s"],
            "overhead_s": host + totals["fresh_memory_s"],
            "hidden_overhead_s": max(host - host_wait, 0.0),
            "host_wait_s": host_wait,
            "host_optimizer_s": totals["host_optimizer_s"] + wait,
            "hidden_update_s": behind_update - wait,
            "copies_s": copies,
            "collectives_s": collectives,
            "hidden_comm_s": hidden,
            "exposed_comm_s": copies + collectives - hidden,
            "bubble_s": bubble_s,
            "by_kind": by_kind,
            "host_by_kind": host_by_kind,
        }
    )


def _host_waits(work: dict[str, tuple], passes: int, spec: DeviceSpec) -> dict[str, float]:
    """Per kind of phase, the seconds the device spends waiting for its host (``work``: each
    kind's kernels, host, device work, background and kernel count, summed over the step).
    On a CPU the same cores do both: the host's whole time. On a GPU, the phases' queue
    (:func:`queued_phases`); the optimizer's window follows the norm's read, which waits for
    every phase, so its host runs ahead of nothing: it waits for as long as its host takes
    beyond its kernels."""
    if not spec.queues_kernels:
        return {kind: host for kind, (_, host, *_) in work.items()}
    phases = {k: v for k, v in work.items() if k != "optimizer"}
    queue = [
        (kind, device, host, _lead_limit(kernels, count))
        for kind, (kernels, host, device, _, count) in phases.items()
    ]
    waits = queued_phases(queue, passes)
    if "optimizer" in work:
        kernels, host, *_ = work["optimizer"]
        waits["optimizer"] = max(host - kernels, 0.0)
    return waits


def _lead_limit(kernels: float, count: float) -> float:
    """How far the device may lag its host in a phase of ``kernels`` seconds of ``count``
    kernels: the device's time for a launch queue's worth of them (none counted: no bound)."""
    return LAUNCH_QUEUE * kernels / count if count >= 1 else float("inf")


def queued_phases(kinds: list[tuple[str, float, float, float]], passes: int) -> dict[str, float]:
    """Per kind, the seconds a GPU waits for its host over a step whose phases run in a queue:
    ``passes`` passes, each running every kind's share of the step (``kinds``: name, device
    seconds, host seconds, the most the device may lag the host, over the whole step) in
    their order, from the step's start, where both begin together (the last step ended in a
    read of its norm).

    The host issues each phase's kernels in its own time; the device runs them in its own,
    starting each once it has run the last and the host has issued it, and ending it no
    earlier than the host issued its last kernel: where the host falls behind, the device
    waits. Where the device falls behind, the host runs ahead, by no more than the launch
    queue holds (it then waits for a slot), and a later phase whose host is slow spends that
    lead before the device waits. Passes after :data:`QUEUED_PASSES` repeat the last one's
    waits."""
    waited = {kind: 0.0 for kind, *_ in kinds}
    device_end = host_end = 0.0
    run = min(passes, QUEUED_PASSES)
    for index in range(run):
        last = {}
        for kind, device, host, limit in kinds:
            share = device / passes
            host_end += host / passes
            started = device_end
            device_end = max(device_end + share, host_end)
            last[kind] = max(device_end - started - share, 0.0)
            waited[kind] += last[kind]
            host_end = max(host_end, device_end - limit)
        if index == run - 1:
            for kind in waited:
                waited[kind] += (passes - run) * last[kind]
    return waited


def pipeline_step(stages: dict[int, list[dict]], passes: int) -> float:
    """The step of a pipeline whose stages' estimates (:func:`estimate_step`, each stage's ranks
    alone, by stage) are ``stages``: every rank waits for it.

    A stage's own phases take ``W_s`` (its estimate less the bubble and the optimizer's window).
    In the steady state the slowest stage sets the pace, one pass per ``max W / P``; the fill
    ahead of it and the drain behind it add one pass of every other stage, so the phases take
    ``max W (P - 1) / P + sum W / P`` (``W (P + S - 1) / P`` when the stages are alike, the
    bubble :func:`estimate_step` prices each stage with). Then the optimizers run side by side,
    after the gradients' norm over every stage: the slowest window ends the step."""
    work, optimizer = [], 0.0
    for estimates in stages.values():
        own = [
            e["step_time_s"] - e["bubble_s"] - e["by_kind"].get("optimizer", 0.0) for e in estimates
        ]
        work.append(max(own))
        optimizer = max(optimizer, *(e["by_kind"].get("optimizer", 0.0) for e in estimates))
    return max(work) * (passes - 1) / passes + sum(work) / passes + optimizer


def collective_seconds(
    axis: GroupAxis, op: str, payload: int, spec: DeviceSpec, bandwidth_only: bool = False
) -> float:
    """Seconds of one op's ``payload`` bytes on the group: a ring over NVLink inside a node and
    the network across nodes; inside a node as measured for the op and size
    (:meth:`DeviceSpec.collective_seconds`, two ranks: scaled to ``axis.size`` by the ring's
    bytes), or with ``bandwidth_only`` at the op's measured bandwidth, latency left out."""
    if axis.size == 1 or not payload:
        return 0.0
    family = "all_reduce" if op.startswith("all_reduce") else op
    ring = RING_FACTOR[family]
    if family == "receive":
        return 0.0
    nodes = {member // spec.devices_per_node for member in axis.members}
    if len(nodes) > 1:
        return ring(axis.size) * payload / (spec.inter_node_gb_per_s * 1e9)
    bandwidth = spec.collective_bandwidth(family) if bandwidth_only else None
    if bandwidth is not None:
        return ring(axis.size) / ring(2) * payload / bandwidth
    measured = spec.collective_seconds(family, payload)
    if measured is None:
        return ring(axis.size) * payload / (spec.intra_node_gb_per_s * 1e9)
    return ring(axis.size) / ring(2) * measured


def waited_call_seconds(axis: GroupAxis, op: str, payload: int, spec: DeviceSpec) -> float:
    """One collective waited for where it is issued. Where calibrate.py measured waiting in
    real steps (``DeviceSpec.waited_collective_us``): that, per call, plus the payload at the
    op's bandwidth. It holds the call's latency as a step sees it, the peer's lateness and the
    communication thread's wake-up; the latency between idle ranks, which moved 5x from one
    calibration to the next on a shared VM, does not enter. Else as between idle ranks."""
    if axis.size == 1 or spec.waited_collective_us is None:
        return collective_seconds(axis, op, payload, spec)
    transfer = collective_seconds(axis, op, payload, spec, bandwidth_only=True)
    return spec.waited_collective_us * 1e-6 + transfer


def axis_traffic(axis: GroupAxis, spec: DeviceSpec) -> tuple[int, float]:
    """Bytes this rank sends over a group in the step, and the seconds that takes (each call
    at its own size)."""
    if axis.size == 1:
        return 0, 0.0
    sent = seconds = 0.0
    for (op, nbytes, _), count in axis.sized_calls.items():
        family = "all_reduce" if op.startswith("all_reduce") else op
        sent += RING_FACTOR[family](axis.size) * nbytes * count
        seconds += collective_seconds(axis, op, nbytes, spec) * count
    return int(sent), seconds

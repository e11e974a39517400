"""Where a GPU step's idle time goes: each stretch with no kernel running, put down to what the
host was doing then, phase by phase, from one step profiled with CPU and CUDA activity.

    python -m benchmarks.bench_step --config gpt3_1.3B --device cuda --rows resident --idle_gaps

A gap between two kernels is one of three things:

- the host was late: the kernel that ends the gap was launched after the previous one ended.
  The host's time until that launch goes to the innermost operation it was running (the CPU
  op and, inside it, the CUDA runtime call: ``cudaStreamSynchronize`` is a wait for the GPU,
  ``cudaLaunchKernel`` the launches themselves, none a stretch of Python between ops), sampled
  at a few points of the gap, and to the phase it belongs to (``phase:KIND``, labelled by
  :class:`PhaseLabels` from the engine's ``on_phase`` hook; ``outside phases`` for the norm,
  the loss and the update that follow them). What remains until the kernel starts is launch
  latency;
- the device waited: the kernel was queued before the gap began, behind an event of another
  stream (a copy on the side stream when one overlaps the gap);
- the end: after the last kernel, until the step returned.

The profiler's CPU recording slows the host, so this step's idle share is larger than the
unprofiled one's: read the split, not the total.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.bench_profile import record_trace, synchronize

STEP_LABEL = "bench:step"
AFTER_PHASES = "after phases"
OUTSIDE_PHASES = "outside phases"
PHASE_PREFIX = "phase:"
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
SAMPLES_PER_GAP = 8


class PhaseLabels:
    """The engine's ``on_phase`` hook: a ``record_function`` range around each phase."""

    def __init__(self):
        self._open = None

    def __call__(self, phase) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        if phase is not None:
            self._open = torch.profiler.record_function(f"{PHASE_PREFIX}{phase.kind}")
            self._open.__enter__()


class PhaseClock:
    """The engine's ``on_phase`` hook for an unprofiled step: the host's and the device's
    time in each kind of phase, from a host clock and a CUDA event at each phase's start.

    The device's time of a phase is from the moment its stream reached that phase's first
    work to the moment it reached the next phase's: its kernels, and the idle time inside it
    where the host was late. The host's is from its start to the next phase's start. Where
    the host runs ahead, the device's is the longer; where the host is late, the two match.
    Read :meth:`seconds` after the step (it waits for the device).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._marks: list[tuple[str | None, float, object]] = []  # (kind, host time, event)

    def __call__(self, phase) -> None:
        """A phase starts; None: the last has ended (the norm, the loss and the update
        follow, until :meth:`stop`)."""
        self._mark(AFTER_PHASES if phase is None else phase.kind)

    def stop(self) -> None:
        """The step has returned."""
        self._mark(None)

    def _mark(self, kind: str | None) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((kind, time.perf_counter(), event))

    def seconds(self) -> dict[str, dict[str, float | None]]:
        """{kind: {"host_s", "device_s"}} summed over the step's phases of that kind, and
        ``after phases`` (the device's None on a CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out: dict[str, dict[str, float | None]] = {}
        for (kind, at, event), (_, next_at, next_event) in itertools.pairwise(self._marks):
            if kind is None:
                continue
            times = out.setdefault(kind, {"host_s": 0.0, "device_s": None})
            times["host_s"] += next_at - at
            if event is not None:
                times["device_s"] = (times["device_s"] or 0.0) + event.elapsed_time(
                    next_event
                ) / 1e3
        return out


def _intervals(events: list[dict], category: str) -> list[tuple[float, float, dict]]:
    """(start, end, event) of ``category``'s events, by start and end (two alike are not
    compared further: events are dicts)."""
    return sorted(
        (
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e)
            for e in events
            if e.get("ph") == "X" and e.get("cat") == category and "dur" in e
        ),
        key=lambda interval: interval[:2],
    )


class _HostStack:
    """Innermost host events at ascending times, by a sweep over one thread's nested events."""

    def __init__(self, events: list[dict]):
        self._events = sorted(
            (
                (float(e["ts"]), -float(e["dur"]), e)
                for e in events
                if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and "dur" in e
            ),
            key=lambda t: (t[0], t[1]),
        )
        self._next = 0
        self._stack: list[tuple[float, dict]] = []  # (end, event), innermost last

    def at(self, t: float) -> list[dict]:
        """The events open at ``t``, outermost first; calls must come in ascending ``t``."""
        while self._next < len(self._events) and self._events[self._next][0] <= t:
            start, neg_dur, event = self._events[self._next]
            while self._stack and self._stack[-1][0] <= start:
                self._stack.pop()
            self._stack.append((start - neg_dur, event))
            self._next += 1
        while self._stack and self._stack[-1][0] < t:
            self._stack.pop()
        return [event for _, event in self._stack]


def _host_range(event: dict) -> bool:
    """A ``record_function`` range as the host ran it. Kineto also draws each range on the
    GPU's timeline (``gpu_user_annotation``), over the kernels launched inside it, later."""
    return event.get("ph") == "X" and event.get("cat") == "user_annotation" and "dur" in event


class _Phases:
    """The phase label (a ``phase:KIND`` range) open at a moment, by bisection."""

    def __init__(self, events: list[dict]):
        ranges = sorted(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
            for e in events
            if _host_range(e) and e["name"].startswith(PHASE_PREFIX)
        )
        self._starts = [r[0] for r in ranges]
        self.ranges = ranges

    def at(self, t: float) -> str:
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= 0 and t <= self.ranges[i][1]:
            return self.ranges[i][2].removeprefix(PHASE_PREFIX)
        return OUTSIDE_PHASES


def _host_op(open_events: list[dict]) -> str:
    """What the host ran, from the events open at one moment: the outermost op below the
    ranges (ours, and the profiler's ``ProfilerStep#N``), and the innermost where they
    differ."""
    names = [e.get("name", "?") for e in open_events if e.get("cat") != "user_annotation"]
    if not names:
        return "python (between ops)"
    return names[0] if len(names) == 1 else f"{names[0]} > {names[-1]}"


def idle_gaps(events: list[dict]) -> dict:
    """The idle time of the step inside the ``bench:step`` range of ``events`` (a chrome
    trace's ``traceEvents``), split as the module says.

    Returns:
        ``step_ms``, ``idle_ms``; ``gaps``: rows of ``phase``, ``cause``, ``ms`` and ``count``
        (gaps, or samples of them), largest first; ``host_ms_by_phase``: the host's time in
        each kind of phase; ``kernel_ms_by_phase``: the kernels' time by the kind of phase
        that launched them (the profiler slows the host, not the kernels).
    """
    steps = [e for e in events if _host_range(e) and e["name"] == STEP_LABEL]
    assert steps, f"no {STEP_LABEL} range in the trace"
    step_start = float(steps[0]["ts"])
    step_end = step_start + float(steps[0]["dur"])
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    # (start, end, when the host launched it: None where the trace has no launch)
    kernels = [
        (start, end, launches.get(kernel.get("args", {}).get("correlation")))
        for start, end, kernel in _intervals(events, "kernel")
        if step_start <= start < step_end
    ]
    copies = _intervals(events, "gpu_memcpy")
    copy_starts = [c[0] for c in copies]
    copy_ends = list(itertools.accumulate((c[1] for c in copies), max))  # latest end so far
    tid = steps[0].get("tid")
    host = _HostStack([e for e in events if e.get("tid") == tid])
    phases = _Phases(events)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])

    def add(phase: str, cause: str, micros: float) -> None:
        totals[(phase, cause)][0] += micros
        totals[(phase, cause)][1] += 1

    busy_until = step_start
    for start, end, launch in kernels:
        if start > busy_until:
            launched = busy_until if launch is None else launch
            if launched <= busy_until:  # queued before the gap: it waited on the device
                i = bisect.bisect_left(copy_starts, start)
                copying = i > 0 and copy_ends[i - 1] > busy_until
                cause = "device waits (a copy in flight)" if copying else "device waits (event)"
                add(phases.at(launched), cause, start - busy_until)
            else:
                late = min(launched, start) - busy_until
                for n in range(SAMPLES_PER_GAP):
                    at = busy_until + (n + 0.5) * late / SAMPLES_PER_GAP
                    add(phases.at(at), _host_op(host.at(at)), late / SAMPLES_PER_GAP)
                if start > launched:
                    add(phases.at(launched), "launch latency", start - launched)
        busy_until = max(busy_until, end)
    if step_end > busy_until:
        add("after the last kernel", "until the step returned", step_end - busy_until)
    gaps = [
        {"phase": phase, "cause": cause, "ms": micros / 1e3, "count": count}
        for (phase, cause), (micros, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])
    ]
    idle = sum(g["ms"] for g in gaps)
    host_ms: dict[str, float] = defaultdict(float)
    for start, end, name in phases.ranges:
        if step_start <= start < step_end:
            host_ms[name.removeprefix(PHASE_PREFIX)] += (end - start) / 1e3
    kernel_ms: dict[str, float] = defaultdict(float)
    for start, end, launch in kernels:  # by the phase that launched each
        where = OUTSIDE_PHASES if launch is None else phases.at(launch)
        kernel_ms[where] += (end - start) / 1e3
    return {
        "step_ms": (step_end - step_start) / 1e3,
        "idle_ms": idle,
        "gaps": gaps,
        "host_ms_by_phase": dict(host_ms),
        "kernel_ms_by_phase": dict(kernel_ms),
    }


def profile_idle(step_fn: Callable, step: int, device: torch.device) -> dict:
    """Step ``step + 1``, after a profiler warm-up on step ``step``, recorded with CPU and
    CUDA activity and the engine's phases labelled; :func:`idle_gaps` of it (on a CPU, which
    runs no kernels, the whole step is one gap: only ``host_ms_by_phase`` says anything)."""
    from torch.profiler import ProfilerActivity

    labels = PhaseLabels()

    def labelled(i: int) -> None:
        with torch.profiler.record_function(STEP_LABEL):
            step_fn(i, on_phase=labels)
            synchronize(device)

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    events, _ = record_trace(labelled, step, activities)
    started = time.perf_counter()
    result = idle_gaps(events)
    result["analysed_s"] = time.perf_counter() - started
    return result


def format_gaps(result: dict, top: int = 15) -> str:
    """The largest rows of :func:`idle_gaps` as a table."""
    lines = [
        f"idle {result['idle_ms']:.1f} of {result['step_ms']:.1f} ms in the profiled step "
        f"(CPU recording slows the host: read the split)",
        f"{'phase':<22} {'cause':<64} {'ms':>9} {'count':>7}",
    ]
    for gap in result["gaps"][:top]:
        cause = gap["cause"][:64]
        lines.append(f"{gap['phase']:<22} {cause:<64} {gap['ms']:9.2f} {gap['count']:7d}")
    return "\n".join(lines)


def format_clock(seconds: dict) -> str:
    """:meth:`PhaseClock.seconds` as a table."""
    lines = ["seconds of the last timed step by kind of phase (unprofiled)"]
    lines.append(f"{'phase':<22} {'device s':>9} {'host s':>9}")
    for kind, times in seconds.items():
        device = times["device_s"]
        cell = f"{device:9.3f}" if device is not None else f"{'-':>9}"
        lines.append(f"{kind:<22} {cell} {times['host_s']:9.3f}")
    return "\n".join(lines)


def format_update_behind(rows: list[dict]) -> str:
    """The host update that ran behind the clocked step, row by row in its order
    (:meth:`~execution.engine.storage.row_updates.RowUpdates.report`): when each row was
    written, from the update's start, and how long the step's loads of it (or their
    prefetches) waited. A wait on a row written as early as the update's pace allows is the
    update's pace; a row written early and waited for long is a load waiting for more than
    its own row."""
    lines = ["host update behind the clocked step (its rows in the order it wrote them)"]
    lines.append(f"{'row':<22} {'written s':>9} {'waited s':>9}")
    for row in rows:
        written = row["written_s"]
        cell = f"{written:9.3f}" if written is not None else f"{'-':>9}"
        lines.append(f"{row['part'] + ' ' + str(row['row']):<22} {cell} {row['waited_s']:9.3f}")
    waited = sum(row["waited_s"] for row in rows)
    ends = [row["written_s"] for row in rows if row["written_s"] is not None]
    took = f"{max(ends):.3f} s" if ends else "-"
    lines.append(f"loads waited {waited:.3f} s in all; the update wrote its last row at {took}")
    return "\n".join(lines)

"""Timing that survives a machine other processes share.

A sample's wall time counts the time the scheduler kept this process's threads off a core
while they were ready to run. Linux records it per thread (``/proc/self/task/<id>/schedstat``,
its second field: nanoseconds spent runnable on a run queue), so a sample can say what it
lost:

- the calling thread's own wait is subtracted: the op did not run then, and would have run at
  once on an idle machine (exact for a one-threaded op: the engine's host code, a rank of one
  thread);
- a wait of any other thread of the process (an OpenMP worker) is not known to have cost the
  sample its own length, nor nothing: the sample is *spoiled* and kept apart. So is one whose
  reading of the waits was itself preempted (its wait would be counted outside the sample).

A measurement is the median of its clean samples, sampled until as many are clean as the
repeats asked for or three times as many were taken: a clean sample is a typical one, and the
steps a calibration predicts are compared as medians too (the fastest of them made every
estimate of time_model_check.py 5-13% short). Where too few are clean, it is the best of the
corrected ones (the least spoiled), marked as not trusted. On an idle machine every sample is
clean and nothing is subtracted: the median wall time.

Calls that two processes make together (a collective, a two-rank step) are timed as a step
pays for them: the median wall time, for the ranks' threads contend for the cores with each
other on an idle machine too. What other processes took of the machine while a measurement
ran (:class:`MachineShare`, from ``/proc/stat``) says whether such a timing is to be trusted.
Without these files (another OS) samples are wall times, all counted clean.

Calls made together cannot be cleaned of other processes' load: two ranks' collective waits
for the one the scheduler keeps off a core. So a calibration first raises its own priority
where it may (:func:`raised_priority`: root, or ``CAP_SYS_NICE``), so that the scheduler runs
its threads and ranks before others' and what it times is what an idle machine would give.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

TASKS = "/proc/self/task"
# A worker's wait below this share of the sample is noise (a wake-up's microseconds); above
# it, the op may have waited for that worker.
SPOILED_SHARE = 0.05
# Reading the threads' waits takes tens of microseconds; longer, it was preempted.
READING_LIMIT_S = 1e-3
EXTRA_SAMPLES = 3  # up to this many times the repeats asked for, to find clean samples
# Other processes' share of the machine's cores while a measurement ran, above which its
# timings that cannot be cleaned of them (calls of two processes) are not trusted.
BUSY_SHARE = 0.1
MIN_STRETCH_S = 0.5  # the shortest stretch whose share the clocks' ticks can tell
# A timing whose middle half spreads wider than this (over the median) saw the machine's
# speed change under it.
WIDE_SPREAD = 0.5
DOUBTFUL_SHARE = 0.25  # of a measurement's timings, above which it is not to be trusted


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_delays() -> dict[int, int]:
    """Nanoseconds each thread of this process has waited on a run queue so far."""
    delays = {}
    try:
        threads = os.listdir(TASKS)
    except OSError:
        return delays
    for tid in threads:
        try:
            with open(f"{TASKS}/{tid}/schedstat", "rb") as f:
                delays[int(tid)] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended, or a kernel without the field
    return delays


@dataclass(frozen=True)
class Sample:
    wall_s: float
    own_wait_s: float  # the calling thread's, subtracted
    others_wait_s: float  # the process's other threads', which spoil the sample
    reading_s: float = 0.0  # reading the waits, before and after the call

    @property
    def seconds(self) -> float:
        return max(self.wall_s - self.own_wait_s, 1e-9)

    @property
    def clean(self) -> bool:
        return (
            self.others_wait_s <= SPOILED_SHARE * self.wall_s and self.reading_s <= READING_LIMIT_S
        )


def take_sample(fn: Callable[[], object], device: torch.device) -> Sample:
    """One timed call of ``fn`` with what the scheduler took from it."""
    caller = threading.get_native_id()
    synchronize(device)
    reading = time.perf_counter()
    before = run_delays()
    started = time.perf_counter()
    fn()
    synchronize(device)
    ended = time.perf_counter()
    after = run_delays()
    reading = time.perf_counter() - ended + started - reading
    waits = {tid: (ns - before.get(tid, 0)) / 1e9 for tid, ns in after.items()}
    own = waits.pop(caller, 0.0)
    return Sample(ended - started, own, sum(waits.values()), reading)


def combined(samples: list[Sample]) -> Sample:
    """One sample of a call that several processes make together, from each one's sample of
    it: the slowest's wall time (the waits are kept for the record, not subtracted)."""
    return Sample(
        max(s.wall_s for s in samples),
        max(s.own_wait_s for s in samples),
        max(s.others_wait_s for s in samples),
        max(s.reading_s for s in samples),
    )


@dataclass(frozen=True)
class Timing:
    """A measurement's samples summarised: what the measurement uses and how far to trust it."""

    seconds: float
    samples: int
    spoiled: int
    spread: float  # (third quartile - first) / median of the samples counted
    trusted: bool
    together: bool = False  # calls of two processes (summarise_together)

    def record(self) -> dict:
        return {
            "samples": self.samples,
            "spoiled": self.spoiled,
            "spread": self.spread,
            "trusted": self.trusted,
            "together": self.together,
        }


def _spread(seconds: list[float]) -> float:
    if len(seconds) < 2:
        return 0.0
    first, _, third = statistics.quantiles(seconds, n=4, method="inclusive")
    return (third - first) / statistics.median(seconds)


def summarise(samples: list[Sample], repeats: int) -> Timing:
    """The median clean sample, trusted with at least half the repeats clean; else the best
    of all, corrected (the least spoiled), not trusted."""
    clean = [s.seconds for s in samples if s.clean]
    trusted = len(clean) >= max(1, (repeats + 1) // 2)
    counted = clean if trusted else [s.seconds for s in samples]
    seconds = statistics.median(counted) if trusted else min(counted)
    spoiled = len(samples) - len(clean)
    return Timing(seconds, len(samples), spoiled, _spread(counted), trusted)


def summarise_together(samples: list[Sample]) -> Timing:
    """Calls two processes made together: their median wall time, trusted unless other
    processes were busy (``MachineShare``, judged by the measurement's caller)."""
    walls = [s.wall_s for s in samples]
    spoiled = sum(not s.clean for s in samples)
    return Timing(statistics.median(walls), len(samples), spoiled, _spread(walls), True, True)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> Timing:
    """``fn`` after one untimed call (allocation, kernel selection), sampled until ``repeats``
    samples are clean or ``EXTRA_SAMPLES`` times as many were taken."""
    fn()
    samples: list[Sample] = []
    while len(samples) < EXTRA_SAMPLES * repeats:
        samples.append(take_sample(fn, device))
        if sum(s.clean for s in samples) >= repeats:
            break
    return summarise(samples, repeats)


# The nice value a calibration runs at where it may: the scheduler then gives its runnable
# threads about 28 times the share of a process at the default 0.
HIGH_PRIORITY = -15
AUTOGROUP = "/proc/self/autogroup"  # this session's scheduling group and its nice value


@contextlib.contextmanager
def raised_priority() -> Iterator[bool]:
    """Runs this thread, and the threads and processes it starts meanwhile, at
    :data:`HIGH_PRIORITY`, and its session's scheduling group too (Linux's autogroup, which
    otherwise shares the cores between sessions whatever their processes' nice values);
    yields False where it may not (it then runs as it was). Both are as they were afterwards:
    the session is the caller's shell's."""
    before = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None
    group = _autogroup_nice()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, HIGH_PRIORITY)
    except (OSError, AttributeError):  # not permitted, or not a POSIX system
        yield False
        return
    try:
        raised = group is None or _set_autogroup_nice(HIGH_PRIORITY)
        yield raised
    finally:
        if group is not None:
            _set_autogroup_nice(group)
        os.setpriority(os.PRIO_PROCESS, 0, before)


def _autogroup_nice() -> int | None:
    """The nice value of this session's scheduling group (None: no autogroups here)."""
    try:
        with open(AUTOGROUP) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(nice: int) -> bool:
    try:
        with open(AUTOGROUP, "w") as f:
            f.write(str(nice))
    except OSError:
        return False
    return True


def _machine_ticks() -> list[int] | None:
    """``/proc/stat``'s clock ticks of all the machine's cores by kind (user, nice, system,
    idle, iowait, irq, softirq, steal, ...), or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _machine_busy_s() -> float | None:
    """CPU seconds every process has used so far (``/proc/stat``: user, nice and system time;
    not the hypervisor's steal, nor interrupts, which a process's own network traffic
    raises), or None where there is no such file."""
    ticks = _machine_ticks()
    if ticks is None or len(ticks) < 3:
        return None
    user, nice, system = ticks[0:3]
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def stolen_s() -> float:
    """CPU seconds the hypervisor has kept this machine's cores from running so far
    (``/proc/stat``'s steal; 0 where there is no such file). A thread's own waits do not
    show it: the machine's whole clock runs slower meanwhile."""
    ticks = _machine_ticks()
    if ticks is None or len(ticks) < 8:  # a kernel without the field
        return 0.0
    return ticks[7] / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    """CPU seconds of this process and of its children that have ended (two-rank measurements
    fork their ranks and join them)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class MachineShare:
    """Other processes' share of this machine's cores over a stretch: CPU time the machine
    used less this process's (and its joined children's), over the stretch's core seconds.
    Both clocks tick in hundredths of a second: a stretch under ``MIN_STRETCH_S`` has none."""

    def __init__(self):
        self.started = time.perf_counter()
        self.machine, self.own = _machine_busy_s(), _own_busy_s()

    def others(self) -> float | None:
        elapsed = time.perf_counter() - self.started
        machine = _machine_busy_s()
        if elapsed < MIN_STRETCH_S or machine is None or self.machine is None:
            return None
        used = machine - self.machine - (_own_busy_s() - self.own)
        return min(1.0, max(0.0, used / (elapsed * (os.cpu_count() or 1))))


def doubtful_timings(measured: dict, prioritised: bool = False) -> dict[str, tuple[int, int]]:
    """By measurement, how many of its timings are not to be trusted and how many it has,
    where more than ``DOUBTFUL_SHARE`` of them are not: a timing of one process with too few
    samples clean of other processes' load, or spread over ``WIDE_SPREAD``; one of calls made
    together while other processes used more than ``BUSY_SHARE`` of the cores (its
    ``others_share``), unless the calibration ran ``prioritised`` (:func:`raised_priority`:
    the others then ran while its ranks did not need the cores)."""
    counts: dict[str, list[int]] = {}

    def walk(name: str, node: object, busy: bool) -> None:
        if isinstance(node, dict):
            timing = node.get("timing")
            if timing is not None:
                if timing.get("together"):
                    doubtful = busy and not prioritised
                else:
                    doubtful = not timing["trusted"] or timing["spread"] > WIDE_SPREAD
                counts.setdefault(name, [0, 0])[0] += doubtful
                counts[name][1] += 1
            for child in node.values():
                walk(name, child, busy)
        elif isinstance(node, list):
            for child in node:
                walk(name, child, busy)

    for name, node in measured.items():
        walk(name, node, isinstance(node, dict) and (node.get("others_share") or 0) > BUSY_SHARE)
    # On an idle machine too a few timings of many spread widely (a page fault, a tick).
    return {
        name: (bad, total) for name, (bad, total) in counts.items() if bad > DOUBTFUL_SHARE * total
    }


def load_warning(result: dict) -> str | None:
    """One line when timings of a calibration are not to be trusted."""
    doubtful = result["doubtful_timings"]
    if not doubtful:
        return None
    bad, total = (sum(counts[i] for counts in doubtful.values()) for i in (0, 1))
    busiest = max((m.get("others_share") or 0) for m in result["measurements"].values())
    return (
        f"calibrate: warning: other processes used up to {busiest:.0%} of the cores; {bad} of "
        f"{total} timings of {', '.join(sorted(doubtful))} could not be cleaned of it or "
        f"spread over {WIDE_SPREAD:.0%}: estimates on this file may be far off; calibrate "
        "again on an idle machine"
        + ("" if result.get("raised_priority") else ", or as a user who may raise its priority")
    )

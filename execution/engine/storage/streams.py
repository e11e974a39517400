"""Side streams: copies that run beside the compute, ordered only by the waits the engine makes.

On CUDA the state store issues host<->device copies on two side streams (loads ahead of their
phase, activation stores behind it) and orders them against the compute stream with events.
A missing wait there is a race that a GPU may or may not show. On a CPU every copy happens at
once, in program order, so no test could catch it. :class:`LateStream` is the CPU stand-in that
applies the GPU's rule strictly: work submitted to a side stream runs only when something waits
for it (or for work queued after it), and until then its outputs hold NaN. A run whose waits
are all in place computes the eager run's numbers bit for bit; a missing wait reads NaN. Its
GPU twin is a :class:`CudaStream` with ``delay_cycles``: each side-stream submission first
queues a spin of that many GPU cycles, so every copy lands long after the compute stream could
have read its destination, and a missing wait reads stale or uninitialised memory instead of
winning the race by luck.

Each implementation has the same operations:

- ``submit(work, outputs, inputs)``: queue ``work`` (a function that fills ``outputs`` from
  ``inputs``) behind everything the compute stream issued so far; returns an event.
- ``wait(event, tensors)``: the compute stream waits for ``event`` (and ``tensors``, made on the
  side stream, are marked as in use there for the caching allocator); ``synchronize(event)``:
  the host waits for it (before the host reads what the side stream wrote).
- ``issue()``: a context in which a collective is issued on the side stream, so that it runs
  after the stream's copies (NCCL enqueues it there; gloo reads its input at once, so the late
  stream runs what is queued first); ``allocating()``, a context whose allocations belong to
  the side stream.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch

from utils.torch_private import cuda_sleep

Work = Callable[[], None]


class EagerStream:
    """A CPU (or meta) device: work runs when submitted, in program order."""

    def submit(self, work: Work, outputs: Sequence[torch.Tensor] = (), inputs=()) -> None:
        work()

    def wait(self, event, tensors: Sequence[torch.Tensor] = ()) -> None:
        pass

    def synchronize(self, event) -> None:
        pass

    def issue(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def allocating(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


# A late CUDA side stream spins this long before each submission: about 10 ms at the 1.5-2 GHz
# of an H100's SMs, longer than a small model's whole phase, so no copy beats a missing wait.
LATE_CUDA_CYCLES = 20_000_000


class CudaStream:
    """A CUDA side stream of ``device``; ``delay_cycles`` > 0 makes it late (module docstring).
    ``after_compute`` False: its work waits for nothing on the compute stream (the host
    update's staging copies, whose inputs the step's end synchronised)."""

    after_compute = True

    def __init__(self, device: torch.device, delay_cycles: int = 0, after_compute: bool = True):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.delay_cycles = delay_cycles
        self.after_compute = after_compute

    def submit(self, work: Work, outputs: Sequence[torch.Tensor] = (), inputs=()):
        # After the compute stream's work so far (what made the inputs; earlier reads of the
        # outputs' memory).
        if self.after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.delay_cycles:
                cuda_sleep(self.delay_cycles)  # queued before the work, on this stream
            work()
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in inputs:  # the compute stream's memory, read here: not reused until done
            t.record_stream(self.stream)
        return done

    def wait(self, event, tensors: Sequence[torch.Tensor] = ()) -> None:
        compute = torch.cuda.current_stream(self.device)
        if event is not None:
            compute.wait_event(event)
        for t in tensors:  # memory made on the side stream, now read by the compute stream
            t.record_stream(compute)

    def synchronize(self, event) -> None:
        """The host waits for ``event`` (before it reads what the side stream wrote)."""
        if event is not None:
            event.synchronize()

    def issue(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def allocating(self) -> contextlib.AbstractContextManager:
        """Allocations of the side stream (the compute stream marks them when it reads)."""
        return torch.cuda.stream(self.stream)


class _LateEvent:
    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class LateStream:
    """The CPU stand-in of a side stream whose work completes late (module docstring)."""

    def __init__(self, role: str = ""):
        self.role = role  # "loads" or "stores", for messages and tests
        self._queue: list[tuple[_LateEvent, Work]] = []
        self.waits = 0  # waits that ran queued work (tests check the stand-in is exercised)

    def submit(self, work: Work, outputs: Sequence[torch.Tensor] = (), inputs=()) -> _LateEvent:
        for t in outputs:
            if t.is_floating_point():
                t.fill_(float("nan"))  # what a read before the copy completes would see
        event = _LateEvent()
        self._queue.append((event, work))
        return event

    def wait(self, event: _LateEvent | None, tensors: Sequence[torch.Tensor] = ()) -> None:
        if event is None or event.done:
            return
        self.waits += 1
        while not event.done:  # in stream order: what was queued before it runs first
            queued, work = self._queue.pop(0)
            work()
            queued.done = True

    def synchronize(self, event: _LateEvent | None) -> None:
        """The host waits: the work queued up to ``event`` runs."""
        self.wait(event)

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        self.finish()  # the collective reads its input as it is issued
        yield

    def allocating(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Runs everything queued (a device synchronise)."""
        if self._queue:
            self.wait(self._queue[-1][0])

    def pending(self) -> int:
        return len(self._queue)


# Set only inside late_side_streams(): whether the side streams made now are late.
_LATE = contextvars.ContextVar("late_side_streams", default=False)


def side_streams(device: torch.device):
    """Two side streams (loads, stores) for ``device``: CUDA streams on a GPU; on a CPU, eager
    ones. Inside :func:`late_side_streams` they are late: on a GPU each submission is delayed
    by :data:`LATE_CUDA_CYCLES`, on a CPU the stand-in's work completes only when waited for."""
    late = _LATE.get()
    if device.type == "cuda":
        delay = LATE_CUDA_CYCLES if late else 0
        return CudaStream(device, delay), CudaStream(device, delay)
    if late:
        return LateStream("loads"), LateStream("stores")
    return EagerStream(), EagerStream()


def update_stream(device: torch.device):
    """The side stream of the host update's gradient staging copies, used by the update's
    thread alone. Not the store stream: behind a step, the update's copies would queue
    behind the next step's activation stores, and those behind its compute so far; the
    gradients they read were synchronised when the step ended, so they wait for nothing.
    Late inside :func:`late_side_streams`, as the other two."""
    late = _LATE.get()
    if device.type == "cuda":
        return CudaStream(device, LATE_CUDA_CYCLES if late else 0, after_compute=False)
    return LateStream("update") if late else EagerStream()


@contextlib.contextmanager
def late_side_streams(late: bool = True) -> Iterator[None]:
    """Engines built inside (on this thread) get late side streams where ``late``: the checks
    of the engine's stream order (tests/engine/test_late_streams.py, benchmarks/gpu_check.py); never
    training."""
    token = _LATE.set(late)
    try:
        yield
    finally:
        _LATE.reset(token)

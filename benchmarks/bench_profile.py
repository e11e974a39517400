"""One profiled step of a bench_step.py row: copy rates, the GPU's idle share and which
attention kernels ran, from a Kineto (chrome) trace.

On CUDA only the device's activity is recorded (no CPU ops): the figures are rates and shares
of kernels and copies, and CPU-side recording would slow the step they come from.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

# Fused attention kernels by the names their CUDA kernels carry: FlashAttention
# (``flash_fwd_kernel``...), the memory-efficient kernel (``fmha_cutlassF``...) and cuDNN's
# (``cudnn_generated_fort_native_sdpa``...). The math path runs matmuls and a softmax instead,
# and so shows none of them.
ATTENTION_KERNEL = re.compile(r"flash|fmha|sdpa|attention", re.IGNORECASE)


def gpu_activity(events: list[dict], wall_seconds: float) -> dict:
    """Copy rates, idle share and attention kernels of one profiled step.

    Args:
        events: ``traceEvents`` of ``torch.profiler.profile.export_chrome_trace``.
        wall_seconds: Wall time of the profiled step.

    Returns:
        ``h2d_GBps`` / ``d2h_GBps``: bytes copied / time spent copying in that direction (the
        link rate the copies achieved; None when none ran); ``h2d_GB`` / ``d2h_GB``: bytes per
        step; ``gpu_idle``: share of the wall time in which no kernel ran on any stream;
        ``attention_kernels``: the distinct names of the fused attention kernels that ran
        (cut to 120 characters each), sorted.
    """
    copied = {"HtoD": [0, 0.0], "DtoH": [0, 0.0]}  # bytes, microseconds
    kernels = []
    attention = set()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") == "gpu_memcpy":
            for direction, total in copied.items():
                if direction in e.get("name", ""):
                    total[0] += int(e.get("args", {}).get("bytes", 0))
                    total[1] += float(e["dur"])
        elif e.get("cat") == "kernel":
            kernels.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
            if ATTENTION_KERNEL.search(e.get("name", "")):
                attention.add(e["name"][:120])
    busy, end = 0.0, -math.inf
    for start, stop in sorted(kernels):  # length of the union of the kernel intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    out: dict = {}
    for direction, key in (("HtoD", "h2d"), ("DtoH", "d2h")):
        nbytes, micros = copied[direction]
        out[f"{key}_GBps"] = nbytes / micros / 1e3 if nbytes and micros else None
        out[f"{key}_GB"] = nbytes / 1e9
    out["gpu_idle"] = max(0.0, 1.0 - busy / 1e6 / wall_seconds)
    out["attention_kernels"] = sorted(attention)
    return out


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record_trace(run: Callable[[int], None], step: int, activities: list) -> tuple[list, float]:
    """The chrome trace's events of ``run(step + 1)`` after a profiler warm-up on
    ``run(step)`` (which keeps the profiler's start-up, CUPTI's initialisation, out of it), and
    its wall time. ``run`` must wait for the device's work before it returns."""
    from torch.profiler import profile, schedule

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with (
            warnings.catch_warnings(),
            profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=1, active=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(path),
            ) as prof,
        ):
            # Only the recorded step's events are wanted, which the profiler warns about.
            warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
            run(step)
            prof.step()
            started = time.perf_counter()
            run(step + 1)
            wall = time.perf_counter() - started
            prof.step()
        with open(path) as trace:
            return json.load(trace)["traceEvents"], wall


def profile_step(step_fn: Callable[[int], float], step: int, device: torch.device) -> dict:
    """Profiles step ``step + 1`` after a profiler warm-up on step ``step``; its GPU activity.

    Kernels are only recorded on CUDA; elsewhere the idle share comes out 1.
    """
    from torch.profiler import ProfilerActivity

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]

    def run(i: int) -> None:
        step_fn(i)
        synchronize(device)  # the warm-up step's kernels stay out of the recorded one

    events, wall = record_trace(run, step, activities)
    activity = gpu_activity(events, wall)
    if on_cuda and not any(e.get("cat") == "kernel" for e in events):
        activity["gpu_idle"] = None  # no kernel recorded: the profiler missed them, not idle
    return activity

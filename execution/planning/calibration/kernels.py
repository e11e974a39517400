"""The device's own rates, for the calibration (``calibrate.py``): matmuls by shape, attention,
a large copy, host memory, launches, fresh memory's first touch, and the memory free to use.
Each takes the device and the calibration's ``Sizes`` and returns plain numbers (its module
docstring says what each is for); the runtime's measurements (the host link, the host AdamW,
collectives, the engine's own time) are ``runtime.py``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch
from torch.nn.attention import sdpa_kernel

from execution.engine.phases.recompute import SDPA_BACKENDS, attention_kernel
from execution.engine.plan import GiB
from execution.parallel.launch import usable_cores
from execution.planning.memory import _host_memory_available
from utils.sample_clock import Sample, summarise, take_sample, timed


def matmul_shapes(sizes) -> list[tuple[str, int, int, int]]:
    """(kind, m, n, k): squares, each GPT layer matmul of ``tokens`` rows, then a grid of
    shapes (a step's matmuls are of many shapes: the head's vocabulary-wide ones, their
    transposes in the backward, thin ones at small hidden sizes; the rate depends on each
    dimension, not only on the FLOPs)."""
    shapes = [("square", s, s, s) for s in sizes.squares]
    for m, n, k in itertools.product(sizes.grid, repeat=3):
        if 2 * m * n * k <= sizes.grid_flops:
            shapes.append(("grid", m, n, k))
    for h in sizes.hidden_sizes:
        t = sizes.tokens
        shapes += [("qkv", t, 3 * h, h), ("attn_out", t, h, h)]
        shapes += [("mlp_in", t, 4 * h, h), ("mlp_out", t, h, 4 * h)]
    return shapes


def _matmul_sample(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Sample:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # untimed: allocation, kernel selection
    return take_sample(lambda: torch.mm(a, b, out=out), device)


def measure_matmul(device: torch.device, sizes) -> dict:
    """Each shape's median time, timed in rounds that take every shape once: a shared
    machine's speed drifts over seconds, and shapes timed one after another had put a slow
    stretch on a block of them (two calibrations' rates differed 18% on ``tiny``'s step).
    Shapes that another process's load spoiled (utils/sample_clock.py) get more rounds."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = matmul_shapes(sizes)
    samples: list[list[Sample]] = [[] for _ in shapes]
    for round_ in range(3 * sizes.repeats):
        for (_, m, n, k), taken in zip(shapes, samples, strict=True):
            if round_ < sizes.repeats or sum(s.clean for s in taken) < sizes.repeats:
                taken.append(_matmul_sample(m, n, k, dtype, device))
    rows = []
    for (kind, m, n, k), taken in zip(shapes, samples, strict=True):
        timing = summarise(taken, sizes.repeats)
        rows.append({"kind": kind, "m": m, "n": n, "k": k, "seconds": timing.seconds})
        rows[-1] |= {"tflops": 2 * m * n * k / timing.seconds / 1e12, "timing": timing.record()}
    return {"dtype": str(dtype).removeprefix("torch."), "shapes": rows}


def measure_memory(device: torch.device, sizes) -> dict:
    """One large copy: it reads and writes every byte, so 2 x bytes over the time (the median
    of three times the repeats: each takes milliseconds, and two calibrations had put
    tiny's memory-bound ops 40% apart)."""
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    timing = timed(lambda: dst.copy_(src), device, 3 * sizes.repeats)
    return {
        "bytes": sizes.copy_bytes,
        "seconds": timing.seconds,
        "gb_per_s": 2 * src.numel() / timing.seconds / 1e9,
        "timing": timing.record(),
    }


def measure_random(device: torch.device, sizes) -> dict:
    """Dropout's draw (``bernoulli_``) over a tensor of the copy's bytes in the compute dtype:
    its seconds, elements and the bytes the time model counts for it (what it writes), whose
    time at the memory rate ``calibrate.py`` takes out of it (``random_draw_ns``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mask = torch.empty(sizes.copy_bytes // dtype.itemsize, dtype=dtype, device=device)
    timing = timed(lambda: mask.bernoulli_(0.9), device, sizes.repeats)
    nbytes = mask.numel() * mask.element_size()
    record = {"elements": mask.numel(), "bytes": nbytes, "seconds": timing.seconds}
    return record | {"timing": timing.record()}


def measure_launch(device: torch.device, sizes) -> dict:
    """Host time per launch: many tiny kernels queued back to back, one sync at the end, so the
    time is the launches' and not the kernels' (on a CPU, the dispatcher's per-op cost)."""
    x = torch.zeros(1, device=device)

    def launches() -> None:
        for _ in range(sizes.launches):
            x.add_(1.0)

    timing = timed(launches, device, sizes.repeats)
    overhead_us = timing.seconds / sizes.launches * 1e6
    return {"launches": sizes.launches, "overhead_us": overhead_us, "timing": timing.record()}


def measure_host_memory(device: torch.device, sizes) -> dict:
    return measure_memory(torch.device("cpu"), sizes)


def measure_shared_memory(device: torch.device, sizes) -> dict:
    """A CPU's memory bandwidth with every core streaming at once: the large copy on as many
    threads as the host has cores, whatever this rank's are (a run's ranks share it:
    ``DeviceSpec.memory_rate``); nothing on a GPU."""
    if device.type != "cpu":
        return {"gb_per_s": 0.0, "timing": {"spread": 0.0, "trusted": True, "together": False}}
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        return measure_memory(device, sizes)
    finally:
        torch.set_num_threads(threads)


# Passes of a memory rate taken apart in time agree when they differ by at most this share of
# the slowest: an idle calibration's passes differ by up to 16% on two threads (39-45 GB/s),
# where the stretches this guards against differ by 60% (42 and 68).
RATE_AGREEMENT = 0.25


def median_pass(passes: list[dict]) -> dict:
    """One memory rate from passes of :func:`measure_memory` taken apart in time: the median
    pass's fields, every pass's rate, and a timing that is trusted where they agree
    (:data:`RATE_AGREEMENT`) and each was. Two cores of a shared VM stream at 42 GB/s for
    minutes and 68 GB/s for the next (their one-thread rate stays 33-35): one pass prices
    every run on the one stretch it met (a calibration at 68 priced two memory-bound rows
    0.73 and 0.77 of the runs that followed); the median of passes minutes apart takes the
    rate most of the calibration saw, and a disagreement is counted in its load warning."""
    ranked = sorted(passes, key=lambda p: p["gb_per_s"])
    rates = [p["gb_per_s"] for p in ranked]
    spread = (rates[-1] - rates[0]) / rates[0] if rates[0] else 0.0
    trusted = spread <= RATE_AGREEMENT and all(p["timing"]["trusted"] for p in passes)
    timing = {"samples": len(passes), "spoiled": 0, "spread": spread, "trusted": trusted}
    return ranked[(len(ranked) - 1) // 2] | {
        "passes_gb_per_s": [p["gb_per_s"] for p in passes],
        "timing": timing | {"together": False},
    }


def measure_attention(device: torch.device, sizes) -> dict:
    """Causal SDPA forward and backward, on the kernel a run of this device and dtype is
    pinned to (on Hopper torch would otherwise prefer cuDNN's): FLOPs as the step meter
    counts them (torch's formula, halved for the causal kernel) over the time."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, s, d = sizes.attention
    q, k, v = (
        torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )
    backend = SDPA_BACKENDS.get(attention_kernel(device.type, 0.0, dtype))

    def step() -> None:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))

    timing = timed(step, device, sizes.repeats)
    forward = 2 * (2 * b * h * s * s * d)
    flops = (forward + 5 * forward // 2) // 2
    return {
        "shape": [b, h, s, d],
        "seconds": timing.seconds,
        "tflops": flops / timing.seconds / 1e12,
        "timing": timing.record(),
    }


def measure_fresh_memory(device: torch.device, sizes) -> dict:
    """What a new block costs beyond filling a reused one, by size (a CPU: blocks above the
    allocator's mapping threshold come from the kernel each time and fault in on first
    touch). The threshold is the smallest size that costs at least half the largest's rate;
    nothing on CUDA, whose caching allocator reuses blocks."""
    if device.type == "cuda":
        return {"gb_per_s": 0.0, "threshold": 0, "sizes": []}
    rows = []
    for shift in range(20, 29):  # 1 MiB to 256 MiB
        n = (1 << shift) // 4
        kept = torch.empty(n)
        reused = timed(lambda kept=kept: kept.fill_(1.0), device, sizes.repeats + 4)
        fresh = timed(lambda n=n: torch.empty(n).fill_(1.0), device, sizes.repeats + 4)
        extra = max(fresh.seconds - reused.seconds, 1e-9)
        rows.append({"bytes": 4 * n, "extra_s": extra, "timing": fresh.record()})
        del kept
    largest = rows[-1]["bytes"] / rows[-1]["extra_s"]  # bytes per second of first touch
    threshold = next(r["bytes"] for r in rows if r["bytes"] / r["extra_s"] <= 2 * largest)
    return {"gb_per_s": largest / 1e9, "threshold": threshold, "sizes": rows}


def measure_free_memory(device: torch.device, sizes) -> dict:
    """GiB free to use, before any other measurement holds memory: what a run plans with
    (execution/planning/memory.py: ``measure_budget``), not what the machine has installed.
    On a GPU, ``mem_get_info``'s free bytes once the caching allocator has returned its blocks:
    the CUDA context (made by then) and other processes' memory are already outside them. Of
    the host, ``MemAvailable`` (page cache the kernel would reclaim counts, other processes'
    memory does not); physical pages where ``/proc/meminfo`` is missing. On a CPU the two
    are one pool."""
    host = _host_memory_available() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return {"device_gib": free / GiB, "device_total_gib": total / GiB, "host_gib": host / GiB}
    return {"device_gib": host / GiB, "host_gib": host / GiB}

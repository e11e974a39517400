"""Measures the device constants the time model uses and writes them as a device spec file.

    python benchmarks/calibrate.py --device cuda --output spec.json [--base h100_sxm]
    python run_pretraining.py --config gpt3_1.3B --dry_run --device_spec_file spec.json

Each measurement is one function of :data:`MEASUREMENTS` that returns plain numbers; they are
all kept under ``measurements`` in the file, and :func:`spec_fields` turns them into the
:class:`DeviceSpec` fields the dry run reads (``device_spec``). A later measurement (collective
rates, say) is one more entry in both places.

- matmul: TFLOPS of ``(m, k) @ (k, n)`` for square shapes and the GPT layer's own shapes (qkv,
  attention output, both MLP matmuls) at a few hidden sizes, in bfloat16 on a GPU and float32 on
  a CPU. ``compute_efficiency`` is the GPT shapes' FLOPs over their time, against the peak.
- memory: device memory bandwidth from a large copy (bytes read + written per second).
- host_link (CUDA only): host-to-device and device-to-host copy rates on host memory allocated
  as the engine's buffers are (registered pages), each direction alone and both at once on two
  streams, as the engine's loads and stores run.
- launch: host time per small kernel, from a long run of tiny in-place adds.
- host_memory: host memory bandwidth from a large host copy.
- host_adamw: elements per second of the engine's host AdamW update itself (its thread pool,
  its chunks), what the time model prices a host update at.
- free_memory: device and host memory free to use when the calibration starts.
- attention: causal ``scaled_dot_product_attention``, forward and backward, at a GPT shape;
  its FLOPs (half the square) over its time, against the peak, is ``attention_efficiency``.
- collectives: all-gather, reduce-scatter, all-reduce, all-to-all and send/receive between two
  local ranks (gloo on a CPU, NCCL where two GPUs are visible), payload bytes per second at a
  few sizes.
- engine: the engine's own host time. Real steps of a model too small for its ops to cost more
  than their launch, at three micro-batch counts, less what the ops' FLOPs and bytes take;
  what is left is fitted as (ops x launch) + (phases x phase overhead), so ``launch`` is the
  engine's cost per op as its modules issue them, not only a bare kernel's.
- waited_collectives: real steps of that model at tensor-parallel 2 on two ranks, less the time
  model's step on the rates above, per collective waited for where it is issued: what such a
  call costs in a step besides its payload at the op's bandwidth (its latency as a step sees
  it, the peer's lateness, waking the communication thread).

On a CPU the "device" is the host: its measured best matmul rate stands in for the peak (no
data sheet), and memory and host_link are host memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibrate_runtime import (
    measure_collectives,
    measure_engine,
    measure_host_adamw,
    measure_host_link,
    measure_waited_collectives,
)
from command_line import check_output_file, exit_on_bad_input
from sample_clock import (
    MachineShare,
    Sample,
    doubtful_timings,
    load_warning,
    raised_priority,
    summarise,
    take_sample,
    timed,
)

from config.loading import OneLineParser
from execution.engine.phases.recompute import SDPA_BACKENDS, attention_kernel
from execution.parallel.launch import select_device
from execution.planning.device_specs import SPECS, spec_file_dict
from execution.planning.memory import _host_memory_available
from utils.metrics import device_peak_tflops

GiB = 2**30


@dataclass(frozen=True)
class Sizes:
    """How large and how often: the real calibration, or ``--quick`` for tests."""

    squares: tuple[int, ...]
    hidden_sizes: tuple[int, ...]  # GPT layer shapes at these hidden sizes
    tokens: int  # rows of the activations: micro-batch x sequence
    copy_bytes: int  # device and host memory copies
    link_bytes: int  # host<->device copies
    launches: int
    repeats: int
    attention: tuple[int, int, int, int] = (4, 8, 512, 64)  # batch, heads, sequence, head dim
    # The engine's messages reach tens of MB (a vocabulary's gradients in one reduce-scatter,
    # its weights in one all-gather); rates between 16 and 64 MB are far from linear.
    collective_bytes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 25, 1 << 26)
    collective_repeats: int = 9  # a shared machine's collectives vary 2x run to run
    engine_steps: int = 6
    # (layers, micro-batches) of the engine model's tensor-parallel steps (waited_collectives):
    # its waited-for collectives grow with both.
    waited_shapes: tuple[tuple[int, int], ...] = ((2, 4), (6, 4))
    grid: tuple[int, ...] = ()  # every (m, n, k) of these, up to grid_flops
    grid_flops: float = 0.0
    # float32 elements of the host AdamW update: large enough that its four tensors stream
    # from memory rather than sit in cache, as a rank's shards do.
    adamw_elements: int = 1 << 20


FULL = {
    "cuda": Sizes(
        (4096, 8192),
        (2048, 4096),
        8192,
        2 * GiB,
        GiB,
        2000,
        10,
        grid=(256, 1024, 4096, 16384, 65536),
        grid_flops=4e12,
        adamw_elements=1 << 26,
        # gpt3_1.3B's micro-batch of 4: a smaller shape is timed by its launches, not its
        # kernels (the first H200 run's (4, 8, 512, 64) gave 8 TFLOPS, 1% of the peak).
        attention=(4, 16, 2048, 128),
    ),
    "cpu": Sizes(
        (512, 1024),
        (256, 512),
        1024,
        GiB // 4,
        GiB // 4,
        2000,
        3,
        grid=(32, 128, 512, 2048, 8192, 32768),
        grid_flops=2e10,
        adamw_elements=1 << 24,
    ),
}
QUICK = Sizes(
    (64, 128),
    (64,),
    128,
    16 * 2**20,
    16 * 2**20,
    100,
    2,
    attention=(1, 2, 64, 32),
    collective_bytes=(1 << 16,),
    collective_repeats=2,
    engine_steps=8,
    waited_shapes=((1, 2), (3, 2)),
)


def matmul_shapes(sizes: Sizes) -> list[tuple[str, int, int, int]]:
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


def measure_matmul(device: torch.device, sizes: Sizes) -> dict:
    """Each shape's median time, timed in rounds that take every shape once: a shared
    machine's speed drifts over seconds, and shapes timed one after another had put a slow
    stretch on a block of them (two calibrations' rates differed 18% on ``tiny``'s step).
    Shapes that another process's load spoiled (sample_clock.py) get more rounds."""
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


def measure_memory(device: torch.device, sizes: Sizes) -> dict:
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


def measure_launch(device: torch.device, sizes: Sizes) -> dict:
    """Host time per launch: many tiny kernels queued back to back, one sync at the end, so the
    time is the launches' and not the kernels' (on a CPU, the dispatcher's per-op cost)."""
    x = torch.zeros(1, device=device)

    def launches() -> None:
        for _ in range(sizes.launches):
            x.add_(1.0)

    timing = timed(launches, device, sizes.repeats)
    overhead_us = timing.seconds / sizes.launches * 1e6
    return {"launches": sizes.launches, "overhead_us": overhead_us, "timing": timing.record()}


def measure_host_memory(device: torch.device, sizes: Sizes) -> dict:
    return measure_memory(torch.device("cpu"), sizes)


def measure_attention(device: torch.device, sizes: Sizes) -> dict:
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


def measure_fresh_memory(device: torch.device, sizes: Sizes) -> dict:
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


def measure_free_memory(device: torch.device, sizes: Sizes) -> dict:
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


MEASUREMENTS: dict[str, Callable[[torch.device, Sizes], dict]] = {
    "free_memory": measure_free_memory,
    "matmul": measure_matmul,
    "memory": measure_memory,
    "host_link": measure_host_link,
    "launch": measure_launch,
    "host_memory": measure_host_memory,
    "attention": measure_attention,
    "fresh_memory": measure_fresh_memory,
    "host_adamw": measure_host_adamw,
    "collectives": measure_collectives,
}


def spec_fields(measured: dict, device: torch.device) -> dict:
    """The :class:`DeviceSpec` fields these measurements give (the rest stay the base's)."""
    shapes = measured["matmul"]["shapes"]
    # A CPU's peak is its best rate, of the timings clean of other processes' load where
    # there are any (a corrected timing of a spoiled multi-threaded op can read too fast).
    trusted = [s for s in shapes if s.get("timing", {}).get("trusted", True)] or shapes
    best = max(s["tflops"] for s in trusted)
    gpt = [s for s in shapes if s["kind"] not in ("square", "grid")]
    gpt_rate = sum(2 * s["m"] * s["n"] * s["k"] for s in gpt) / sum(s["seconds"] for s in gpt)
    peak = device_peak_tflops(device, 0.0) or best  # no data sheet (a CPU): the best measured
    host_bw = measured["host_memory"]["gb_per_s"]
    link = measured["host_link"]
    # Each direction's rate while the other runs too: the engine's loads and stores share the
    # link (and host memory) on two streams, so a rate timed alone overstates what either
    # gets in a phase that moves both.
    h2d, d2h = link.get("h2d_gb_per_s", host_bw), link.get("d2h_gb_per_s", host_bw)
    # The time model prices a phase's loads and stores together at this one rate: the
    # bytes per second of both directions at once prices a phase that moves both ways, a
    # direction alone one that only loads (gpt3_6.7B streamed keeps its gradients on the
    # device); the slowest of these prices no phase faster than the link runs it.
    alone_and_both = ("h2d_alone_gb_per_s", "d2h_alone_gb_per_s", "both_gb_per_s")
    one_rate = min(link[key] for key in alone_and_both) if "both_gb_per_s" in link else host_bw
    free = measured["free_memory"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "name": f"calibrated {name}",
        "peak_tflops": peak,
        "compute_efficiency": min(1.0, gpt_rate / 1e12 / peak),
        "memory_gb": free["device_gib"],
        "host_memory_gb": free["host_gib"],
        "host_link_gb_per_s": one_rate,
        "matmul_tflops": [[s["m"], s["n"], s["k"], s["tflops"]] for s in shapes],
        "device_memory_gb_per_s": measured["memory"]["gb_per_s"],
        "h2d_gb_per_s": h2d,
        "d2h_gb_per_s": d2h,
        "launch_overhead_us": measured["launch"]["overhead_us"],
        "host_memory_gb_per_s": host_bw,
        "attention_efficiency": min(1.0, measured["attention"]["tflops"] / peak),
        "collective_gb_per_s": [tuple(row) for row in measured["collectives"]["rates"]],
        "device_type": device.type,
        # A CPU's copies and gloo's collectives run on the cores that compute.
        "copies_overlap": device.type == "cuda",
        "fresh_memory_gb_per_s": measured["fresh_memory"]["gb_per_s"],
        "fresh_memory_threshold": measured["fresh_memory"]["threshold"],
        "host_adamw_elements_per_s": measured["host_adamw"]["elements_per_s"],
    }


def _timed(name: str, measure: Callable[..., dict], *args) -> dict:
    """``measure(*args)``, printing how long it took, with the share of the cores other
    processes used meanwhile."""
    started, others = time.perf_counter(), MachineShare()
    result = measure(*args) | {"others_share": others.others()}
    print(f"calibrate: {name} {time.perf_counter() - started:.1f} s", flush=True)
    return result


def calibrate(device: torch.device, sizes: Sizes, base: str, prioritised: bool = False) -> dict:
    """Every measurement, and the device spec they give on top of ``base`` (``prioritised``:
    this process runs at a raised priority, :func:`~sample_clock.raised_priority`)."""
    measured = {name: _timed(name, fn, device, sizes) for name, fn in MEASUREMENTS.items()}
    spec = dataclasses.replace(SPECS[base], **spec_fields(measured, device))
    spec = dataclasses.replace(
        spec,
        matmul_tflops=tuple(map(tuple, spec.matmul_tflops)),
        collective_gb_per_s=tuple(map(tuple, spec.collective_gb_per_s)),
    )
    # The engine's own time, measured against the kernels' rates just measured.
    engine = measured["engine"] = _timed("engine", measure_engine, device, sizes, spec)
    spec = dataclasses.replace(
        spec, launch_overhead_us=engine["launch_us"], phase_overhead_us=engine["phase_us"]
    )
    # Waiting for a collective inside a step, against the engine's time just measured.
    waited = _timed("waited_collectives", measure_waited_collectives, device, sizes, spec)
    measured["waited_collectives"] = waited
    spec = dataclasses.replace(spec, waited_collective_us=waited["waited_us"])
    doubtful = doubtful_timings(measured, prioritised)
    return {
        "device_spec": spec_file_dict(spec),
        "base": base,
        "measurements": measured,
        "doubtful_timings": {name: list(counts) for name, counts in doubtful.items()},
        "raised_priority": prioritised,
    }


def summary(result: dict) -> str:
    s = result["device_spec"]
    return (
        f"{s['name']}: peak {s['peak_tflops']:.3g} TFLOPS, GPT matmuls at "
        f"{s['compute_efficiency']:.0%} of it; memory {s['device_memory_gb_per_s']:.0f} GB/s; "
        f"H2D {s['h2d_gb_per_s']:.1f} GB/s, D2H {s['d2h_gb_per_s']:.1f} GB/s; launch "
        f"{s['launch_overhead_us']:.1f} us per op, {s['phase_overhead_us']:.0f} us per phase; "
        f"host memory {s['host_memory_gb_per_s']:.1f} GB/s, host AdamW "
        f"{s['host_adamw_elements_per_s'] / 1e6:.0f} M elements/s; attention at "
        f"{s['attention_efficiency']:.0%} of the peak; "
        f"{len(s['collective_gb_per_s'])} collective rates, "
        f"{s['waited_collective_us'] or 0:.0f} us per waited-for collective"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--output", required=True, help="device spec file to write (JSON)")
    base_help = "data-sheet entry whose fields the measurements do not cover (network, storage)"
    parser.add_argument("--base", choices=sorted(SPECS), default="h100_sxm", help=base_help)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    threads_help = (
        "CPU threads per rank (a CPU spec describes one rank: torchrun starts each of N ranks "
        "with OMP_NUM_THREADS=1, one process alone uses every core); default: torch's"
    )
    parser.add_argument("--threads", type=int, default=0, help=threads_help)
    args = parser.parse_args(argv)
    check_output_file("--output", args.output)  # written after minutes of measuring
    if args.threads < 0:
        parser.error("--threads must be 0 (torch's default) or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    # Before any thread or rank starts: they run at the priority of the thread that starts them.
    # The device as a run selects it (on a CPU: freed blocks kept, as the engine's process has).
    device = select_device(args.device, 0)
    sizes = QUICK if args.quick else FULL[device.type]
    # Raised before any thread or rank starts: they run at the priority of their starter.
    with raised_priority() as prioritised:
        result = calibrate(device, sizes, args.base, prioritised)
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(summary(result))
    if warning := load_warning(result):
        print(warning, file=sys.stderr)
    print(f"written: {args.output} (use it with --device_spec_file)")
    return result


if __name__ == "__main__":
    exit_on_bad_input(main, "calibrate.py")

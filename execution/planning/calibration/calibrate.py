"""The calibration: measures the device constants the time model uses and gives them as a
device spec (``benchmarks/calibrate.py`` writes it as a file).

Each measurement is one function of :data:`MEASUREMENTS` that returns plain numbers; they are
all kept under ``measurements`` in the file, and :func:`spec_fields` turns them into the
:class:`DeviceSpec` fields the dry run reads (``device_spec``). A later measurement (collective
rates, say) is one more entry in both places.

- matmul: TFLOPS of ``(m, k) @ (k, n)`` for square shapes and the GPT layer's own shapes (qkv,
  attention output, both MLP matmuls) at a few hidden sizes, in bfloat16 on a GPU and float32 on
  a CPU. ``compute_efficiency`` is the GPT shapes' FLOPs over their time, against the peak.
- memory: device memory bandwidth from a large copy (bytes read + written per second), the
  median of three passes minutes apart (so host_memory too: ``kernels.median_pass``).
- host_link (CUDA only): host-to-device and device-to-host copy rates on host memory allocated
  as the engine's buffers are (registered pages), each direction alone and both at once on two
  streams, as the engine's loads and stores run.
- launch: host time per small kernel, from a long run of tiny in-place adds.
- random: dropout's draw (``bernoulli_``) over a large tensor in the compute dtype; its time
  beyond its bytes' at the memory rate, per number, is ``random_draw_ns`` (a CPU's generator
  computes each number: a few nanoseconds, ten or more times its bytes' time).
- host_memory: host memory bandwidth from a large host copy.
- shared_memory (CPU only): the large copy on every core at once, what the ranks of a run on
  the host share (``DeviceSpec.memory_rate``).
- host_adamw: elements per second of the engine's host AdamW update itself (its thread pool,
  its chunks), what the time model prices a host update at.
- free_memory: device and host memory free to use when the calibration starts.
- attention: causal ``scaled_dot_product_attention``, forward and backward, at a GPT shape;
  its FLOPs (half the square) over its time, against the peak, is ``attention_efficiency``.
- attention_kernels (CUDA only): each fused kernel (flash, cuDNN's, the memory-efficient one)
  at the first run's rows' calls, with dropout 0 and 0.1 (``attention.py``): the
  engine runs the fastest that passes its check (``attention_kernel_seconds``), and
  ``attention_efficiency`` is the fastest's where it beats the pinned kernel's.
- collectives: all-gather, reduce-scatter, all-reduce, all-to-all and send/receive between two
  local ranks (gloo on a CPU, NCCL where two GPUs are visible), payload bytes per second at a
  few sizes.
- host_phases: the host's own time per kind of phase (``host_phases.py``): the
  engine's real phases on kernels that cost nothing (GPT-3's structure at widths of a few
  elements), eager and compiled, each recompute mode, with dropout and without, per phase and
  per micro-batch (the update: per row), with the kernels the dry run counts for each; the
  time model prices a phase's host time from it, the kernels beyond the measured ones at
  ``launch`` each.
- waited_collectives: real steps of a small model at tensor-parallel 2 on two ranks, less the
  time model's step on the rates above, per collective waited for where it is issued: what
  such a call costs in a step besides its payload at the op's bandwidth (its latency as a step
  sees it, the peer's lateness, waking the communication thread).

On a CPU the "device" is the host: its measured best matmul rate stands in for the peak (no
data sheet), and memory and host_link are host memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from execution.engine.phases.recompute import MODES
from execution.engine.plan import GiB
from execution.planning.calibration.attention import (
    fastest_tflops,
    kernel_timings,
    measure_attention_kernels,
)
from execution.planning.calibration.host_phases import host_phase_rows
from execution.planning.calibration.kernels import (
    measure_attention,
    measure_free_memory,
    measure_fresh_memory,
    measure_host_memory,
    measure_launch,
    measure_matmul,
    measure_memory,
    measure_random,
    measure_shared_memory,
    median_pass,
)
from execution.planning.calibration.runtime import (
    measure_collectives,
    measure_host_adamw,
    measure_host_link,
    measure_waited_collectives,
)
from execution.planning.device_specs import SPECS, DeviceSpec, spec_file_dict
from utils.metrics import device_peak_tflops
from utils.sample_clock import MachineShare, doubtful_timings


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
    # The ways of running whose host time per phase is measured: (compiled, recompute,
    # dropout probability). Every way a run can take, but for --quick.
    host_runs: tuple[tuple[bool, str, float], ...] = tuple(
        (compiled, recompute, dropout)
        for compiled in (False, True)
        for recompute in MODES
        for dropout in (0.0, 0.1)
    )


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
    host_runs=((False, "full", 0.0),),
)


MEASUREMENTS: dict[str, Callable[[torch.device, Sizes], dict]] = {
    "free_memory": measure_free_memory,
    "matmul": measure_matmul,
    "memory": measure_memory,
    "host_link": measure_host_link,
    "launch": measure_launch,
    "host_memory": measure_host_memory,
    "shared_memory": measure_shared_memory,
    "attention": measure_attention,
    "attention_kernels": measure_attention_kernels,
    "fresh_memory": measure_fresh_memory,
    "random": measure_random,
    "host_adamw": measure_host_adamw,
    "collectives": measure_collectives,
}
MEMORY_RATES = ("memory", "host_memory", "shared_memory")  # measured in passes apart in time


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
    # The kernel the engine would choose there: the fastest timed without dropout, or the
    # pinned one's (a CPU's, or where none of them ran at that shape).
    attention = measured["attention"]
    fastest = fastest_tflops(measured["attention_kernels"], attention["shape"])
    attention_tflops = max(attention["tflops"], fastest or 0.0)
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
        "attention_efficiency": min(1.0, attention_tflops / peak),
        "attention_kernel_seconds": kernel_timings(measured["attention_kernels"]),
        "collective_gb_per_s": [tuple(row) for row in measured["collectives"]["rates"]],
        "device_type": device.type,
        # A CPU's copies and gloo's collectives run on the cores that compute.
        "copies_overlap": device.type == "cuda",
        "fresh_memory_gb_per_s": measured["fresh_memory"]["gb_per_s"],
        "shared_memory_gb_per_s": measured["shared_memory"]["gb_per_s"],
        "fresh_memory_threshold": measured["fresh_memory"]["threshold"],
        "random_draw_ns": random_draw_ns(measured["random"], measured["memory"]["gb_per_s"]),
        "host_adamw_elements_per_s": measured["host_adamw"]["elements_per_s"],
    }


def random_draw_ns(draw: dict, memory_gb_per_s: float) -> float:
    """Nanoseconds per number of a timed draw beyond its bytes' time at the memory rate (0
    where the bytes take as long: the draw keeps up with memory)."""
    beyond = draw["seconds"] - draw["bytes"] / (memory_gb_per_s * 1e9)
    return max(beyond, 0.0) / draw["elements"] * 1e9


def _timed(name: str, measure: Callable[..., dict], *args) -> dict:
    """``measure(*args)``, printing how long it took, with the share of the cores other
    processes used meanwhile."""
    started, others = time.perf_counter(), MachineShare()
    result = measure(*args) | {"others_share": others.others()}
    print(f"calibrate: {name} {time.perf_counter() - started:.1f} s", flush=True)
    return result


def _spec(base: str, measured: dict, device: torch.device) -> DeviceSpec:
    spec = dataclasses.replace(SPECS[base], **spec_fields(measured, device))
    return dataclasses.replace(
        spec,
        matmul_tflops=tuple(map(tuple, spec.matmul_tflops)),
        collective_gb_per_s=tuple(map(tuple, spec.collective_gb_per_s)),
    )


def calibrate(device: torch.device, sizes: Sizes, base: str, prioritised: bool = False) -> dict:
    """Every measurement, and the device spec they give on top of ``base`` (``prioritised``:
    this process runs at a raised priority, :func:`~utils.sample_clock.raised_priority`)."""
    # The memory rates in three passes minutes apart (kernels.median_pass): before the
    # rest, in their place among them, and after the host's time per phase.
    passes = {name: [MEASUREMENTS[name](device, sizes)] for name in MEMORY_RATES}
    measured = {name: _timed(name, fn, device, sizes) for name, fn in MEASUREMENTS.items()}
    for name in MEMORY_RATES:
        passes[name].append(measured[name])
        measured[name] = median_pass(passes[name])
    spec = _spec(base, measured, device)
    # The host's own time per phase, its kernels' (on a CPU) at the rates measured so far:
    # kernels a few elements wide, whose bytes are a few percent of their time at either rate.
    host = measured["host_phases"] = _timed(
        "host_phases", host_phase_rows, device, sizes.engine_steps, sizes.host_runs, spec
    )
    for name in MEMORY_RATES:
        passes[name].append(MEASUREMENTS[name](device, sizes))
        measured[name] = median_pass(passes[name])
    spec = dataclasses.replace(
        _spec(base, measured, device),
        phase_overhead_us=0.0,
        host_phase_us=tuple(map(tuple, host["rows"])),
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
    passes = result["measurements"]["memory"]["passes_gb_per_s"]
    return (
        f"{s['name']}: peak {s['peak_tflops']:.3g} TFLOPS, GPT matmuls at "
        f"{s['compute_efficiency']:.0%} of it; memory {s['device_memory_gb_per_s']:.0f} GB/s "
        f"(passes {min(passes):.0f}-{max(passes):.0f}); "
        f"H2D {s['h2d_gb_per_s']:.1f} GB/s, D2H {s['d2h_gb_per_s']:.1f} GB/s; launch "
        f"{s['launch_overhead_us']:.1f} us per op, host time of {len(s['host_phase_us'])} "
        "phase kinds and ways; "
        f"host memory {s['host_memory_gb_per_s']:.1f} GB/s, host AdamW "
        f"{s['host_adamw_elements_per_s'] / 1e6:.0f} M elements/s; a random draw "
        f"{s['random_draw_ns']:.1f} ns a number beyond its bytes; attention at "
        f"{s['attention_efficiency']:.0%} of the peak; "
        f"{len(s['collective_gb_per_s'])} collective rates, "
        f"{s['waited_collective_us'] or 0:.0f} us per waited-for collective"
    )

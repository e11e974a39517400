"""Each fused attention kernel's time on the device: what the engine's choice of kernel follows
(execution/engine/phases/attention_kernels.py), one of the calibration's measurements
(``attention_kernels``) and the whole of ``benchmarks/calibrate_attention.py``'s.

Each case is a kernel (FlashAttention-2, cuDNN's, the memory-efficient kernel), a call's shape
(sequences x heads x tokens x head dimension), a dtype and a dropout probability: causal
``scaled_dot_product_attention`` pinned to the kernel, forward and backward (what a layer's
attention costs a step), its median after one untimed call (cuDNN builds its plan there). A
kernel that cannot run a case (cuDNN draws dropout in steps of 1/16 only; a head size or
sequence a kernel refuses) is recorded with its error's first line and left out of the
timings. The default shapes are the calls of the first GPU run's rows: gpt3_1.3B's micro-batch
of 4 sequences over 16 heads of 128, gpt3_6.7B's of 4 over 32, llama3_8B's of 1 over 32, all
over 2048 tokens, with the presets' dropout 0 and 0.1. A CPU has one kernel per case and
nothing to time.
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from execution.engine.phases.attention_kernels import CUDA_KERNELS
from execution.engine.phases.recompute import SDPA_BACKENDS
from utils.sample_clock import timed

SHAPES = ((4, 16, 2048, 128), (4, 32, 2048, 128), (1, 32, 2048, 128))
DROPOUTS = (0.0, 0.1)
REPEATS = 10


def causal_attention_flops(shape: tuple[int, int, int, int]) -> int:
    """FLOPs of a causal call's forward and backward as the step meter counts them (torch's
    formula, the backward 2.5 forwards, halved for the causal kernel)."""
    b, h, s, d = shape
    forward = 2 * (2 * b * h * s * s * d)
    return (forward + 5 * forward // 2) // 2


def time_kernel(device, kernel, shape, dtype, dropout, repeats) -> dict:
    """One case: ``seconds`` and ``tflops``, or the ``error`` that stopped it."""
    b, h, s, d = shape
    # q, k and v as a block hands them over: strided views of one (B, S, 3, heads, d) tensor.
    qkv = torch.randn(b, s, 3, h, d, device=device, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in qkv.permute(2, 0, 3, 1, 4).unbind(0))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def step() -> None:
        with sdpa_kernel(SDPA_BACKENDS[kernel]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True
            )
        torch.autograd.grad(out, (q, k, v), grad)

    row = {"kernel": kernel, "shape": list(shape), "dtype": str(dtype)[6:], "dropout": dropout}
    try:
        timing = timed(step, device, repeats)
    except Exception as error:  # a case the kernel refuses: recorded, not timed
        first = (str(error).strip().splitlines() or [""])[0]
        return row | {"error": f"{type(error).__name__}: {first[:200]}"}
    flops = causal_attention_flops(shape)
    return row | {
        "seconds": timing.seconds,
        "tflops": flops / timing.seconds / 1e12,
        "timing": timing.record(),
    }


def measure_attention_kernels(
    device: torch.device,
    sizes=None,
    shapes=SHAPES,
    dropouts=DROPOUTS,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Every kernel at every shape and dropout (module docstring); ``sizes`` (calibrate.py's)
    gives the repeats. Nothing on a CPU."""
    if device.type != "cuda":
        return {"cases": [], "note": "a CPU has one kernel per case: nothing to rank"}
    repeats = getattr(sizes, "repeats", REPEATS)
    cases = [
        time_kernel(device, kernel, shape, dtype, dropout, repeats)
        for shape in shapes
        for dropout in dropouts
        for kernel in CUDA_KERNELS
    ]
    return {"cases": cases, "cudnn": torch.backends.cudnn.version()}


def kernel_timings(measured: dict) -> list[list]:
    """The spec's ``attention_kernel_seconds`` of a measurement: ``[kernel, batch, heads,
    sequence, head_dim, dtype, dropout, seconds]`` of each case that ran."""
    return [
        [case["kernel"], *case["shape"], case["dtype"], case["dropout"], case["seconds"]]
        for case in measured["cases"]
        if "seconds" in case
    ]


def fastest_tflops(measured: dict, shape: list[int]) -> float | None:
    """The fastest kernel's TFLOPS at ``shape`` without dropout (None: none ran there): what
    the dry run prices attention at, the kernel the engine would choose."""
    rates = [
        c["tflops"]
        for c in measured["cases"]
        if "tflops" in c and c["shape"] == list(shape) and not c["dropout"]
    ]
    return max(rates, default=None)


def summary(measured: dict) -> str:
    """One line per case: its time and rate, or why it did not run."""
    lines = []
    for c in measured["cases"]:
        case = (
            f"{c['kernel']:<9} {'x'.join(map(str, c['shape'])):<16} {c['dtype']} p={c['dropout']:g}"
        )
        if "seconds" in c:
            lines.append(f"{case}: {c['seconds'] * 1e3:8.3f} ms, {c['tflops']:6.1f} TFLOPS")
        else:
            lines.append(f"{case}: {c['error']}")
    return "\n".join(lines) or measured.get("note", "")

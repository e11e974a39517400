"""Checks to run by hand on a CUDA machine (CI has no GPU): correctness of the GPU paths.

    python -m benchmarks.gpu_check [--steps 4]

1. Phased (every state remote: host buffers) and resident placement give the same losses on
   the GPU within a bfloat16 tolerance, and in float32 the GPU's losses match the CPU's. Each
   state on the host alone gives resident's losses too: activations and gradients in float32,
   bfloat16 weight copies on the host within the bfloat16 tolerance; two passes, so that every
   layer is loaded and stored twice a step. The placed runs use late side streams
   (``late_side_streams``: on the GPU each copy is queued behind a spin of the GPU's clock, on a CPU
   it completes only when waited for), so a copy whose wait is missing shows as a different
   loss instead of winning its race by luck.
2. The NCCL path works for a world of one: a process group from a file:// store,
   ``ParallelLayout.build(1, 1, 1, device)``, a training step with the same loss as the
   single-process layout, and the collectives the engine uses (all-reduce, all-gather,
   reduce-scatter) on the world group.
3. The prefetching loader hands out pinned batches.
4. Attention with dropout, as one op of a compiled block, is eager's call on each kernel the
   engine pins (FlashAttention in bfloat16, the memory-efficient kernel in float32).
5. The check the engine makes of an attention kernel before it runs the calibration's fastest
   (``execution/engine/phases/attention_kernels.py``), on each fused kernel at gpt3_1.3B's
   call, with dropout 0 and 0.1: what passes, and why each other does not. It fails if a
   kernel the engine ran before (flash in bfloat16, the memory-efficient kernel in float32)
   does not pass: the check would then pass over a kernel that works.

Prints one line per check and a verdict; exits 1 if any check fails. Without CUDA it says so
in one line and exits 2, unless ``--device cpu`` asks for the checks a CPU can run (the others
are skipped). ``--json`` appends each check's result as it ends, so a check that kills the
process (a sticky CUDA error) leaves the earlier ones' results (gpu_first_run.py reads them).
"""

from __future__ import annotations

import functools
import math
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.child_process import append_json_line
from config.command_line import check_output_file, exit_on_bad_input
from config.loading import OneLineParser, parse_config
from config.schema import PretrainingConfig
from data.loader import PretrainingDataLoader, training_loader
from data.prefetch import PrefetchingLoader
from execution.engine.engine import PhasedEngine
from execution.engine.phases.attention_kernels import CUDA_KERNELS, kernel_mismatch
from execution.engine.phases.compiled import attention_op_mismatch, compile_unavailable
from execution.engine.storage.streams import late_side_streams
from execution.parallel.mesh import ParallelLayout, _all_gather_flat, _reduce_scatter_flat
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape
from execution.training.lr_schedule import learning_rate

NO_GPU_EXIT = 2  # asked to check a GPU where there is none: a usage error
# A check left a sticky CUDA error: its result is recorded, the checks after it did not run.
CUDA_POISONED_EXIT = 3
BF16_LOSS_TOLERANCE = 2e-2  # absolute, on losses near ln(50257) = 10.8 (bf16 has 8 bits)
FP32_LOSS_TOLERANCE = 1e-4

# Eager: the checks are of placements, streams and NCCL, and a dozen engines each compiling
# its blocks would take the checks past their minutes of a lent GPU (the rows compile).
SMALL = shlex.split(
    "--config tiny --layers 2 --hidden_size 64 --heads 4 --sequence_length 64 "
    "--max_positional_length 64 --global_batch_size 8 --micro_batch_size 2 --dropout_prob 0 "
    "--compile false"
)
# gpu_first_run.py --quick: the same checks on a smaller model still (tests on a CPU).
QUICK = shlex.split("--hidden_size 32 --sequence_length 32 --max_positional_length 32")


def small_config(*flags: str) -> PretrainingConfig:
    config, _ = parse_config([*SMALL, *flags])
    return config


def sample_loader(config: PretrainingConfig) -> PretrainingDataLoader:
    """The checks' data (their configs name no files, so the shipped sample), read as the only
    data-parallel replica reads it."""
    return training_loader(config, dp_rank=0, dp_size=1)


def batches_for(config: PretrainingConfig, count: int) -> list[torch.Tensor]:
    loader = sample_loader(config)
    return [loader.next_batch() for _ in range(count)]


def losses(
    config: PretrainingConfig, layout: ParallelLayout, batches, late: bool = False
) -> list[float]:
    """Losses of ``batches``, one step each, under the planner's choice; ``late``: with late
    side streams (module docstring)."""
    run = RunShape.of(config)
    plan, _ = plan_for_process(run, layout)
    with late_side_streams(late):
        engine = PhasedEngine(run.engine_plan(plan), layout)
    t = config.training
    out = []
    for step, batch in enumerate(batches):
        lr = learning_rate(step, t.optimizer, config.tokens_per_step, t.steps)
        out.append(engine.train_step(batch, step, lr).loss)
    return out


def max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def compare(a: list[float], b: list[float], tolerance: float) -> tuple[bool, str]:
    difference = max_difference(a, b)
    finite = all(math.isfinite(x) for x in [*a, *b])
    detail = (
        f"max |loss difference| {difference:.2e} (tolerance {tolerance:.0e}) over {len(a)} steps"
    )
    return finite and difference <= tolerance, detail


# ---------------------------------------------------------------------------- checks


@functools.cache
def resident_losses(flags: tuple[str, ...], device: torch.device, steps: int) -> list[float]:
    """Every state on the device: the reference of the placement checks, run once per setting."""
    config = small_config(*flags, "--placement", "resident")
    return losses(config, ParallelLayout.single(device), batches_for(config, steps))


def against_resident(
    device: torch.device, steps: int, precision: str, flags: list[str], tolerance: float
) -> tuple[bool, str]:
    """Losses of the run with ``flags`` (its side streams late) against the same run with
    every state resident."""
    common = ["--precision", precision, "--device", device.type]
    config = small_config(*common, *flags)
    placed = losses(config, ParallelLayout.single(device), batches_for(config, steps), late=True)
    resident = resident_losses((*SMALL, *common), device, steps)
    ok, detail = compare(placed, resident, tolerance)
    return ok, f"{detail}; {placed[0]:.4f} -> {placed[-1]:.4f}"


def check_placements(device: torch.device, steps: int) -> tuple[bool, str]:
    """Every state remote (phased, host buffers) vs every state resident, bfloat16."""
    flags = ["--placement", "remote"]
    return against_resident(device, steps, "bfloat16", flags, BF16_LOSS_TOLERANCE)


def check_host_activations(device: torch.device, steps: int) -> tuple[bool, str]:
    flags = ["--placement", "resident", "--activations_placement", "host", "--passes", "2"]
    return against_resident(device, steps, "float32", flags, FP32_LOSS_TOLERANCE)


def check_host_gradients(device: torch.device, steps: int) -> tuple[bool, str]:
    flags = ["--placement", "resident", "--grads_placement", "host", "--passes", "2"]
    return against_resident(device, steps, "float32", flags, FP32_LOSS_TOLERANCE)


def check_bf16_host_weights(device: torch.device, steps: int) -> tuple[bool, str]:
    """Weights on the host with their bfloat16 copies, which loads copy instead of masters."""
    flags = ["--placement", "resident", "--weights_placement", "host", "--passes", "2"]
    return against_resident(device, steps, "bfloat16", flags, BF16_LOSS_TOLERANCE)


def check_gpu_matches_cpu(device: torch.device, steps: int) -> tuple[bool, str]:
    """float32 remote placement: the GPU's losses are the CPU's."""
    gpu_config = small_config("--device", "cuda", "--placement", "remote")
    batches = batches_for(gpu_config, steps)
    gpu = losses(gpu_config, ParallelLayout.single(device), batches)
    cpu_config = small_config("--device", "cpu", "--placement", "remote")
    cpu = losses(cpu_config, ParallelLayout.single(torch.device("cpu")), batches)
    return compare(gpu, cpu, FP32_LOSS_TOLERANCE)


def check_nccl_world_of_one(device: torch.device, steps: int) -> tuple[bool, str]:
    """NCCL process group of one rank, the built layout, a step, and the collectives.

    A world of one builds size-1 axes whose collectives are no-ops, so the flat collectives the
    engine uses (the same torch functions as execution/layout.py) are also called on the world.
    """
    store = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "store")
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device
    )
    try:
        layout = ParallelLayout.build(1, 1, 1, device)
        config = small_config("--precision", "bfloat16", "--device", "cuda")
        batches = batches_for(config, steps)
        built = losses(config, layout, batches)
        single = losses(config, ParallelLayout.single(device), batches)
        ok, detail = compare(built, single, BF16_LOSS_TOLERANCE)

        x = torch.arange(8, dtype=torch.float32, device=device)
        summed = x.clone()
        dist.all_reduce(summed)
        gathered = torch.empty_like(x)
        _all_gather_flat(gathered, x)
        scattered = torch.empty_like(x)
        _reduce_scatter_flat(scattered, x)
        torch.cuda.synchronize(device)
        collectives = all(torch.equal(t, x) for t in (summed, gathered, scattered))
        backend = dist.get_backend()
        return ok and collectives and backend == "nccl", (
            f"backend {backend}, collectives {'ok' if collectives else 'WRONG'}; "
            f"built layout vs single: {detail}"
        )
    finally:
        dist.destroy_process_group()


def check_pinned_prefetch(device: torch.device, steps: int) -> tuple[bool, str]:
    config = small_config("--device", "cuda")
    plain = sample_loader(config)
    with PrefetchingLoader(sample_loader(config), pin_memory=True) as prefetched:
        got = [prefetched.next_batch() for _ in range(steps)]
    same = all(torch.equal(b, plain.next_batch()) for b in got)
    pinned = all(b.is_pinned() for b in got)
    return same and pinned, f"{steps} batches, pinned {pinned}, equal to the plain loader {same}"


def check_attention_op(device: torch.device, steps: int) -> tuple[bool, str]:
    """Attention with dropout as one op of a compiled block
    (execution/engine/phases/seeded_attention.py), called as it is and inside a compiled
    graph: eager's output bit for bit and its gradients within rounding, for each kernel the
    engine pins on this device (the engine checks its own shape too, and breaks the graph
    instead)."""
    cases = [("math", torch.float32, 64)]
    if device.type == "cuda":
        cases = [("flash", torch.bfloat16, 128), ("efficient", torch.float32, 64)]
    details, ok = [], True
    for kernel, dtype, head_dim in cases:
        compiles = compile_unavailable(device.type) is None
        reason = attention_op_mismatch(device, dtype, 16, head_dim, kernel, compiled=compiles)
        ok &= reason is None
        details.append(f"{kernel} in {str(dtype).removeprefix('torch.')}: {reason or 'as eager'}")
    return ok, "; ".join(details)


def check_attention_kernels(device: torch.device, steps: int) -> tuple[bool, str]:
    """The engine's check of each fused attention kernel (the CPU's kernels on a CPU), at
    gpt3_1.3B's call in bfloat16 (16 heads of 128 over 2048 tokens) with dropout 0 and 0.1,
    and the memory-efficient kernel in float32: which pass, and why the others do not."""
    heads, head_dim, sequence = (16, 128, 2048) if device.type == "cuda" else (2, 16, 64)
    kernels = CUDA_KERNELS if device.type == "cuda" else ("cpu_flash", "math")
    ran_before = {("flash", torch.bfloat16), ("efficient", torch.float32)}
    cases = [(k, torch.bfloat16, p) for k in kernels for p in (0.0, 0.1)]
    cases.append(("efficient" if device.type == "cuda" else "math", torch.float32, 0.1))
    details, ok = [], True
    for kernel, dtype, dropout in cases:
        if device.type != "cuda" and (kernel == "math") != bool(dropout):
            continue  # a CPU runs its fused kernel without dropout, the math path with
        reason = kernel_mismatch(device, dtype, heads, head_dim, sequence, kernel, dropout)
        if device.type == "cuda" and (kernel, dtype) in ran_before:
            ok &= reason is None
        name = f"{kernel} {str(dtype).removeprefix('torch.')} p={dropout:g}"
        details.append(f"{name}: {reason or 'passes'}")
    if device.type == "cuda":
        details.insert(0, f"cuDNN {torch.backends.cudnn.version()}")
    return ok, "; ".join(details)


Check = Callable[[torch.device, int], tuple[bool, str]]
CHECKS: dict[str, Check] = {
    "remote vs resident (bf16)": check_placements,
    "host activations (float32)": check_host_activations,
    "host gradients (float32)": check_host_gradients,
    "bf16 host weights": check_bf16_host_weights,
    "GPU vs CPU (float32)": check_gpu_matches_cpu,
    "NCCL world of one": check_nccl_world_of_one,
    "pinned prefetch": check_pinned_prefetch,
    "attention's dropout as one op": check_attention_op,
    "attention kernels' checks": check_attention_kernels,
}
# What a CPU cannot check: a second device to compare with, NCCL, pinned memory.
CUDA_ONLY = ("GPU vs CPU (float32)", "NCCL world of one", "pinned prefetch")


def run_checks(
    device: torch.device,
    steps: int,
    extra_flags: Sequence[str] = (),
    names: Sequence[str] | None = None,
    record: Path | None = None,
) -> list[dict]:
    """Runs every check of ``names`` (default: all) that ``device`` can run, printing one line
    each: name, ok, detail, seconds; appends each result to ``record`` (JSON lines) as it ends.

    A check that raises is a failed check; the others still run. On a CPU, :data:`CUDA_ONLY`
    are skipped (``ok`` None). ``extra_flags`` shrink (or change) every check's model further.
    """
    global SMALL
    small, SMALL = SMALL, [*SMALL, *extra_flags]
    try:
        return _run_checks(device, steps, names or list(CHECKS), record)
    finally:
        SMALL = small


def _run_checks(
    device: torch.device, steps: int, names: Sequence[str], record: Path | None
) -> list[dict]:
    results = []
    for name in names:
        started, poisoned = time.perf_counter(), False
        if device.type != "cuda" and name in CUDA_ONLY:
            ok, detail = None, "skipped: needs CUDA"
        else:
            try:
                ok, detail = CHECKS[name](device, steps)
            except Exception as err:
                traceback.print_exc()
                ok, detail = False, f"{type(err).__name__}: {err}"
                poisoned = device.type == "cuda" and _sticky_cuda_error(err)
        seconds = time.perf_counter() - started
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        print(f"{verdict}  {name:<32} {detail} ({seconds:.0f} s)", flush=True)
        result = {"check": name, "ok": ok, "detail": detail, "seconds": seconds}
        results.append(result)
        if record is not None:
            append_json_line(record, result)
        if poisoned and record is not None:
            # Every later CUDA call of this process would fail the same way: end it, and let
            # the caller run the remaining checks in a fresh one.
            sys.stdout.flush()
            os._exit(CUDA_POISONED_EXIT)
    return results


def _sticky_cuda_error(err: Exception) -> bool:
    """A CUDA error that leaves the process's context unusable (an illegal access, a launch
    failure), as opposed to a wrong number or an out-of-memory error it can go on after."""
    sticky = getattr(torch, "AcceleratorError", ())  # torch >= 2.9 raises these as such
    text = str(err)
    return (sticky and isinstance(err, sticky)) or (
        "CUDA error" in text and "out of memory" not in text
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per comparison")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="a smaller model still (tests)")
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), help="run only these")
    parser.add_argument("--json", type=Path, help="append each result here as it ends")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    if args.json:
        check_output_file("--json", args.json)
    if args.device == "cpu":
        device = torch.device("cpu")
        print(f"gpu_check on the CPU (the checks that need CUDA are skipped), {torch.__version__}")
    elif not torch.cuda.is_available():
        print(
            "gpu_check: needs a CUDA GPU and none is available; nothing was checked "
            "(--device cpu runs the checks a CPU can run).",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        print(f"gpu_check on {name}, {versions}, NCCL {torch.cuda.nccl.version()}")
    extra = QUICK if args.quick else ()
    results = [r["ok"] for r in run_checks(device, args.steps, extra, args.checks, args.json)]
    failed = results.count(False)
    total = len(results)
    verdict = f"{failed} of {total} checks FAILED" if failed else f"all {total} checks passed"
    print(f"verdict: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    exit_on_bad_input(lambda: sys.exit(main()), "benchmarks.gpu_check")

"""Checks to run by hand on a CUDA machine (CI has no GPU): correctness of the GPU paths.

    python benchmarks/gpu_check.py [--steps 4]

1. Phased (remote placement, host buffers) and resident placement give the same losses on the
   GPU within a bfloat16 tolerance, and in float32 the GPU's losses match the CPU's. Each state
   on the host alone gives resident's losses too: activations and gradients in float32 (where a
   copy that runs late shows as a different loss), bfloat16 weight copies on the host within
   the bfloat16 tolerance; two passes, so that every layer is loaded and stored twice a step.
2. The NCCL path works for a world of one: a process group from a file:// store,
   ``ParallelLayout.build(1, 1, 1, device)``, a training step with the same loss as the
   single-process layout, and the collectives the engine uses (all-reduce, all-gather,
   reduce-scatter) on the world group.
3. The prefetching loader hands out pinned batches.
4. ``bench_step.py --compare`` runs every row (FSDP2 with CPU offload included) and the PyTorch
   baselines' first loss equals ours in float32.

Prints one line per check and a verdict; exits 1 if any check fails. Without CUDA it says so
and exits 0 (nothing to check), so it can sit in scripts that also run on CPU machines.
:func:`run_checks` runs the checks that need no GPU on a CPU too (gpu_first_run.py --device
cpu), and skips the others.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from config.loading import parse_config
from config.schema import PretrainingConfig
from data.loader import PretrainingDataLoader, training_loader
from data.prefetch import PrefetchingLoader
from execution.engine.optimizer import learning_rate
from execution.parallel.mesh import ParallelLayout, _all_gather_flat, _reduce_scatter_flat
from execution.planning.planner import planned_engine

NO_GPU_EXIT = 0  # "nothing to check" is not a failure
BF16_LOSS_TOLERANCE = 2e-2  # absolute, on losses near ln(50257) = 10.8 (bf16 has 8 bits)
FP32_LOSS_TOLERANCE = 1e-4

SMALL = shlex.split(
    "--config tiny --layers 2 --hidden_size 64 --heads 4 --sequence_length 64 "
    "--max_positional_length 64 --global_batch_size 8 --micro_batch_size 2 --dropout_prob 0"
)


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


def losses(config: PretrainingConfig, layout: ParallelLayout, batches) -> list[float]:
    engine = planned_engine(config, layout)
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
    """Losses of the run with ``flags`` against the same run with every state resident."""
    common = ["--precision", precision, "--device", device.type]
    config = small_config(*common, *flags)
    placed = losses(config, ParallelLayout.single(device), batches_for(config, steps))
    resident = resident_losses((*SMALL, *common), device, steps)
    ok, detail = compare(placed, resident, tolerance)
    return ok, f"{detail}; {placed[0]:.4f} -> {placed[-1]:.4f}"


def check_placements(device: torch.device, steps: int) -> tuple[bool, str]:
    """Remote (phased, host buffers) vs resident, bfloat16."""
    return against_resident(device, steps, "bfloat16", [], BF16_LOSS_TOLERANCE)


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
    gpu_config = small_config("--device", "cuda")
    batches = batches_for(gpu_config, steps)
    gpu = losses(gpu_config, ParallelLayout.single(device), batches)
    cpu_config = small_config("--device", "cpu")
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


def check_bench(device: torch.device, steps: int) -> tuple[bool, str]:
    import bench_step

    rows = bench_step.main([*SMALL, "--device", "cuda", "--steps", "2", "--compare"])
    missing = [r["variant"] for r in rows if "tokens_per_s" not in r]
    ours = rows[0]["first_loss"]
    worst = max(abs(r["first_loss"] - ours) for r in rows if "first_loss" in r)
    profiled = all(r["gpu_idle"] is not None for r in rows if "tokens_per_s" in r)
    ok = not missing and worst <= FP32_LOSS_TOLERANCE and profiled
    return ok, (
        f"{len(rows)} rows, not run: {missing or 'none'}; max |first loss - ours| {worst:.1e}; "
        f"profiled {profiled}"
    )


Check = Callable[[torch.device, int], tuple[bool, str]]
CHECKS: dict[str, Check] = {
    "remote vs resident (bf16)": check_placements,
    "host activations (float32)": check_host_activations,
    "host gradients (float32)": check_host_gradients,
    "bf16 host weights": check_bf16_host_weights,
    "GPU vs CPU (float32)": check_gpu_matches_cpu,
    "NCCL world of one": check_nccl_world_of_one,
    "pinned prefetch": check_pinned_prefetch,
    "bench_step --compare": check_bench,
}
# What a CPU cannot check: a second device to compare with, NCCL, pinned memory, FSDP2.
CUDA_ONLY = ("GPU vs CPU (float32)", "NCCL world of one", "pinned prefetch", "bench_step --compare")


def run_checks(device: torch.device, steps: int, extra_flags: Sequence[str] = ()) -> list[dict]:
    """Runs every check ``device`` can run, printing one line each: name, ok, detail, seconds.

    A crash is a failed check; the others still run. On a CPU, :data:`CUDA_ONLY` are skipped
    (``ok`` None). ``extra_flags`` shrink (or change) every check's model further.
    """
    global SMALL
    small, SMALL = SMALL, [*SMALL, *extra_flags]
    try:
        return _run_checks(device, steps)
    finally:
        SMALL = small


def _run_checks(device: torch.device, steps: int) -> list[dict]:
    results = []
    for name, check in CHECKS.items():
        started = time.perf_counter()
        if device.type != "cuda" and name in CUDA_ONLY:
            ok, detail = None, "skipped: needs CUDA"
        else:
            try:
                ok, detail = check(device, steps)
            except Exception as err:
                traceback.print_exc()
                ok, detail = False, f"{type(err).__name__}: {err}"
        seconds = time.perf_counter() - started
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        print(f"{verdict}  {name:<32} {detail} ({seconds:.0f} s)", flush=True)
        results.append({"check": name, "ok": ok, "detail": detail, "seconds": seconds})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per comparison")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU and none is available; nothing was checked.")
        return NO_GPU_EXIT
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(f"gpu_check on {name}, {versions}, NCCL {torch.cuda.nccl.version()}")
    results = [r["ok"] for r in run_checks(device, args.steps)]
    failed = results.count(False)
    total = len(results)
    verdict = f"{failed} of {total} checks FAILED" if failed else f"all {total} checks passed"
    print(f"verdict: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time, throughput, memory and transfer rates of a preset, against plain PyTorch and FSDP2.

    python benchmarks/bench_step.py --config tiny --steps 5 [any run_pretraining.py flag ...]
    python benchmarks/bench_step.py --config gpt3_1.3B --steps 5 --compare --json out.json

Every variant trains on the same token batches (read once from the project's data loader, the
shipped sample data by default; data loading is not timed), from the same initial weights. The
first ``--warmup`` steps are not timed; the table shows medians over ``--steps`` steps. On CUDA
two more steps run under torch.profiler (one to warm it up, one recorded) for the host<->device
copy rates and the share of the step with no kernel running (the profiler slows the recorded
step a little; its figures are rates and shares, not times).

Rows of ``--compare`` (tokens/s ratio to the first row):

- our engine with each entry of :data:`OUR_VARIANTS` (extra flags for ``parse_config``);
- a plain PyTorch loop: the single-device :class:`modelling.gpt.GPT` resident on the device,
  per-layer activation checkpointing, gradient accumulation over the same micro-batches,
  ``clip_grad_norm_`` and ``torch.optim.AdamW`` (fused on CUDA) with the same hyper-parameters
  and weight-decay grouping (none on biases and layer norms); autocast for 16-bit precisions;
- PyTorch FSDP2 (``fully_shard`` per layer and at the root, ``CPUOffloadPolicy``) on a world of
  one, CUDA only.

On a CPU, MFU, host<->device rates and GPU idle share are "-" (no known peak, no transfers), and
"peak mem" is the process's peak resident set size while the variant ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_report import format_table, peak_memory, proc_status_bytes, reset_peak_memory

from config.loading import parse_config
from config.schema import PretrainingConfig
from data.loader import training_loader
from execution.engine.buffers import DTYPES
from execution.engine.optimizer import adamw_, adamw_threaded_, learning_rate
from execution.parallel.launch import select_device
from execution.parallel.mesh import ParallelLayout
from execution.parallel.sharding import shard_part
from execution.planning.planner import planned_engine
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, GPTShapes, init_full_part
from modelling.layers import BlockSeeds, mix_seed
from utils.metrics import device_peak_tflops, flops_per_token, throughput

# Our engine's rows: the planner's choice, and the same run with the weights (and their AdamW
# moments) forced to stream from host memory every phase.
OUR_VARIANTS: dict[str, list[str]] = {
    "ours (auto plan)": ["--placement", "auto"],
    "ours, weights streamed": ["--weights_placement", "host"],
    # The schedule before issue 16: every collective waited for, every layer recomputed.
    "ours, no overlap, full recompute": ["--overlap_communication", "false", "--recompute", "full"],
}
PLAIN_LOOP = "pytorch loop (ckpt, AdamW)"
FSDP2_OFFLOAD = "pytorch FSDP2 + CPU offload"

StepFn = Callable[[int], float]  # runs step i on batch i, returns its mean loss


# ---------------------------------------------------------------------------- profiler


def gpu_activity(events: list[dict], wall_seconds: float) -> dict[str, float | None]:
    """Copy rates and idle share of one profiled step from a Kineto (chrome) trace's events.

    Args:
        events: ``traceEvents`` of ``torch.profiler.profile.export_chrome_trace``.
        wall_seconds: Wall time of the profiled step.

    Returns:
        ``h2d_GBps`` / ``d2h_GBps``: bytes copied / time spent copying in that direction (the
        link rate the copies achieved; None when none ran); ``h2d_GB`` / ``d2h_GB``: bytes per
        step; ``gpu_idle``: share of the wall time in which no kernel ran on any stream.
    """
    copied = {"HtoD": [0, 0.0], "DtoH": [0, 0.0]}  # bytes, microseconds
    kernels = []
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
    busy, end = 0.0, -math.inf
    for start, stop in sorted(kernels):  # length of the union of the kernel intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    out: dict[str, float | None] = {}
    for direction, key in (("HtoD", "h2d"), ("DtoH", "d2h")):
        nbytes, micros = copied[direction]
        out[f"{key}_GBps"] = nbytes / micros / 1e3 if nbytes and micros else None
        out[f"{key}_GB"] = nbytes / 1e9
    out["gpu_idle"] = max(0.0, 1.0 - busy / 1e6 / wall_seconds)
    return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step_fn: StepFn, step: int, device: torch.device) -> dict[str, float | None]:
    """Profiles step ``step + 1`` after a profiler warm-up on step ``step``; its GPU activity.

    The warm-up step keeps the profiler's start-up (CUPTI initialisation) out of the recorded
    step's wall time. Kernels are only recorded on CUDA; elsewhere the idle share comes out 1.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
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
            step_fn(step)
            prof.step()
            _synchronize(device)
            started = time.perf_counter()
            step_fn(step + 1)
            _synchronize(device)
            wall = time.perf_counter() - started
            prof.step()
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    return gpu_activity(events, wall)


# ---------------------------------------------------------------------------- variants


def our_engine(config: PretrainingConfig, device: torch.device, batches) -> StepFn:
    engine = planned_engine(config, ParallelLayout.single(device))
    t = config.training

    def step(i: int) -> float:
        lr = learning_rate(i, t.optimizer, config.tokens_per_step, t.steps)
        return engine.train_step(batches[i], i, lr).loss

    return step


class Checkpointed(nn.Module):
    """A decoder block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None = None) -> torch.Tensor:
        return checkpoint(self.block, x, seeds, use_reentrant=False)


def initial_model(config: PretrainingConfig) -> GPT:
    """The single-device GPT with our engine's initial weights, each layer checkpointed."""
    shapes = GPTShapes.from_config(config.model)
    model = GPT(shapes)
    seed, std = config.training.seed, config.model.init_std
    for part, module in ((EMBEDDING, model.embedding), (HEAD, model.head)):
        full = init_full_part(shapes, part, 0, seed, std)
        module.load_state_dict(shard_part(part, full, shapes, 0, 0))
    for n, layer in enumerate(model.layers):
        full = init_full_part(shapes, LAYERS, n, seed, std)
        layer.load_state_dict(shard_part(LAYERS, full, shapes, 0, 0))
    model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
    return model


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The project's grouping: decay matrices and embeddings (2-D), never biases or norms."""
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() == 2]
    others = [p for p in params if p.dim() != 2]
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": others, "weight_decay": 0.0},
    ]


def _dropout_seeds(config: PretrainingConfig, step: int, micro: int):
    """Dropout seeds per (step, micro-batch): the same dropout work as ours, not its masks."""
    if config.model.dropout_prob == 0.0:
        return {}
    base = (config.training.seed, step, micro)
    layers = [
        BlockSeeds(*(mix_seed(*base, n, k) for k in range(3))) for n in range(config.model.layers)
    ]
    return {"embedding_seed": mix_seed(*base, -1), "layer_seeds": layers}


def pytorch_loop(
    config: PretrainingConfig,
    device: torch.device,
    batches,
    model: nn.Module | None = None,
    autocast: bool = True,
    fused: bool | None = None,
) -> StepFn:
    """The textbook loop on ``model`` (default: :func:`initial_model` moved to ``device``).

    ``autocast`` runs the forward under ``torch.autocast`` in the run's 16-bit precision (off
    where the model casts its parameters itself, as FSDP2's mixed precision does). ``fused``
    picks torch's fused AdamW; by default on CUDA only, so that on a CPU the baseline's update
    is the textbook single-tensor one.
    """
    model = model if model is not None else initial_model(config).to(device)
    t, o = config.training, config.training.optimizer
    if fused is None:
        fused = device.type == "cuda"
    groups = _param_groups(model, o.weight_decay)
    fused_only = {"fused": True} if fused else {}  # leaves torch's own default otherwise
    optimizer = torch.optim.AdamW(
        groups, lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps, **fused_only
    )
    dtype, scale = DTYPES[t.precision], t.loss_scaling
    autocast = autocast and dtype != torch.float32
    clip = o.gradient_clipping if o.gradient_clipping > 0 else math.inf

    def step(i: int) -> float:
        tokens = batches[i].to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(i, o, config.tokens_per_step, t.steps)
        optimizer.zero_grad(set_to_none=True)
        accumulation, total = tokens.shape[0], torch.zeros((), device=device)
        for m in range(accumulation):
            with torch.autocast(device.type, dtype, enabled=autocast):
                loss = model(tokens[m, :, :-1], tokens[m, :, 1:], **_dropout_seeds(config, i, m))
            (loss * (scale / accumulation)).backward()
            total += loss.detach().float()
        if scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return total.item() / accumulation

    return step


def fsdp2_offload(config: PretrainingConfig, device: torch.device, batches) -> StepFn:
    """FSDP2 on a world of one: each layer and the root sharded, parameters offloaded to host.

    Parameters, gradients and AdamW state live in (pinned) host memory and the optimizer steps
    on the CPU (fused AdamW), as FSDP2's ``CPUOffloadPolicy`` prescribes; with 16-bit precision the layers
    compute in that dtype (``MixedPrecisionPolicy``), gradients are reduced in float32.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="bench_step_"), "store")  # a fresh file
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device
        )
    dtype = DTYPES[config.training.precision]
    policy = {"offload_policy": CPUOffloadPolicy()}
    if dtype != torch.float32:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    model = initial_model(config)
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    # The update runs on the host copies; torch's fused CPU AdamW is the fastest it offers.
    return pytorch_loop(config, device, batches, model, autocast=False, fused=True)


# ---------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """How many steps to run and on what: shared by every row of the table."""

    device: torch.device
    steps: int
    warmup: int


def measure(label: str, build: Callable[[], StepFn], config: PretrainingConfig, run: Run) -> dict:
    """Times ``run.steps`` steps after ``run.warmup`` untimed ones; memory; on CUDA, a profile."""
    device = run.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    step_fn = build()
    times, losses = [], []
    for i in range(run.warmup + run.steps):
        _synchronize(device)
        started = time.perf_counter()
        losses.append(step_fn(i))
        _synchronize(device)
        if i >= run.warmup:
            times.append(time.perf_counter() - started)
    row = {"variant": label, "device": str(device), "step_s": statistics.median(times)}
    row.update(first_loss=losses[0], last_loss=losses[-1])
    m = config.model
    rates = throughput(
        row["step_s"],
        config.training.global_batch_size,
        m.sequence_length,
        flops_per_token(GPTShapes.from_config(m), m.sequence_length),
        device_peak_tflops(device, config.execution.peak_tflops),
        devices=1,
    )
    row.update(tokens_per_s=rates["tokens_per_sec"], tflops=rates["tflops"], mfu=rates["mfu"])
    row["peak_mem_GiB"] = peak_memory(device) / 2**30
    row["host_rss_GiB"] = (proc_status_bytes("VmRSS") or 0) / 2**30 or None
    if device.type == "cuda":
        row.update(profile_step(step_fn, run.warmup + run.steps, device))
    else:  # no copies to time and no kernels to count
        row.update(dict.fromkeys(("h2d_GBps", "d2h_GBps", "h2d_GB", "d2h_GB", "gpu_idle")))
    return row


def read_batches(config: PretrainingConfig, count: int) -> list[torch.Tensor]:
    loader = training_loader(config, dp_rank=0, dp_size=1)
    return [loader.next_batch() for _ in range(count)]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="preset of config/pretraining.yml")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--compare", action="store_true", help="add the PyTorch baselines")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    adamw_help = "time host AdamW implementations on a flat vector this long (0 skips)"
    parser.add_argument("--adamw_elements", type=int, default=1 << 24, help=adamw_help)
    args, extra = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    flags = ["--config", args.config, *extra]
    ours = OUR_VARIANTS if args.compare else {"ours": []}
    base, _ = parse_config(flags)
    device = select_device(base.execution.device, 0, 1)
    batches = read_batches(base, args.warmup + args.steps + 2)  # + 2: the profiled steps

    run = Run(device, args.steps, args.warmup)
    rows = []
    for label, variant_flags in ours.items():
        config, _ = parse_config([*flags, *variant_flags])
        rows.append(measure(label, lambda c=config: our_engine(c, device, batches), config, run))
    if args.compare:
        rows.append(measure(PLAIN_LOOP, lambda: pytorch_loop(base, device, batches), base, run))
        if device.type == "cuda":
            build = lambda: fsdp2_offload(base, device, batches)  # noqa: E731
            rows.append(measure(FSDP2_OFFLOAD, build, base, run))
        else:
            reason = "needs CUDA (its offload moves state between host and GPU)"
            rows.append({"variant": FSDP2_OFFLOAD, "skipped": reason})
    for row in rows:
        if "tokens_per_s" in row:
            row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]

    print(
        f"preset {' '.join([args.config, *extra])} on {device}: {base.tokens_per_step:,} tokens "
        f"per step, {base.training.precision}, gradient accumulation "
        f"{base.gradient_accumulation}; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(format_table(rows))
    if args.adamw_elements > 0:
        print(host_adamw_line(args.adamw_elements, base))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def host_adamw_line(elements: int, config: PretrainingConfig, repeats: int = 3) -> str:
    """Median time of one host AdamW update of ``elements`` floats: plain vs chunked threads."""
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(elements, generator=g), torch.randn(elements, generator=g)
    exp_avg, exp_avg_sq = torch.zeros(elements), torch.zeros(elements)
    hyper = dict(
        step=1, lr=1e-4, optim=config.training.optimizer, weight_decay=True, grad_scale=0.5
    )
    threads = os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:
        timed = {}
        updates = {"adamw_": adamw_, "adamw_threaded_": partial(adamw_threaded_, pool=pool)}
        for name, update in updates.items():
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                update(weight, grad, exp_avg, exp_avg_sq, **hyper)
                seconds.append(time.perf_counter() - started)
            timed[name] = statistics.median(seconds)
    plain, threaded = timed["adamw_"], timed["adamw_threaded_"]
    plain_part = f"adamw_ {plain * 1e3:.1f} ms"
    threaded_part = f"adamw_threaded_ ({threads} threads) {threaded * 1e3:.1f} ms"
    speedup = f"{plain / threaded:.2f}x"
    return f"host AdamW on {elements:,} float32: {plain_part}, {threaded_part}: {speedup}"


if __name__ == "__main__":
    main()

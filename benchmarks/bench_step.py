"""Step time, throughput, memory and transfer rates of a preset, against plain PyTorch and FSDP2.

    python -m benchmarks.bench_step --config tiny --steps 5 [any run_pretraining.py flag ...]
    python -m benchmarks.bench_step --config gpt3_1.3B --steps 5 --compare --json out.json
    python -m benchmarks.bench_step --config gpt3_6.7B --rows streamed fsdp2 --json out.json

Every variant trains on the same token batches (read from the project's data loader, the
shipped sample data by default; data loading is not timed), from the same initial weights. The
first ``--warmup`` steps are not timed; the table shows medians over ``--steps`` steps. On CUDA
two more steps run under torch.profiler (one to warm it up, one recorded) for the host<->device
copy rates and the share of the step with no kernel running (the profiler slows the recorded
step a little; its figures are rates and shares, not times); ``--no_profile`` skips them.

Each row runs in a process of its own, so that one row's out-of-memory error (or its pinned
buffers and host memory) cannot take or skew the others: a row that fails is recorded as
``error`` ("out of memory: ..."), the others still run, and ``--json`` is rewritten after every
row. ``--in_process`` runs every row in this process instead (a same-process comparison, where
memory allows).

Rows (``--rows``; tokens/s ratio to the first row), :data:`VARIANTS`; ``--compare`` runs
:data:`COMPARE`:

- our engine with extra flags for ``parse_config``;
- a plain PyTorch loop: the single-device :class:`modelling.gpt.GPT` resident on the device,
  per-layer activation checkpointing (none with ``--recompute none``), gradient accumulation
  over the same micro-batches, ``clip_grad_norm_`` and ``torch.optim.AdamW`` (fused on CUDA)
  with the same hyper-parameters and weight-decay grouping; autocast for 16-bit precisions;
- PyTorch FSDP2 (``fully_shard`` per layer and at the root, ``CPUOffloadPolicy``) on a world of
  one, CUDA only (baselines.py).

On a CPU, MFU, host<->device rates and GPU idle share are "-" (no known peak, no transfers), and
"peak mem" is the process's peak resident set size while the variant ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.baselines import (
    FSDP2_OFFLOAD,
    StepFn,
    fsdp2_offload,
    plain_loop_label,
    pytorch_loop,
)
from benchmarks.bench_profile import gpu_activity, profile_step, synchronize
from benchmarks.bench_report import (
    format_table,
    host_adamw_line,
    peak_memory,
    proc_status_bytes,
    reset_peak_memory,
)
from benchmarks.child_process import append_json_line, read_json_lines, run_child
from benchmarks.idle_gaps import (
    PhaseClock,
    format_clock,
    format_gaps,
    format_update_behind,
    profile_idle,
)
from config.command_line import check_output_file, exit_on_bad_input
from config.loading import OneLineParser, parse_config
from config.schema import PretrainingConfig
from data.loader import training_loader
from execution.engine.engine import PhasedEngine, StepHooks
from execution.parallel.launch import select_device
from execution.parallel.mesh import ParallelLayout
from execution.planning.memory import cap_device_memory
from execution.planning.planner import plan_for_process
from execution.planning.run_shape import RunShape
from execution.training.lr_schedule import learning_rate
from modelling.gpt import GPTShapes
from utils.metrics import (
    attention_flops_per_token,
    device_peak_tflops,
    flops_per_token,
    throughput,
)


@dataclass(frozen=True)
class Variant:
    """One row: whose step (``ours``, ``plain``, ``fsdp2``) with which extra flags."""

    label: str
    kind: str
    flags: tuple[str, ...] = ()


VARIANTS = {
    "ours": Variant("ours", "ours"),
    # The planner's choice, and the same run with the weights (and their AdamW moments) forced
    # to stream from host memory every phase.
    "auto": Variant("ours (auto plan)", "ours", ("--placement", "auto")),
    "streamed": Variant("ours, weights streamed", "ours", ("--weights_placement", "host")),
    # The engine with nothing behind compute: every collective waited for where issued, every
    # layer recomputed.
    "no_overlap": Variant(
        "ours, no overlap, full recompute",
        "ours",
        ("--overlap_communication", "false", "--recompute", "full"),
    ),
    "resident": Variant("ours, resident", "ours", ("--placement", "resident")),
    # Ours with the parts eager whatever --compile says (the plain loop follows --compile).
    "eager": Variant("ours, eager", "ours", ("--compile", "false")),
    "plain": Variant("pytorch loop", "plain"),  # labelled by plain_loop_label
    "fsdp2": Variant(FSDP2_OFFLOAD, "fsdp2"),
}
COMPARE = ("auto", "streamed", "no_overlap", "plain", "fsdp2")
# The training state a parameter costs wherever it lives (activations and working sets aside):
# its weights, 16-bit copies, gradient accumulators and AdamW moments.
STATE_KEYS = ("weights", "weight_copies", "grads", "optimizer")
FSDP2_NEEDS_CUDA = "needs CUDA (its offload moves state between host and GPU)"
# What a row's process runs with on CUDA: the allocator maps segments that grow in place, so
# the phases' changing working sets fragment less (and the row says it ran so).
ROW_ALLOCATOR = "expandable_segments:True"
__all__ = ["gpu_activity", "profile_step"]  # re-exported: a row's profile is part of its run


def row_label(key: str, config: PretrainingConfig) -> str:
    return plain_loop_label(config) if VARIANTS[key].kind == "plain" else VARIANTS[key].label


# ---------------------------------------------------------------------------- variants


def our_engine(config: PretrainingConfig, device: torch.device, batches) -> StepFn:
    """Our engine under the planner's choice; the step function carries the plan it ran
    (``step.plan``: passes, placements, recompute, micro-batch and the budget planned
    against)."""
    layout = ParallelLayout.single(device)
    run = RunShape.of(config)
    memory, budget = plan_for_process(run, layout)
    engine = PhasedEngine(run.engine_plan(memory), layout)
    t = config.training

    def step(i: int, on_phase=None) -> float:
        lr = learning_rate(i, t.optimizer, config.tokens_per_step, t.steps)
        return engine.train_step(batches[i], i, lr, StepHooks(on_phase=on_phase)).loss

    state = sum(memory.state_bytes.get(k, 0) for k in STATE_KEYS)
    step.state_bytes_per_param = state / GPTShapes.from_config(config.model).num_parameters
    step.setup_s = engine.setup_seconds  # buffers (host pages registered) and weights drawn
    # The host update that ran behind the step just taken, row by row (None: none ran).
    step.update_behind = lambda: engine.optimizer.behind
    step.attention = engine.attention.record()  # its kernel, and faster ones passed over
    step.plan = {
        "passes": memory.passes,
        "micro_batches_per_pass": memory.micro_batches_per_pass,
        "micro_batch_size": config.execution.micro_batch_size,
        "gradient_accumulation": config.gradient_accumulation,
        "placement": dataclasses.asdict(memory.placement),
        "recompute": memory.recompute,
        "planned_device_GiB": memory.bytes_on("device")["total"] / 2**30,
        "budget_device_GiB": None if budget.device is None else budget.device / 2**30,
        "budget_host_GiB": budget.host / 2**30,
    }
    return step


# ---------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """How many steps to run and on what: shared by every row of the table."""

    device: torch.device
    steps: int
    warmup: int
    profile: bool = True
    progress: Path | None = None  # each step's time is appended here as it ends
    # Ours: the last timed step clocks its phases; on CUDA two more steps split its idle time.
    idle_gaps: bool = False


def measure(label: str, build, config: PretrainingConfig, run: Run) -> dict:
    """Times ``run.steps`` steps after ``run.warmup`` untimed ones; memory; on CUDA, a profile."""
    device = run.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    started = time.perf_counter()
    step_fn: StepFn = build()
    if run.progress is not None:  # what survives a row killed by its time limit
        append_json_line(run.progress, {"built_s": time.perf_counter() - started})
    times, losses, every = [], [], []
    ours = getattr(step_fn, "plan", None) is not None
    clock = PhaseClock(device) if run.idle_gaps and ours else None
    behind = None  # the host update behind the clocked step, where one ran
    for i in range(run.warmup + run.steps):
        synchronize(device)
        started = time.perf_counter()
        if clock is not None and i == run.warmup + run.steps - 1:
            losses.append(step_fn(i, on_phase=clock))
            clock.stop()
            behind = step_fn.update_behind()
        else:
            losses.append(step_fn(i))
        synchronize(device)
        seconds = time.perf_counter() - started
        every.append(seconds)
        if i >= run.warmup:
            times.append(seconds)
        if run.progress is not None:
            append_json_line(run.progress, {"step": i, "seconds": seconds, "loss": losses[-1]})
    row = {"variant": label, "device": str(device), "pid": os.getpid()}
    if ours:
        row["plan"] = step_fn.plan
        row["setup_s"] = step_fn.setup_s
        row["attention_kernel"] = step_fn.attention
    row["state_bytes_per_param"] = getattr(step_fn, "state_bytes_per_param", None)
    row["device_cap_GiB"] = config.execution.device_memory_cap_gb or None
    row["tokens_per_step"] = config.tokens_per_step
    row["step_s"] = statistics.median(times)
    row["each_step_s"] = every  # warm-up included: the first step compiles
    if clock is not None:
        row["phase_clock"] = clock.seconds()
        if behind is not None:
            row["update_behind"] = behind
    row.update(first_loss=losses[0], last_loss=losses[-1])
    m, shapes = config.model, GPTShapes.from_config(config.model)
    full = flops_per_token(shapes, m.sequence_length)
    rates = throughput(
        row["step_s"],
        config.training.global_batch_size,
        m.sequence_length,
        full,
        device_peak_tflops(device, config.execution.peak_tflops),
        devices=1,
    )
    row.update(tokens_per_s=rates["tokens_per_sec"], tflops=rates["tflops"], mfu=rates["mfu"])
    # MFU's other convention: attention's causal half of the [S, S] square, as FlashAttention's
    # benchmarks and the published leader count it.
    causal = full - attention_flops_per_token(shapes, m.sequence_length) / 2
    row["mfu_causal"] = None if rates["mfu"] is None else rates["mfu"] * causal / full
    row["peak_mem_GiB"] = peak_memory(device) / 2**30
    if device.type == "cuda":
        row["peak_reserved_GiB"] = torch.cuda.max_memory_reserved(device) / 2**30
        row["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    row["host_rss_GiB"] = (proc_status_bytes("VmRSS") or 0) / 2**30 or None
    # The process's peak since it started (on a CPU, since this row's reset): its set-up too.
    row["host_peak_GiB"] = (proc_status_bytes("VmHWM") or 0) / 2**30 or None
    if device.type == "cuda" and run.profile:
        row.update(profile_step(step_fn, run.warmup + run.steps, device))
        if run.idle_gaps and ours:
            row["idle_gaps"] = profile_idle(step_fn, run.warmup + run.steps + 2, device)
    else:  # no copies to time and no kernels to count
        row.update(dict.fromkeys(("h2d_GBps", "d2h_GBps", "h2d_GB", "d2h_GB", "gpu_idle")))
    return row


def read_batches(config: PretrainingConfig, count: int) -> list[torch.Tensor]:
    loader = training_loader(config, dp_rank=0, dp_size=1)
    return [loader.next_batch() for _ in range(count)]


def out_of_memory(err: BaseException) -> bool:
    """CUDA's allocator error, or the CPU allocator's (a RuntimeError naming the failure)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def one_line(err: BaseException, limit: int = 300) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return first[:limit]


def measure_row(key: str, flags: list[str], run_args: argparse.Namespace) -> dict:
    """Row ``key`` measured in this process; an out-of-memory error becomes the row's result."""
    config, _ = parse_config([*flags, *VARIANTS[key].flags])
    label = row_label(key, config)
    device = select_device(config.execution.device, 0, 1)
    kind = VARIANTS[key].kind
    if kind == "fsdp2" and device.type != "cuda":
        return {"variant": label, "skipped": FSDP2_NEEDS_CUDA}
    progress = getattr(run_args, "progress", None)
    run = Run(device, run_args.steps, run_args.warmup, not run_args.no_profile, progress)
    run.idle_gaps = getattr(run_args, "idle_gaps", False)
    batches = read_batches(config, run.warmup + run.steps + 4)  # + 4: the profiled steps
    build = {"ours": our_engine, "plain": pytorch_loop, "fsdp2": fsdp2_offload}[kind]
    if kind != "ours":  # ours is capped by its planning (plan_for_process)
        cap_device_memory(RunShape.of(config), device)
    try:
        return measure(label, lambda: build(config, device, batches), config, run)
    except Exception as err:
        if not out_of_memory(err):
            raise
        # A baseline that keeps every activation may need recompute where ours does not.
        keeps = kind != "ours" and config.execution.recompute == "none"
        why = " at --recompute none (it needs recompute to fit)" if keeps else ""
        error = f"out of memory{why}: {one_line(err)}"
        return {"variant": label, "device": str(device), "error": error}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if torch.distributed.is_initialized():  # FSDP2's group of one: not left to exit
            torch.distributed.destroy_process_group()


def run_row(
    key: str,
    flags: list[str],
    run_args: argparse.Namespace,
    timeout: float | None,
    env: dict[str, str] | None = None,
) -> dict:
    """Row ``key`` measured by a fresh ``bench_step.py`` process; its failure is its result.

    The process runs the row with ``--in_process`` and writes it to a file of its own, and
    each step's time to a progress file as it ends. If it dies before writing (killed by the
    kernel's OOM killer, a crash, ``timeout`` seconds passed), the row says so in one line and
    keeps the steps that did end (``progress``) and the end of its output (``output_tail``).
    On CUDA the process allocates with :data:`ROW_ALLOCATOR`; ``env`` adds to its environment.
    """
    config, _ = parse_config([*flags, *VARIANTS[key].flags])
    label = row_label(key, config)
    with tempfile.TemporaryDirectory(prefix="bench_row_") as tmp:
        out, progress = Path(tmp) / "row.json", Path(tmp) / "progress.jsonl"
        steps = ["--steps", str(run_args.steps), "--warmup", str(run_args.warmup)]
        mode = ["--rows", key, "--in_process", "--adamw_elements", "0", "--json", str(out)]
        command = [
            sys.executable,
            "-m",
            "benchmarks.bench_step",
            *mode,
            *steps,
            "--progress",
            str(progress),
            *flags,
        ]
        if run_args.no_profile:
            command.append("--no_profile")
        if getattr(run_args, "idle_gaps", False):
            command.append("--idle_gaps")
        done = run_child(
            command, timeout, {"PYTORCH_CUDA_ALLOC_CONF": ROW_ALLOCATOR, **(env or {})}
        )
        if out.exists():  # written once the row ended: whatever its exit (teardown) did
            return json.loads(out.read_text())[0]
        print(done.output, file=sys.stderr)  # the whole story, for the log
        last = done.last_line()
        if done.timed_out:
            error = f"timed out after {timeout:.0f} s: {last}"
        elif done.returncode < 0:
            signal = -done.returncode
            error = f"killed by signal {signal} (the OOM killer, if host memory ran out): {last}"
        elif "out of memory" in last.lower():
            error = f"out of memory: {last}"
        else:
            error = f"failed: exit code {done.returncode}: {last}"
        ended = read_json_lines(progress)
        return {"variant": label, "error": error, "progress": ended, "output_tail": done.tail}


def add_ratios(rows: list[dict]) -> None:
    """tokens/s of every measured row against the first measured one."""
    measured = [row for row in rows if "tokens_per_s" in row]
    for row in measured:
        row["ratio"] = row["tokens_per_s"] / measured[0]["tokens_per_s"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="preset of config/pretraining.yml")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--compare", action="store_true", help=f"rows {' '.join(COMPARE)}")
    parser.add_argument("--rows", nargs="+", choices=sorted(VARIANTS), help="rows to run")
    parser.add_argument("--in_process", action="store_true", help="all rows in this process")
    parser.add_argument("--row_timeout", type=float, help="seconds a row's process may take")
    parser.add_argument("--no_profile", action="store_true", help="skip the profiled steps")
    gaps_help = "clock our rows' phases; on CUDA, split their idle time by phase and host op"
    parser.add_argument("--idle_gaps", action="store_true", help=gaps_help)
    parser.add_argument("--json", help="also write the rows to this JSON file, row by row")
    progress_help = "append each step's time to this file as it ends (one JSON line each)"
    parser.add_argument("--progress", type=Path, help=progress_help)
    adamw_help = "time host AdamW implementations on a flat vector this long (0 skips)"
    parser.add_argument("--adamw_elements", type=int, default=1 << 24, help=adamw_help)
    args, extra = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    flags = ["--config", args.config, *extra]
    keys = args.rows or (COMPARE if args.compare else ("ours",))
    base, _ = parse_config(flags)
    for key in keys:  # each row's own flags too, before any row runs
        parse_config([*flags, *VARIANTS[key].flags])
    for flag, path in (("--json", args.json), ("--progress", args.progress)):
        if path:
            check_output_file(flag, path)

    rows: list[dict] = []
    for key in keys:
        if args.in_process:
            rows.append(measure_row(key, flags, args))
        else:
            rows.append(run_row(key, flags, args, args.row_timeout))
        add_ratios(rows)
        if args.json:  # as it goes: a later row that kills this process loses only itself
            Path(args.json).write_text(json.dumps(rows, indent=1))

    device = next((row["device"] for row in rows if "device" in row), base.execution.device)
    print(
        f"preset {' '.join([args.config, *extra])} on {device}: {base.tokens_per_step:,} tokens "
        f"per step, {base.training.precision}, gradient accumulation "
        f"{base.gradient_accumulation}; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(format_table(rows))
    for row in rows:
        if "phase_clock" in row:
            print(f"{row['variant']}: " + format_clock(row["phase_clock"]))
        if row.get("update_behind"):
            print(f"{row['variant']}: " + format_update_behind(row["update_behind"]))
        if "idle_gaps" in row:
            print(f"{row['variant']}: " + format_gaps(row["idle_gaps"]))
    if args.adamw_elements > 0:
        print(host_adamw_line(args.adamw_elements, base))
    return rows


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.bench_step")

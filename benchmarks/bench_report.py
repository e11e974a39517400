"""bench_step.py's peak-memory probes, the table its rows print as, and its line on the host
AdamW's rate.

Kept apart from the runs themselves (bench_step.py) so that the variants and the measuring loop
read on their own; of the engine, only its AdamW is used here.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from config.schema import PretrainingConfig
from execution.engine.update.optimizer import adamw_
from modelling.host_threads import team_thread

# ---------------------------------------------------------------------------- memory


def proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak: CUDA's allocator counter, or the kernel's peak RSS (Linux >= 4.0)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass  # then the peak is the process's since it started


def peak_memory(device: torch.device) -> int | None:
    """Bytes: CUDA's peak allocation, else the process's peak RSS since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = proc_status_bytes("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


# ---------------------------------------------------------------------------- table


COLUMNS = (  # key, header, format
    ("variant", "variant", "{}"),
    ("step_s", "step s", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tflops", "TFLOPS", "{:.3f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_mem_GiB", "peak mem GiB", "{:.2f}"),
    ("host_rss_GiB", "host RSS GiB", "{:.2f}"),
    ("h2d_GBps", "H2D GB/s", "{:.1f}"),
    ("d2h_GBps", "D2H GB/s", "{:.1f}"),
    ("gpu_idle", "GPU idle", "{:.1%}"),
    ("first_loss", "loss step 1", "{:.6f}"),
    ("ratio", "vs ours", "{:.2f}x"),
)


def format_table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        if "skipped" in row or "error" in row:  # one line: why the row has no figures
            why = f"skipped: {row['skipped']}" if "skipped" in row else row["error"]
            cells.append([row["variant"], why])
            continue
        cells.append(["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in COLUMNS])
    full = [c for c in cells if len(c) == len(COLUMNS)]
    widths = [max(len(c[i]) for c in full) for i in range(len(COLUMNS))]
    lines = []
    for c in cells:
        if len(c) == 2:  # a skipped or failed row
            lines.append(f"{c[0]:<{widths[0]}}  {c[1]}")
            continue
        first = f"{c[0]:<{widths[0]}}"  # the variant, left-aligned; the figures right-aligned
        figures = (f"{v:>{w}}" for v, w in zip(c[1:], widths[1:], strict=True))
        lines.append("  ".join([first, *figures]))
    return "\n".join(lines)


def host_adamw_line(elements: int, config: PretrainingConfig, repeats: int = 3) -> str:
    """Median time of one host AdamW update (torch's fused AdamW, as the engine runs it) of
    ``elements`` floats on one core and on a team of every core."""
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(elements, generator=g), torch.randn(elements, generator=g)
    exp_avg, exp_avg_sq = torch.zeros(elements), torch.zeros(elements)
    hyper = dict(
        step=1, lr=1e-4, optim=config.training.optimizer, weight_decay=True, grad_scale=0.5
    )
    hyper["scratch"] = torch.empty(elements)  # kept from update to update, as the engine does
    cores = os.cpu_count() or 1
    timed = {}
    for team in sorted({1, cores}):
        with team_thread("host-adamw", team) as host:
            seconds = []
            for _ in range(repeats + 1):  # the first sizes the team
                started = time.perf_counter()
                host.submit(adamw_, weight, grad, exp_avg, exp_avg_sq, **hyper).result()
                seconds.append(time.perf_counter() - started)
            timed[team] = statistics.median(seconds[1:])
    parts = [
        f"{team} core{'s' * (team > 1)} {t * 1e3:.1f} ms ({elements / t / 1e6:.0f} M elements/s)"
        for team, t in timed.items()
    ]
    return f"host AdamW on {elements:,} float32: torch's fused AdamW on " + ", on ".join(parts)

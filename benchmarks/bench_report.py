"""bench_step.py's peak-memory probes and the table its rows print as.

Kept apart from the runs themselves (bench_step.py) so that the variants and the measuring loop
read on their own; nothing here depends on the engine.
"""

from __future__ import annotations

import torch

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

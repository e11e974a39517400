"""The README's table of GPU measurements, rendered from the results files of first runs.

    python -m benchmarks.gpu_table                      # prints it
    python -m benchmarks.gpu_table --write README.md    # replaces it between the markers

Reads every ``benchmarks/results/*.json`` written by gpu_first_run.py (spec files aside), with
the estimates estimate_rows.py --update added where it ran. One line per measured row (the
parity stage's tiny rows are a check, not a measurement): the GPU and date, the run, the plan
it ran, step time, tokens/s, MFU, peak memory allocated and reserved, and the dry run's
estimate against the measurement; then each run's checks, and the calibration its estimates
were priced with where it is another run's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from config.command_line import check_output_file, exit_on_bad_input
from config.loading import OneLineParser

RESULTS = Path(__file__).resolve().parent / "results"
START, END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"
HEADER = (
    "| GPU, date | row | model | plan | cap GiB | tokens/step | step s | tokens/s "
    "| MFU full / causal | state B/param | peak GiB device / host | est/meas |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)
PUBLISHED_RUN = "ml_dataflow, H100 (published, not measured here)"
# The published leader for streamed training on one GPU (als244/ml_dataflow's recorded
# results): an 8B Llama at sequence 2048 on one H100, bfloat16 state, its MFU counting
# attention's causal half. Shown beside ours as they were published, never as measured here.
PUBLISHED = (
    {
        "row": "ml_dataflow",
        "model": "8B, seq 2048",
        "cap": "80",
        "peak": "78 GB / -",
        "mfu_causal": 0.601,
    },
    {
        "row": "ml_dataflow, capped",
        "model": "8B, seq 2048",
        "cap": "24",
        "peak": "24 GB / -",
        "mfu_causal": 0.508,
    },
)
PUBLISHED_TOKENS = "~606k"
PUBLISHED_STATE = "8 (bf16)"


def result_files(folder: Path) -> list[Path]:
    """The results files, by date, a day's first run (``DATE-GPU.json``) before its later
    ones (``DATE-GPU-NAME.json``, gpu_first_run.py --json)."""
    beside = (".spec.json", ".attention.json")  # a run's device spec files, not its results
    files = [p for p in folder.glob("*.json") if not p.name.endswith(beside)]
    return sorted(files, key=lambda p: (p.stem[:10], p.stem.count("-"), p.stem))


def device_slug(name: str) -> str:
    """A device's name as results files carry it: ``NVIDIA H200`` is ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_label(path: Path, results: dict) -> str:
    """The GPU and the date, and the name a later run of the day was given."""
    name = results.get("probe", {}).get("name", results.get("device", "?"))
    later = path.stem[11:].removeprefix(device_slug(name)).strip("-")
    return f"{name}, {path.stem[:10]}" + (f", {later}" if later else "")


def _model(flags: list[str]) -> str:
    """The preset and what the row's flags changed of it (layers, batch, sequence, dropout,
    eager)."""
    words = []
    for flag, label in (
        ("--config", ""),
        ("--layers", " layers"),
        ("--global_batch_size", " seqs"),
        ("--sequence_length", " tokens a seq"),
        ("--dropout_prob", " dropout"),
    ):
        if flag in flags:
            words.append(flags[flags.index(flag) + 1] + label)
    if _flag(flags, "--compile") == "false":
        words.append("eager")
    return ", ".join(words)


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _plan(plan: dict | None) -> str:
    if not plan:
        return "-"
    on_host = [s for s, place in plan["placement"].items() if place == "host"]
    where = "host: " + "+".join(on_host) if on_host else "resident"
    return f"{plan['passes']} pass(es), {where}, recompute {plan['recompute']}"


def _figure(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def causal_share(flags: list[str]) -> float:
    """Model FLOPs a token with attention's causal half over those with its whole square, for
    the model of ``flags`` (rows written before they recorded their causal MFU)."""
    from config.loading import parse_config
    from modelling.gpt import GPTShapes
    from utils.metrics import attention_flops_per_token, flops_per_token

    config, _ = parse_config(flags)
    shapes, sequence = GPTShapes.from_config(config.model), config.model.sequence_length
    full = flops_per_token(shapes, sequence)
    return (full - attention_flops_per_token(shapes, sequence) / 2) / full


def row_line(run: str, row: dict) -> str:
    flags = row.get("flags", [])
    model, cap = _model(flags), row.get("device_cap_GiB") or _flag(flags, "--device_memory_cap_gb")
    if "step_s" not in row:
        why = row.get("skipped") or row.get("error", "")
        return f"| {run} | {row['variant']} | {model} | - | {cap or '-'} | {why} | | | | | | |"
    mfu, causal = row.get("mfu"), row.get("mfu_causal")
    if mfu is not None and causal is None:
        causal = mfu * causal_share(flags)
    tokens = row.get("tokens_per_step") or round(row["tokens_per_s"] * row["step_s"])
    memory = f"{_figure(row.get('peak_mem_GiB'), '{:.1f}')} / "
    memory += _figure(row.get("host_peak_GiB"), "{:.1f}")
    est = row.get("estimate")
    return (
        f"| {run} | {row['variant']} | {model} | {_plan(row.get('plan'))} | {cap or '-'} | "
        f"{tokens:,} | {row['step_s']:.3f} | {row['tokens_per_s']:,.0f} | "
        f"{_figure(mfu, '{:.1%}')} / {_figure(causal, '{:.1%}')} | "
        f"{_figure(row.get('state_bytes_per_param'), '{:.1f}')} | {memory} | "
        f"{_figure(est and est['ratio'], '{:.2f}')} |"
    )


def published_lines() -> list[str]:
    return [
        f"| {PUBLISHED_RUN} | {p['row']} | {p['model']} | - | {p['cap']} | {PUBLISHED_TOKENS} "
        f"| - | - | - / {p['mfu_causal']:.1%} | {PUBLISHED_STATE} | {p['peak']} | - |"
        for p in PUBLISHED
    ]


def run_lines(path: Path, results: dict) -> list[str]:
    """One results file's measured rows (the parity stage's tiny rows are a check)."""
    run = run_label(path, results)
    rows = [r for r in results["rows"] if not r.get("stage", "").startswith("parity:")]
    return [row_line(run, row) for row in rows]


def render(folder: Path) -> str:
    files = result_files(folder)
    if not files:
        return "No GPU has run this code yet: `benchmarks/results/` holds no first run."
    lines, checks = [HEADER], []
    for path in files:
        results = json.loads(path.read_text())
        run = run_label(path, results)
        # The parity rows check the engine's numbers at a tiny size (a check below).
        rows = [r for r in results["rows"] if not r.get("stage", "").startswith("parity:")]
        lines += run_lines(path, results)
        failed = [c["check"] for c in results["checks"] if c["ok"] is False]
        passed = sum(c["ok"] is True for c in results["checks"])
        verdict = f"failed: {', '.join(failed)}" if failed else "none failed"
        line = f"- {run} (`{path.name}`): {passed} checks passed, {verdict}"
        if not results["checks"]:
            line = f"- {run} (`{path.name}`): no checks (some stages again: --stages)"
        specs = {r["estimate"].get("spec") for r in rows if "estimate" in r}
        own = path.with_suffix(".spec.json").name
        if specs - {own, None}:
            line += f"; estimates priced with `{'`, `'.join(sorted(specs - {None}))}`"
        checks.append(line)
    return "\n".join([*lines, *published_lines(), "", *checks])


def replace_between_markers(text: str, table: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"the file has no {START} ... {END} markers")
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results files")
    parser.add_argument("--write", type=Path, help="a Markdown file with the table's markers")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results {args.results}: no such folder")
    if args.write is not None:
        check_output_file("--write", args.write)
    try:
        table = render(args.results)
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"--results {args.results}: a file is not a first run's results ({err})")
    if args.write is None:
        print(table)
        return 0
    try:
        text = replace_between_markers(args.write.read_text(), table)
    except (OSError, ValueError) as err:
        parser.error(f"--write {args.write}: {err}")
    args.write.write_text(text)
    print(f"written: {args.write}")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(lambda: sys.exit(main()), "benchmarks.gpu_table")

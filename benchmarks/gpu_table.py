"""The README's table of GPU measurements, rendered from the results files of first runs.

    python benchmarks/gpu_table.py                      # prints it
    python benchmarks/gpu_table.py --write README.md    # replaces it between the markers

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from command_line import check_output_file, exit_on_bad_input

from config.loading import OneLineParser

RESULTS = Path(__file__).resolve().parent / "results"
START, END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"
HEADER = (
    "| GPU, date | row | model | plan | step s | tokens/s | MFU | peak GiB (alloc / reserved) "
    "| est/meas |\n|---|---|---|---|---|---|---|---|---|"
)


def result_files(folder: Path) -> list[Path]:
    """The results files, by date, a day's first run (``DATE-GPU.json``) before its later
    ones (``DATE-GPU-NAME.json``, gpu_first_run.py --json)."""
    files = [p for p in folder.glob("*.json") if not p.name.endswith(".spec.json")]
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
    """The preset and what the row's flags changed of it (layers, batch)."""
    words = []
    for flag, label in (
        ("--config", ""),
        ("--layers", " layers"),
        ("--global_batch_size", " seqs"),
    ):
        if flag in flags:
            words.append(flags[flags.index(flag) + 1] + label)
    return ", ".join(words)


def _plan(plan: dict | None) -> str:
    if not plan:
        return "-"
    on_host = [s for s, place in plan["placement"].items() if place == "host"]
    where = "host: " + "+".join(on_host) if on_host else "resident"
    return f"{plan['passes']} pass(es), {where}, recompute {plan['recompute']}"


def _figure(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def row_line(run: str, row: dict) -> str:
    model = _model(row.get("flags", []))
    if "step_s" not in row:
        why = row.get("skipped") or row.get("error", "")
        return f"| {run} | {row['variant']} | {model} | - | {why} | | | | |"
    memory = f"{_figure(row.get('peak_mem_GiB'), '{:.1f}')} / "
    memory += _figure(row.get("peak_reserved_GiB"), "{:.1f}")
    est = row.get("estimate")
    return (
        f"| {run} | {row['variant']} | {model} | {_plan(row.get('plan'))} | "
        f"{row['step_s']:.3f} | {row['tokens_per_s']:,.0f} | {_figure(row.get('mfu'), '{:.1%}')} "
        f"| {memory} | {_figure(est and est['ratio'], '{:.2f}')} |"
    )


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
        lines += [row_line(run, row) for row in rows]
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
    return "\n".join([*lines, "", *checks])


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
    exit_on_bad_input(lambda: sys.exit(main()), "gpu_table.py")

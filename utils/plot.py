"""Plot a run's curves from its ``metrics.jsonl``, for runs without wandb.

    python -m utils.plot runs/20260101-120000-tiny            # writes .../metrics.png
    python -m utils.plot RUN_DIR --output curves.png

Four panels against the step: training and evaluation loss, learning rate, tokens/s and the
global gradient norm. A resumed run that logged into several folders can be drawn from each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

from config.command_line import exit_for_bad_input

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of a metrics file; a torn last line (a killed run) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number under ``key``."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draws loss, eval loss, learning rate, tokens/s and grad norm into a PNG.

    Args:
        run_dir: A folder holding ``metrics.jsonl`` (or the file itself).
        output: PNG path; ``metrics.png`` beside the metrics by default.

    Returns:
        The PNG's path.

    Raises:
        ValueError: no metrics file, or no training steps in it.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    rows = read_metrics(path)
    steps, loss = series(rows, "loss")
    if not steps:
        raise ValueError(f"{path} holds no training steps")
    output = Path(output) if output else path.with_name("metrics.png")

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(steps, loss, label="train loss", lw=1)
    eval_steps, eval_loss = series(rows, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", label="eval loss", ms=3)
    ax.set_ylabel("loss")
    ax.legend()
    panels = [
        (axes[0][1], "lr", "learning rate"),
        (axes[1][0], "tokens_per_sec", "tokens/s"),
        (axes[1][1], "grad_norm", "gradient norm"),
    ]
    for ax, key, label in panels:
        x, y = series(rows, key)
        ax.plot(x, y, lw=1)
        ax.set_ylabel(label)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(str(path.parent))
    fig.tight_layout()
    fig.savefig(output, dpi=80)
    plt.close(fig)
    return output


def plot_losses(runs: dict[str, Path], output: str | Path, title: str = "") -> Path:
    """Training loss (and evaluation loss, as markers) of several runs on one panel.

    Args:
        runs: Legend label -> run folder holding ``metrics.jsonl``.
        output: PNG path.
        title: Drawn above the panel.
    """
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, folder in runs.items():
        rows = read_metrics(Path(folder) / "metrics.jsonl")
        (line,) = ax.plot(*series(rows, "loss"), label=f"{label} (train)", lw=1, alpha=0.8)
        eval_steps, eval_loss = series(rows, "eval_loss")
        if eval_steps:
            ax.plot(eval_steps, eval_loss, "o--", color=line.get_color(), label=f"{label} (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(output, dpi=80)
    plt.close(fig)
    return Path(output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m utils.plot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", help="Run folder holding metrics.jsonl (or the file).")
    parser.add_argument("--output", help="PNG to write (default: metrics.png in the run folder).")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot_run(args.run_dir, args.output)}")
    except ValueError as err:
        exit_for_bad_input("utils.plot", err)
    except OSError as err:  # an output folder that does not exist or cannot be written
        exit_for_bad_input("utils.plot", f"cannot write {err.filename}: {err.strerror}")


if __name__ == "__main__":
    main()

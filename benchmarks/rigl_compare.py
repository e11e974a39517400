"""Dense against RigL-sparse training of the same preset at equal steps, on the sample data.

    python -m benchmarks.rigl_compare --output_dir runs/rigl_compare [--steps 200] [flags...]

Runs ``run_pretraining.py`` twice (dense, then ``--sparsity``) with the same flags, seed and
data, evaluating on the shipped validation files, and writes ``comparison.json`` (a table of
the figures the README quotes) and ``loss.png`` (both loss curves) into the output folder.
The sparse run's masked weights still cost dense matmul time here: the step times compare
the bookkeeping RigL adds, not the speed a sparse kernel would give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from config.command_line import check_output_file, check_output_folder, exit_on_bad_input
from config.errors import ConfigError
from utils.plot import plot_losses, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _train(folder: Path, flags: list[str]) -> list[dict]:
    command = [sys.executable, "run_pretraining.py", *flags, "--output_dir", str(folder)]
    subprocess.run(command, cwd=ROOT, check=True)
    return read_metrics(folder / "metrics.jsonl")


def _figures(rows: list[dict]) -> dict:
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    out = {
        "steps": len(steps),
        "final_train_loss_last10": statistics.mean(r["loss"] for r in steps[-10:]),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "median_step_s": statistics.median(r["step_time"] for r in steps[1:]),
    }
    if "rigl/density" in steps[0]:
        densities = [r["rigl/density"] for r in steps]
        out["density_min"], out["density_max"] = min(densities), max(densities)
        out["updates"] = sum(1 for r in steps if "rigl/dropped" in r)
        out["outside_mask_nonzero_max"] = max(r["rigl/outside_mask_nonzero"] for r in steps)
    return out


def check_outputs(folder: Path) -> None:
    """What the comparison writes, checked before its two runs' minutes: the folder, its two
    files, and run folders run_pretraining.py would refuse (one holding a run already)."""
    check_output_folder("--output_dir", folder)
    if not folder.is_dir():
        return
    for name in ("comparison.json", "loss.png"):
        check_output_file("--output_dir", folder / name)
    for run in ("dense", "sparse"):
        if (folder / run / "metrics.jsonl").exists():
            raise ConfigError(f"--output_dir {folder}: {run}/ holds a run; give a new folder")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sparsity", default="0.9")
    parser.add_argument("--sparsity_distribution", default="erk")
    parser.add_argument("--rigl_every", default="20")
    args, extra = parser.parse_known_args()
    check_outputs(args.output_dir)
    validation = sorted(str(p) for p in (ROOT / "data/sample/validation").glob("*.tfrecord"))
    common = ["--config", args.config, "--steps", str(args.steps), "--eval_every", "25"]
    common += ["--validation_files", *validation, *extra]
    sparse = ["--sparsity", args.sparsity, "--sparsity_distribution", args.sparsity_distribution]
    sparse += ["--rigl_every", args.rigl_every]
    runs = {
        "dense": args.output_dir / "dense",
        f"RigL {float(args.sparsity):.0%} {args.sparsity_distribution.upper()}": args.output_dir
        / "sparse",
    }
    table = {
        "dense": _figures(_train(runs["dense"], common)),
        "sparse": _figures(_train(args.output_dir / "sparse", [*common, *sparse])),
        "flags": {"common": common, "sparse": sparse},
    }
    (args.output_dir / "comparison.json").write_text(json.dumps(table, indent=1))
    title = f"{args.config}, {args.steps} steps on the sample data"
    print(f"wrote {plot_losses(runs, args.output_dir / 'loss.png', title)}")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.rigl_compare")

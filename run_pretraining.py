"""Pretrain GPT-3 with phased execution.

    python run_pretraining.py --config tiny
    torchrun --nproc_per_node 8 run_pretraining.py --config tiny \
        --data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2

Every config field is a flag (``--help`` lists them); presets live in config/pretraining.yml.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from config.loading import ConfigError, parse_config
from data.errors import DataError
from execution.parallel.launch import setup_layout, teardown
from execution.training.build import build
from execution.training.loop import evaluate_only, train


def main(argv: list[str] | None = None) -> None:
    config, preset = parse_config(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(config, preset)
        return
    # Test hook, read here only: seconds each save waits before its commit.
    commit_delay = float(os.environ.get("GPT3_TEST_CHECKPOINT_COMMIT_DELAY", "0"))
    layout, launch = setup_layout(config)
    try:
        run = build(config, preset, layout, launch, checkpoint_commit_delay=commit_delay)
        if config.checkpoint.eval_only:
            evaluate_only(run)
        else:
            train(run)
    finally:
        teardown()


def plan_without_launching(config, preset: str) -> None:
    """--dry_run and --plan_for: one CPU process, no data read, no weights drawn."""
    from execution.planning.dry_run import check_input_files, dry_run
    from execution.planning.plan_search import print_layouts

    if config.planning.plan_for:
        print_layouts(config, preset)
        return
    check_input_files(config.data.input_files)
    default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}-dry"
    dry_run(config, Path(config.logging.output_dir or default))


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as err:  # the user's input, not a bug: one line, exit 2
        print(f"run_pretraining.py: error: {err}", file=sys.stderr)
        sys.exit(2)

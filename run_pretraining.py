"""Pretrain GPT-3 with phased execution.

    python run_pretraining.py --config tiny
    torchrun --nproc_per_node 8 run_pretraining.py --config tiny \
        --data_parallel 2 --tensor_parallel_1 2 --tensor_parallel_2 2

Every config field is a flag (``--help`` lists them); presets live in config/pretraining.yml.
"""

from __future__ import annotations

from config.loading import parse_config
from execution.training.build import build
from execution.training.entry import Job, run_entry_point
from execution.training.loop import evaluate_only
from execution.training.program import Program, run_program


def _check_input_files(config) -> None:
    from execution.planning.dry_run import check_input_files

    check_input_files(config.data.input_files, config.data.data_blend)


PRETRAINING = Program(
    parse=parse_config,
    build=build,
    evaluate_only=evaluate_only,
    dry_run_name=lambda config, preset: f"{preset}-dry",
    check_inputs=_check_input_files,
)


def main(argv: list[str] | None = None, job: Job | None = None) -> None:
    run_program(PRETRAINING, argv, job)


if __name__ == "__main__":
    run_entry_point(main, "run_pretraining.py")

"""Fine-tune GPT-3 on SQuAD v1.1 (answer spans) or MNLI (sentence-pair classes).

    python run_finetuning.py --config tiny --task squad --doc_stride 32 --load runs/ckpt
    python run_finetuning.py --config gpt3_125M --task mnli --hf_model gpt2/
    torchrun --nproc_per_node 4 run_finetuning.py --config tiny --task mnli \
        --data_parallel 2 --tensor_parallel_1 2

The presets, flags, engine and layouts are pretraining's (``--help`` lists every flag);
``--load`` takes a pretraining checkpoint's weights (or resumes a fine-tuning run's own
checkpoint), ``--hf_model`` a HuggingFace GPT-2's. See docs/finetuning.md.
"""

from __future__ import annotations

import time
from pathlib import Path

from config.finetuning import parse_finetuning_config
from execution.parallel.launch import setup_layout, teardown
from execution.training.entry import Job, run_entry_point
from execution.training.finetuning import build_finetuning, evaluate_only
from execution.training.loop import train
from execution.training.restart import resume_restarted_job
from execution.training.starting_weights import check_starting_weights

PROGRAM = "run_finetuning.py"


def main(argv: list[str] | None = None, job: Job | None = None) -> None:
    job = job or Job()
    config, preset = parse_finetuning_config(argv)
    if config.planning.dry_run or config.planning.plan_for:
        plan_without_launching(config, preset)
        return
    check_starting_weights(config)  # a mismatch is said before the set-up, not after it
    layout, launch = setup_layout(config)
    job.joined = layout.world.size > 1
    try:
        config, restart = resume_restarted_job(config, layout, launch)
        run = build_finetuning(config, preset, layout, launch, restart)
        if config.checkpoint.eval_only:
            evaluate_only(run)
        else:
            train(run)  # evaluates on the task's files at the end
    finally:
        teardown()


def plan_without_launching(config, preset: str) -> None:
    """--dry_run and --plan_for: one CPU process, no data read, no weights drawn; the task's
    head is counted as the run would hold it."""
    from execution.planning.dry_run import dry_run
    from execution.planning.plan_table import print_layouts

    if config.planning.plan_for:
        print_layouts(config, preset)
        return
    default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{preset}-{config.task}-dry"
    dry_run(config, Path(config.logging.output_dir or default))


if __name__ == "__main__":
    run_entry_point(main, PROGRAM)

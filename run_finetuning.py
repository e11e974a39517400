"""Fine-tune GPT-3 on SQuAD v1.1 (answer spans) or MNLI (sentence-pair classes).

    python run_finetuning.py --config tiny --task squad --doc_stride 32 --load runs/ckpt
    python run_finetuning.py --config gpt3_125M --task mnli --hf_model gpt2/
    torchrun --nproc_per_node 4 run_finetuning.py --config tiny --task mnli \
        --data_parallel 2 --tensor_parallel_1 2

The presets, flags, engine and layouts are pretraining's (``--help`` lists every flag);
``--load`` takes a pretraining checkpoint's weights (or resumes a fine-tuning run's own
checkpoint), ``--hf_model`` a HuggingFace GPT-2's. A dry run counts the task's head as the run
would hold it. Training evaluates on the task's files at the end. See docs/finetuning.md.
"""

from __future__ import annotations

from execution.training.entry import Job, run_entry_point
from execution.training.finetuning import build_finetuning, evaluate_only
from execution.training.program import Program, run_program
from tasks.specs import parse_finetuning_config

PROGRAM = "run_finetuning.py"
FINETUNING = Program(
    parse=parse_finetuning_config,
    build=build_finetuning,
    evaluate_only=evaluate_only,
    dry_run_name=lambda config, preset: f"{preset}-{config.task}-dry",
)


def main(argv: list[str] | None = None, job: Job | None = None) -> None:
    run_program(FINETUNING, argv, job)


if __name__ == "__main__":
    run_entry_point(main, PROGRAM)

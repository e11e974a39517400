"""Planning a fine-tuning run: the memory model holds the task's head, --plan_for proposes no
context axis (the heads read whole sequences), and MFU counts no vocabulary projection."""

from __future__ import annotations

import dataclasses

from config.loading import parse_config
from execution.parallel.sharding import TP2_MATRIX
from execution.planning.memory import RankShape
from execution.planning.plan_search import layouts
from execution.planning.run_shape import RunShape
from modelling.gpt import GPTShapes
from modelling.task_heads import ClassifierHead
from tasks.specs import parse_finetuning_config
from utils.metrics import flops_per_token


def test_the_memory_model_counts_the_task_head():
    flags = ["--config", "tiny", "--tensor_parallel_2", "2"]
    squad, _ = parse_finetuning_config([*flags, "--task", "squad"])
    pretraining, _ = parse_config(flags)
    head = RankShape.of(RunShape.of(squad)).specs["head"]
    assert head[TP2_MATRIX].names == ("qa.weight",)
    assert head[TP2_MATRIX].numel == 2 * 128 // 2  # [2, h] split over tp2
    assert TP2_MATRIX not in RankShape.of(RunShape.of(pretraining)).specs["head"]


def test_plan_for_proposes_no_context_axis_for_a_task():
    config, _ = parse_finetuning_config(["--config", "tiny", "--task", "mnli"])
    candidates = layouts(RunShape.of(config), 4)
    assert candidates and all(c.mesh.cp == 1 for c in candidates)
    pretraining = layouts(RunShape.of(parse_config(["--config", "tiny"])[0]), 4)
    assert any(c.mesh.cp > 1 for c in pretraining)


def test_mfu_counts_no_vocabulary_projection_for_a_task():
    lm = GPTShapes(2, 64, 4, 1000, 32, 0.0, 1e-5)
    task = dataclasses.replace(lm, task_head=ClassifierHead)
    extra = 3 * 64  # score.weight
    assert flops_per_token(task, 16) == flops_per_token(lm, 16) + 6 * (extra - 1000 * 64)

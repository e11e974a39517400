"""The task specs: one per task, the names --task offers, and heads that declare what they hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from config.finetuning import FinetuningConfig
from execution.parallel.sharding import HEAD_SPLITS
from modelling.parallel import LOCAL
from modelling.task_heads import HEADS
from modelling.variants import RMSNorm
from tasks.specs import TASKS, parse_finetuning_config
from tests.library_files import library_files

ROOT = Path(__file__).resolve().parents[2]


def test_the_task_choices_are_the_specs():
    assert FinetuningConfig().task in TASKS
    assert all(name == spec.name for name, spec in TASKS.items())
    with pytest.raises(ConfigError, match=r"^--task must be one of squad, mnli, got 'glue'$"):
        parse_finetuning_config(["--config", "tiny", "--task", "glue"])


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_spec_names_a_known_head_and_its_shipped_samples(name):
    spec = TASKS[name]
    assert spec.head in HEADS
    for path in (*spec.training_samples, *spec.evaluation_samples):
        assert Path(path).is_file(), path
    assert set(spec.own_flags) <= set(vars(FinetuningConfig()))


@pytest.mark.parametrize("head", HEADS, ids=lambda head: head.__name__)
def test_a_head_declares_each_parameter_its_split_and_hf_name_and_its_output(head):
    hidden, micro, seq = 8, 3, 5
    shapes = head.parameter_shapes(hidden)
    assert set(head.SPLITS) == set(head.HF_NAMES) == set(shapes)
    assert set(head.SPLITS.values()) <= set(HEAD_SPLITS)
    module = head(RMSNorm(hidden, LOCAL, 1e-5), hidden, LOCAL)
    own = {n: tuple(p.shape) for n, p in module.named_parameters() if not n.startswith("ln_f")}
    assert own == shapes
    x = torch.randn(micro, seq, hidden)
    targets = torch.zeros(micro, head.TARGET_WIDTH, dtype=torch.long)
    assert tuple(module(x, targets, logits_only=True).shape) == head.output_shape(micro, seq)


def test_only_the_specs_pick_by_a_task_name():
    """A new task is its spec and its reader: no other source compares a task with a name
    (a literal or a constant) to branch on it. Comparing two tasks (a checkpoint's and the
    run's) picks nothing."""
    name = r"(\"[a-z]+\"|\b[A-Z][A-Z_]+\b)"
    branch = re.compile(rf"\btask\s*[!=]=\s*{name}|{name}\s*[!=]=\s*[\w.]*\btask\b")
    found = [path for path in library_files() if branch.search((ROOT / path).read_text())]
    assert found == []

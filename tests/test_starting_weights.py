"""``--load`` and ``--hf_model`` that do not fit the run are refused before it reads its data,
plans or builds its engine, in one line that says what differs and what to pass: another
model's sizes, a fine-tuning checkpoint given to pretraining, a fine-tuning run resumed with
other windows (``--doc_stride``).

The checkpoints are written in this process by the engine's own Checkpointer, and every
command runs through the real entry point (forked: tests/entry_points.py), with the engine's
construction made to fail, so that a check that came after it would show as a traceback.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from config.loading import parse_config
from execution.checkpoint.save import Checkpointer
from execution.engine.engine import PhasedEngine
from execution.parallel.mesh import ParallelLayout
from tasks.specs import parse_finetuning_config
from tests.distributed import planned_engine
from tests.entry_points import assert_refused, run_script

SMALL = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --vocab_size 300 "
    "--max_positional_length 96 --sequence_length 96 --global_batch_size 4 --micro_batch_size 2 "
    "--device cpu"
)


def _saved(config, folder: Path) -> Path:
    engine = planned_engine(config, ParallelLayout.single(torch.device("cpu")))
    checkpointer = Checkpointer(folder, engine, config, log=lambda _: None)
    checkpointer.save(1, None)
    checkpointer.close()
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A pretraining checkpoint and a SQuAD fine-tuning one (``--doc_stride 16``)."""
    folder = tmp_path_factory.mktemp("starting_weights")
    pretraining, _ = parse_config(SMALL)
    squad, _ = parse_finetuning_config([*SMALL, "--task", "squad", "--doc_stride", "16"])
    return {
        "pretraining": _saved(pretraining, folder / "pretraining"),
        "squad": _saved(squad, folder / "squad"),
    }


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the starting weights were checked")

    monkeypatch.setattr(PhasedEngine, "__init__", refuse)


def _refused(program: str, *flags: str, tmp_path: Path) -> str:
    result = run_script(program, *flags, "--output_dir", str(tmp_path / "out"))
    assert_refused(result, program)
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    return result.stderr


def test_a_fine_tuning_checkpoint_given_to_pretraining_says_so(checkpoints, no_engine, tmp_path):
    load = str(checkpoints["squad"])
    stderr = _refused("run_pretraining.py", *SMALL, "--load", load, tmp_path=tmp_path)
    assert f"--load {load} is a checkpoint of a fine-tuning run (--task squad)" in stderr
    assert f"run_finetuning.py --task squad --load {load}" in stderr
    assert "--layers" not in stderr


@pytest.mark.parametrize(
    ("program", "start", "flag", "ours", "theirs"),
    [
        ("run_pretraining.py", "pretraining", "--hidden_size", "64", "32"),
        ("run_finetuning.py", "pretraining", "--layers", "2", "1"),  # its weights only
        ("run_finetuning.py", "squad", "--max_positional_length", "128", "96"),  # resumed
    ],
)
def test_another_models_checkpoint_names_the_flag(
    checkpoints, no_engine, tmp_path, program, start, flag, ours, theirs
):
    load = str(checkpoints[start])
    task = ["--task", "squad"] if program == "run_finetuning.py" else []
    stderr = _refused(program, *SMALL, *task, "--load", load, flag, ours, tmp_path=tmp_path)
    assert f"was saved by a model of {flag} {theirs}, this run has {flag} {ours}" in stderr
    assert f"pass {flag} {theirs}" in stderr


def test_a_fine_tuning_run_resumed_with_another_doc_stride_names_it(
    checkpoints, no_engine, tmp_path
):
    load = str(checkpoints["squad"])
    flags = [*SMALL, "--task", "squad", "--load", load]  # no --doc_stride: 96 // 3
    stderr = _refused("run_finetuning.py", *flags, tmp_path=tmp_path)
    assert "rows were cut with --doc_stride 16; this run has --doc_stride 32" in stderr
    assert "pass --doc_stride 16" in stderr and "digest" not in stderr


def test_an_hf_model_of_other_sizes_names_the_flag_before_the_engine(no_engine, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    sizes = {"n_layer": 3, "n_embd": 32, "n_head": 2, "vocab_size": 300, "n_positions": 96}
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", **sizes}))
    save_file({"wte.weight": torch.zeros(300, 32)}, folder / "model.safetensors")
    stderr = _refused("run_pretraining.py", *SMALL, "--hf_model", str(folder), tmp_path=tmp_path)
    assert "has n_layer 3 but this run has --layers 1; pass --layers 3" in stderr

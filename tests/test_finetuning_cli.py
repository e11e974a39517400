"""run_finetuning.py's bad input: one line naming the problem and exit status 2, never a traceback."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import run_finetuning
from config.loading import ConfigError
from data.errors import DataError
from tests.entry_points import run_script

ROOT = Path(__file__).resolve().parents[1]
SMALL = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --global_batch_size 4 "
    "--micro_batch_size 2 --steps 1 --device cpu --doc_stride 32"
)


def _fails(argv: list[str], error: type, words: str) -> None:
    with pytest.raises(error, match=words) as err:
        run_finetuning.main(argv)
    assert "\n" not in str(err.value)


def test_unknown_flag_exits_2_with_one_line():
    result = run_script("run_finetuning.py", "--task", "squad", "--nonsense", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "run_finetuning.py: error: unrecognized arguments: --nonsense 1"
    )


def test_bad_task_files_fail_before_training(tmp_path):
    out = ["--output_dir", str(tmp_path / "run")]
    _fails([*SMALL, *out, "--input_files", str(tmp_path / "no.json")], DataError, "does not exist")
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [')
    _fails([*SMALL, *out, "--input_files", str(broken)], DataError, "not valid JSON")
    moved = tmp_path / "moved.json"
    paragraph = {"context": "Paris is in France.", "qas": []}
    paragraph["qas"].append(
        {"id": "q", "question": "Where?", "answers": [{"text": "France", "answer_start": 2}]}
    )
    moved.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [paragraph]}]}))
    _fails([*SMALL, *out, "--input_files", str(moved)], DataError, "not in its context")
    labels = tmp_path / "train.tsv"
    labels.write_text("pairID\tsentence1\tsentence2\tgold_label\n1\tA.\tB.\tunsure\n")
    mnli = [*SMALL, *out, "--task", "mnli", "--input_files", str(labels)]
    _fails(mnli, DataError, "label 'unsure' is not one of")
    _fails([*SMALL, *out, "--context_parallel", "2"], ConfigError, "--context_parallel 2")

"""Checkpoints: exact resume after a killed process, atomic writes, pruning and bad input.

The references are an uninterrupted run of the same steps (the real entry point in separate
processes, or an engine in this process) and the bytes that were written.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from execution.checkpoint.files import CheckpointError, resolve
from execution.checkpoint.load import load_checkpoint, read_weights
from execution.checkpoint.logical import full_state
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from tests.distributed import (
    CPU,
    engine_batch,
    global_batches,
    learning_rates,
    planned_engine,
    small_config,
    with_execution,
)
from tests.entry_points import run_script

ROOT = Path(__file__).resolve().parents[2]
# A small model on the shipped sample data (GPT-2 vocabulary), with dropout.
RUN_FLAGS = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --sequence_length 16 "
    "--global_batch_size 4 --micro_batch_size 2 --dropout_prob 0.1 --steps 6 --device cpu"
)


def entry_point(*flags: str, env: dict | None = None, popen: bool = False, fault: str = ""):
    """run_pretraining.py with ``flags``: forked, or (``popen``) a new process, which can have
    a test fault (tests/rank_faults.py) installed."""
    wrapper = ["tests/fixtures/run_with_fault.py", fault] if fault else []
    command = [sys.executable, *wrapper, "run_pretraining.py", *flags]
    env = {**os.environ, **(env or {})}
    if popen:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return run_script("run_pretraining.py", *flags, env=env)  # forked: no new interpreter


def losses(output_dir: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


def logged_steps(output_dir: Path) -> list[int]:
    """The steps a run logged, in the order logged, a step logged twice twice."""
    rows = (json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "loss" in row]


@pytest.mark.slow
def test_a_killed_run_resumes_bitwise_and_a_killed_write_leaves_the_last_checkpoint(tmp_path):
    # Trains 6 steps straight, saving after step 3 and at the end (step 6). A test fault holds
    # each commit for 2 s, so the process is still writing step 6 when step 3 is complete:
    # kill it (SIGKILL) then. Its 6 logged steps are the uninterrupted reference.
    ckpt = tmp_path / "ckpt"
    killed_dir, resumed_dir, eval_dir = tmp_path / "killed", tmp_path / "resumed", tmp_path / "eval"
    save = ["--checkpoint_steps", "3", "--save", str(ckpt), "--output_dir", str(killed_dir)]
    killed = entry_point(*RUN_FLAGS, *save, popen=True, fault="slow_commits:0:0:2")
    deadline = time.monotonic() + 240
    while not ((ckpt / "step_3").is_dir() and (ckpt / "step_6.tmp" / ".metadata").exists()):
        assert killed.poll() is None, killed.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    output = killed.communicate()[0]
    assert killed.returncode == -signal.SIGKILL
    assert "checkpoint: saving step 6" in output and "saved step 6" not in output
    assert (ckpt / "latest").read_text().strip() == "step_3"
    assert not (ckpt / "step_6").exists()  # the half-written one is still .tmp, never loaded
    assert resolve(ckpt) == ckpt / "step_3"

    resume = ["--load", str(ckpt), "--save", str(ckpt), "--output_dir", str(resumed_dir)]
    resumed = entry_point(*RUN_FLAGS, *resume, "--eval_every", "3", "--eval_batches", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    assert "(saved by dp 1 x pp 1 x cp 1 x tp1 1 x tp2 1 (1 process), " in resumed.stdout
    expected, got = losses(killed_dir), losses(resumed_dir)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):  # float32 on CPU, dropout on, the data order from the loader state
        assert got[step] == expected[step], (step, got[step], expected[step])
    # The resumed run removed the killed write and committed its own step 6.
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest",
        "run.json",
        "run.lock",
        "step_3",
        "step_6",
    ]

    # --eval_only on the saved step 6 reproduces the resumed run's evaluation after step 6.
    evaluate = ["--load", str(ckpt), "--output_dir", str(eval_dir)]
    evaluated = entry_point(*RUN_FLAGS, *evaluate, "--eval_only", "--eval_batches", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    resumed_lines = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    final_eval = [json.loads(line) for line in resumed_lines][-1]
    assert final_eval["step"] == 6
    loss = final_eval["eval_loss"]
    assert f"validation loss {loss:.4f}, perplexity {math.exp(loss):.2f}" in evaluated.stdout
    (row,) = [json.loads(line) for line in (eval_dir / "metrics.jsonl").open()]
    assert row == {"step": 6, "eval_loss": loss, "eval_perplexity": math.exp(loss)}


def _engine(config):
    return planned_engine(config, ParallelLayout.single(CPU))


def _train(engine, batches, steps, hooks=None):
    return [
        engine.train_step(engine_batch(engine, batches[s], 0), s, learning_rates(6)[s], hooks).loss
        for s in steps
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the small config after 2 steps (keep 2 of steps 1, 2), its engine."""
    folder = tmp_path_factory.mktemp("saved")
    config = small_config()
    engine = _engine(config)
    batches = global_batches(config, 3)
    checkpointer = Checkpointer(folder, engine, config, keep=2, log=lambda _: None)
    for step in range(2):
        _train(engine, batches, [step], checkpointer.hooks)
        checkpointer.save(step + 1, {"step": step + 1})
    checkpointer.save(2, {"step": 2})  # the same step again replaces it
    checkpointer.close()
    return folder, config, engine, batches


def test_resume_in_process_matches_and_restores_state(saved):
    folder, config, engine, _ = saved
    names = ["latest", "run.json", "run.lock", "step_1", "step_2"]
    assert sorted(p.name for p in folder.iterdir()) == names
    resumed = _engine(with_execution(config, placement="resident"))
    trainer = load_checkpoint(folder, resumed)
    assert trainer["step"] == 2 and trainer["loader"] == {"step": 2}
    assert resumed.optimizer_steps == engine.optimizer_steps == 2
    for state in ("weights", "exp_avg", "exp_avg_sq"):
        ours, theirs = full_state(resumed, state), full_state(engine, state)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), state
    # weights as read for generation and export are the same tensors
    model, weights = read_weights(folder / "step_2")
    assert model["hidden_size"] == 32 and torch.equal(
        weights["layers.1.mlp.fc.weight"], full_state(engine)["layers.1.mlp.fc.weight"]
    )


def test_keep_checkpoints_prunes_the_oldest_and_after_a_rollback_the_abandoned_first(tmp_path):
    config = small_config("--layers", "1")
    engine = _engine(config)
    checkpointer = Checkpointer(tmp_path, engine, config, keep=2, log=lambda _: None)
    for step in (1, 2, 3):
        checkpointer.save(step, None)
    checkpointer.close()

    def steps() -> list[str]:
        return sorted(p.name for p in tmp_path.glob("step_*"))

    assert steps() == ["step_2", "step_3"] and (tmp_path / "run.json").is_file()
    # The run resumed from step_2 and saves step 3 again, then 4 (step 5 of an abandoned
    # attempt lies there too): the checkpoints of its history are kept before abandoned ones.
    (tmp_path / "step_5").mkdir()
    quiet, run_id = (lambda _: None), checkpointer.run_id
    again = Checkpointer(tmp_path, engine, config, keep=2, log=quiet, run_id=run_id)
    for step in (3, 4):
        again.save(step, None)
    again.close()
    assert steps() == ["step_3", "step_4"]


def test_a_killed_runs_unfinished_writes_go_when_the_folder_is_opened_not_at_a_save(tmp_path):
    """The main rank sweeps ``step_*.tmp`` once, before any rank can save: at a save it could
    remove the folder another rank's write of that step had just made (a race seen with eight
    ranks: FileExistsError in DCP's mkdir). A folder made after opening is left to its writer."""
    config = small_config("--layers", "1")
    (tmp_path / "step_5.tmp").mkdir(parents=True)
    checkpointer = Checkpointer(tmp_path, _engine(config), config, log=lambda _: None)
    assert not (tmp_path / "step_5.tmp").exists()
    (tmp_path / "step_9.tmp").mkdir()  # another rank's write, begun before this rank's save
    checkpointer.save(1, None)
    checkpointer.close()
    assert (tmp_path / "step_9.tmp").is_dir() and (tmp_path / "step_1").is_dir()


def test_load_of_a_step_folder_is_that_checkpoint_whatever_lies_in_it(saved, tmp_path):
    """A `latest` written into a checkpoint (by another run given it as its folder) is not
    followed: the checkpoint is the folder itself."""
    folder = _copy(saved[0] / "step_2", tmp_path)
    (folder / "latest").write_text("step_1\n")
    (folder / "step_1").mkdir()
    assert resolve(folder) == folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    target.mkdir()
    for file in folder.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_file_is_named(saved, tmp_path, damage):
    folder = _copy(saved[0] / "step_2", tmp_path)
    data = folder / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip":
        payload = bytearray(data.read_bytes())
        payload[len(payload) // 2] ^= 0x01
        data.write_bytes(bytes(payload))
    else:
        data.unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, _engine(saved[1]))
    message = str(err.value)
    assert str(data) in message and "\n" not in message
    assert {"truncate": "damaged", "flip": "CRC", "delete": "missing"}[damage] in message


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ("{}", "it does not list .metadata, __0_0.distcp, trainer.json"),
        ("[]", "it holds a list, not a map of file -> [size, CRC-32C]"),
        ('{"trainer.json": 5}', "its entry for 'trainer.json' is 5, not [size, CRC-32C]"),
        ("drop __0_0.distcp", "it does not list __0_0.distcp"),
    ],
)
def test_a_manifest_that_does_not_list_every_file_is_damage(saved, tmp_path, manifest, message):
    """An empty or partial manifest would let every file (or the unlisted one) pass unchecked:
    the checkpoint is refused in one line, and nothing in its folder changes."""
    folder = _copy(saved[0] / "step_2", tmp_path)
    if manifest.startswith("drop "):
        entries = json.loads((folder / "manifest.json").read_text())
        del entries[manifest.removeprefix("drop ")]
        manifest = json.dumps(entries)
    (folder / "manifest.json").write_text(manifest)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, _engine(saved[1]))
    assert str(err.value) == (
        f"checkpoint file {folder / 'manifest.json'} is damaged: {message}"
    ), err.value
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_another_model_shape_names_the_tensor_and_both_shapes(saved):
    shapes = r"has shape \[1000, 32\] in the checkpoint but \[1000, 64\] in this model"
    with pytest.raises(CheckpointError, match=r"weights/embedding.word.weight " + shapes):
        load_checkpoint(saved[0], _engine(small_config("--hidden_size", "64")))
    with pytest.raises(CheckpointError, match=r"no tensor weights/layers.2.ln_1.weight"):
        load_checkpoint(saved[0], _engine(small_config("--layers", "3")))


def test_an_unfinished_or_missing_checkpoint_is_one_line_and_exit_2(saved, tmp_path):
    unfinished = tmp_path / "step_9.tmp"
    unfinished.mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        resolve(unfinished)
    paths = ["--load", str(tmp_path / "nothing"), "--output_dir", str(tmp_path / "out")]
    result = entry_point(*RUN_FLAGS, *paths)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"run_pretraining.py: error: checkpoint {tmp_path / 'nothing'} does not exist"
    )
    assert not (tmp_path / "out").exists()

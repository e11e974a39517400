"""A run never damages another run's folders, and one folder is written by one process.

Each test runs the commands that used to do damage, through the real entry points: a new run
given a folder inside another run's checkpoint or ``--save`` folder, or another run's folders;
two runs started at once into one folder; the same resume started twice; an ``--eval_only``
into a fine-tuning run's folder; a sparse checkpoint resumed at another sparsity. Each is
refused in one line (exit 2, no traceback), and the reference is the SHA-256 of every file of
the victim's folders before the command. The owner's own resume then goes on, and appends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from execution.checkpoint.files import resolve, verify
from execution.checkpoint.ownership import claim_folder, claim_new_folder, new_run_id
from tests.checkpoint.test_checkpoint import RUN_FLAGS, entry_point, logged_steps
from tests.entry_points import ROOT, assert_refused, run_script


def _snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (its folders too: an added one shows)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _refused(result, message: str, program: str = "run_pretraining.py") -> None:
    assert_refused(result, program, message)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One trained run: 6 steps, checkpoints after steps 2, 4 and 6 (``ckpt``), metrics in
    ``out``. Tests work on copies (:func:`run_copy`)."""
    folder = tmp_path_factory.mktemp("trained")
    ckpt, out = folder / "ckpt", folder / "out"
    saving = ["--checkpoint_steps", "2", "--save", str(ckpt), "--output_dir", str(out)]
    result = entry_point(*RUN_FLAGS, *saving)
    assert result.returncode == 0, result.stderr
    return folder


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    target = tmp_path / "victim"
    shutil.copytree(trained, target)
    return target


def _resume(victim: Path, *flags: str) -> list[str]:
    ckpt, out = victim / "ckpt", victim / "out"
    return [*RUN_FLAGS, "--load", str(ckpt), "--save", str(ckpt), "--output_dir", str(out), *flags]


@pytest.mark.slow
def test_folders_inside_another_runs_checkpoints_or_its_folders_are_refused(run_copy, tmp_path):
    ckpt, out = run_copy / "ckpt", run_copy / "out"
    a_checkpoint = "a checkpoint holds only the files its manifest lists"
    refused = {
        # Inside a step folder: the owner's load and generation would then find it damaged.
        "save in a step": (
            ["--save", f"{ckpt}/step_4"],
            f"--save {ckpt}/step_4 is a checkpoint: ",
        ),
        "save under a step": (["--save", f"{ckpt}/step_4/mine"], f"inside {ckpt}/step_4, which is"),
        "output in a step": (["--output_dir", f"{ckpt}/step_2"], a_checkpoint),
        "output under a step": (["--output_dir", f"{ckpt}/step_2/a/b"], a_checkpoint),
        "output at a step's slot": (["--output_dir", f"{ckpt}/step_8"], a_checkpoint),
        "output under the save": (
            ["--output_dir", f"{ckpt}/logs"],
            "the --save folder of another run",
        ),
        # Its run.json would be replaced, and the owner's resume refused.
        "output at the save": (
            ["--output_dir", str(ckpt)],
            f"{ckpt} holds the checkpoints of another run",
        ),
        "save at the save": (
            ["--save", str(ckpt)],
            f"--save {ckpt} holds the checkpoints of another run",
        ),
        "prune the save": (["--save", str(ckpt), "--keep_checkpoints", "1"], "belongs to one run"),
        "output at the output": (
            ["--output_dir", str(out)],
            f"{out} already holds the metrics.jsonl",
        ),
    }
    before = _snapshot(run_copy)
    for name, (flags, message) in refused.items():
        fresh = tmp_path / f"fresh-{name.replace(' ', '-')}"
        defaults = ["--output_dir", str(fresh), "--save", str(fresh / "ckpt")]
        result = entry_point(*RUN_FLAGS, "--steps", "1", *defaults, *flags)
        _refused(result, message)
        assert _snapshot(run_copy) == before, name
        assert not fresh.exists(), name
    # The owner resumes, appending to its metrics, and its checkpoints generate.
    resumed = entry_point(*_resume(run_copy, "--steps", "7"))
    assert resumed.returncode == 0, resumed.stderr
    assert logged_steps(out) == [1, 2, 3, 4, 5, 6, 7]
    prompt = ["--prompt", "The", "--max_new_tokens", "2", "--device", "cpu"]
    generated = run_script("run_generation.py", "--load", str(ckpt / "step_2"), *prompt)
    assert generated.returncode == 0, generated.stderr


def _at_once(*commands: list[str]) -> list:
    """Runs ``run_pretraining.py`` with each command's flags at the same time."""
    results: list = [None] * len(commands)

    def run(index: int) -> None:
        results[index] = entry_point(*commands[index])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(commands))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.slow
def test_two_new_runs_started_at_once_into_one_output_dir_run_once(tmp_path):
    out = tmp_path / "out"
    command = [*RUN_FLAGS, "--steps", "2", "--output_dir", str(out)]
    results = _at_once(command, command)
    assert sorted(r.returncode for r in results) == [0, 2], [r.stderr[-2000:] for r in results]
    loser = next(r for r in results if r.returncode == 2)
    # Refused by the lock while the other holds the folder, or by its run.json once written.
    _refused(loser, str(out))
    assert re.search(r"is in use by process \d+|already holds the metrics.jsonl", loser.stderr)
    assert logged_steps(out) == [1, 2]


@pytest.mark.slow
def test_the_same_resume_started_twice_runs_once_and_damages_nothing(run_copy):
    """As a requeued job would: the second copy is refused and the committed checkpoints
    keep every byte."""
    ckpt = run_copy / "ckpt"
    committed = {step: _snapshot(ckpt / step) for step in ("step_2", "step_4", "step_6")}
    command = _resume(run_copy, "--steps", "8")
    results = _at_once(command, command)
    assert sorted(r.returncode for r in results) == [0, 2], [r.stderr[-2000:] for r in results]
    loser = next(r for r in results if r.returncode == 2)
    # Refused by the lock; or, started after the other had finished, with nothing to train.
    _refused(loser, "")
    assert re.search(r"is in use by process \d+|nothing to train", loser.stderr), loser.stderr
    assert {step: _snapshot(ckpt / step) for step in committed} == committed
    assert resolve(ckpt) == ckpt / "step_8" and verify(ckpt / "step_8") is None
    assert logged_steps(run_copy / "out") == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_folder_another_process_holds_is_refused(tmp_path):
    """The run holding it is this test process (the command runs in a forked child)."""
    held = tmp_path / "held"
    claim = claim_folder(held, new_run_id(), "--output_dir")
    try:
        before = _snapshot(tmp_path)
        result = entry_point(*RUN_FLAGS, "--steps", "1", "--output_dir", str(held))
        _refused(result, f"--output_dir {held} is in use by process ")
        assert _snapshot(tmp_path) == before
    finally:
        claim.release()


def test_default_output_folders_of_runs_started_in_one_second_differ(tmp_path):
    first, first_claim = claim_new_folder(tmp_path / "runs" / "20260101-000000-tiny", "a")
    second, second_claim = claim_new_folder(tmp_path / "runs" / "20260101-000000-tiny", "b")
    first_claim.release(), second_claim.release()
    assert [first.name, second.name] == ["20260101-000000-tiny", "20260101-000000-tiny-2"]


@pytest.mark.slow
def test_a_rollback_keeps_the_step_resumed_from_and_logs_each_step_once(run_copy):
    """Resumed from step_2 of a run that reached step_6, with --keep_checkpoints 2: steps 4 and
    6 were abandoned, so they are pruned before step_2; the metrics lines of steps 3 to 6 go,
    and the new step 3 is the old one (a resume is bitwise)."""
    ckpt, out = run_copy / "ckpt", run_copy / "out"
    old = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    rollback = ["--load", str(ckpt / "step_2"), "--steps", "3", "--keep_checkpoints", "2"]
    result = entry_point(*_resume(run_copy), *rollback)  # the later --load wins
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_2", "step_3"]
    assert (ckpt / "latest").read_text() == "step_3\n"
    new = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert logged_steps(out) == [1, 2, 3]
    assert new[:2] == old[:2]
    assert json.loads(new[2])["loss"] == json.loads(old[2])["loss"]


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_names_the_newest_intact_one(run_copy):
    ckpt = run_copy / "ckpt"
    data = ckpt / "step_6" / "__0_0.distcp"
    payload = bytearray(data.read_bytes())
    payload[len(payload) // 2] ^= 0x01
    data.write_bytes(bytes(payload))
    before = _snapshot(run_copy)
    hint = f"; the newest intact checkpoint is step_4: --load {ckpt}/step_4"
    resumed = entry_point(*_resume(run_copy, "--steps", "7"))
    _refused(resumed, f"{data} is damaged: its CRC-32C does not match{hint}")
    # Refused after its folders were claimed (made, locked): what the claim made goes.
    fresh = run_copy.parent / "fresh"
    elsewhere = entry_point(*_resume(run_copy, "--steps", "7"), "--output_dir", str(fresh / "a"))
    _refused(elsewhere, hint)
    assert not fresh.exists()
    prompt = ["--prompt", "The", "--max_new_tokens", "2", "--device", "cpu"]
    generated = run_script("run_generation.py", "--load", str(ckpt), *prompt)
    _refused(generated, f"{data} is damaged: its CRC-32C does not match{hint}", "run_generation.py")
    assert _snapshot(run_copy) == before


FINETUNING = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --max_positional_length 96 "
    "--global_batch_size 4 --micro_batch_size 2 --device cpu --task mnli --log_every 100"
)


@pytest.mark.slow
def test_eval_only_writes_a_folder_of_its_own_naming_the_files_it_scored(tmp_path):
    from tasks.specs import MNLI

    tuned = tmp_path / "tuned"
    saving = ["--save", str(tuned / "ckpt"), "--output_dir", str(tuned / "out")]
    result = run_script("run_finetuning.py", *FINETUNING, "--steps", "1", *saving)
    assert result.returncode == 0, result.stderr
    before = _snapshot(tuned)
    evaluate = [*FINETUNING, "--eval_only", "--load", str(tuned / "ckpt")]
    into = run_script("run_finetuning.py", *evaluate, "--output_dir", str(tuned / "out"))
    _refused(into, f"{tuned / 'out'} already holds the metrics.jsonl", "run_finetuning.py")
    assert _snapshot(tuned) == before
    own = run_script(ROOT / "run_finetuning.py", *evaluate, cwd=tmp_path)  # runs/ under tmp_path
    assert own.returncode == 0, own.stderr
    assert _snapshot(tuned) == before
    (folder,) = (tmp_path / "runs").iterdir()
    scores = json.loads((folder / "eval.json").read_text())
    files = list(MNLI.evaluation_samples)
    assert {name: entry["file"] for name, entry in scores.items()} == {
        Path(file).stem: file for file in files
    }


@pytest.mark.slow
def test_a_sparse_checkpoint_resumes_only_at_its_sparsity(tmp_path):
    """Resumed dense it would drop its masks; at another sparsity or distribution it would
    keep them while recording the new value."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    sparse = ["--sparsity", "0.5", "--sparsity_distribution", "uniform"]
    saving = ["--save", str(ckpt), "--output_dir", str(out)]
    result = entry_point(*RUN_FLAGS, *sparse, "--steps", "1", *saving)
    assert result.returncode == 0, result.stderr
    before = _snapshot(tmp_path)
    resume = [*RUN_FLAGS, "--load", str(ckpt), *saving, "--steps", "2"]
    saved = "--sparsity 0.5 --sparsity_distribution uniform"
    for flags, ours in [
        ([], "--sparsity 0.0"),
        (["--sparsity", "0.75", "--sparsity_distribution", "uniform"], "--sparsity 0.75 --"),
        (["--sparsity", "0.5"], "--sparsity 0.5 --sparsity_distribution erk"),
    ]:
        result = entry_point(*resume, *flags)
        _refused(result, f"{ckpt / 'step_1'} was trained with {saved} and holds those masks")
        assert f"but this run has {ours}" in result.stderr
        assert result.stderr.endswith(f"resume it with {saved}\n")
        assert _snapshot(tmp_path) == before


@contextlib.contextmanager
def _read_only(folder: Path):
    """``folder`` made read-only: by its mode, or, for root (whom modes do not stop), by a
    read-only bind mount of it."""
    mode = folder.stat().st_mode
    folder.chmod(0o555)
    mounted = False
    try:
        if os.access(folder, os.W_OK):
            bind = subprocess.run(["mount", "--bind", folder, folder], capture_output=True)
            mounted = bind.returncode == 0
            remount = ["mount", "-o", "remount,ro,bind", folder, folder]
            if not mounted or subprocess.run(remount, capture_output=True).returncode:
                pytest.skip("cannot make a folder read-only for this user")
        yield
    finally:
        if mounted:
            subprocess.run(["umount", folder], check=True)
        folder.chmod(mode)


@pytest.mark.slow
def test_a_read_only_save_folder_is_refused_before_training(run_copy):
    ckpt = run_copy / "ckpt"
    before = _snapshot(run_copy)
    with _read_only(ckpt):
        result = entry_point(*_resume(run_copy, "--steps", "7"))
    _refused(result, f"cannot write to --save {ckpt}: it is read-only for this process")
    assert _snapshot(run_copy) == before


def test_a_save_folder_holding_only_another_runs_metrics_offers_no_load(tmp_path):
    """A metrics-only folder is not a checkpoint folder: the refusal says what it holds and
    does not suggest --load, which would refuse it; one with checkpoints does suggest it."""
    from config.errors import ConfigError
    from execution.checkpoint.ownership import check_run_folder, record_owner

    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"step": 1, "loss": 10.8}\n')
    record_owner(metrics_only, "other-run")
    with pytest.raises(ConfigError) as refused:
        check_run_folder(metrics_only, "this-run", "--save")
    message = str(refused.value)
    assert "(its metrics, no checkpoint)" in message and "--load" not in message

    (metrics_only / "step_3").mkdir()
    with pytest.raises(ConfigError, match=r"holds the checkpoints of another run.*--load"):
        check_run_folder(metrics_only, "this-run", "--save")

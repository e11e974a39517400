"""A save the file system refuses fails alone: one line, training goes on, ``latest`` stays on
the newest intact checkpoint and the unfinished folder goes (execution/checkpoint/commit.py).

Faults: every write of a save is sent in turn to ``/dev/full``, whose writes fail with ENOSPC as
a full disk's do (the DCP data file, DCP's index, the trainer state, the manifest, ``latest``;
the save path writes no HuggingFace export); a rename refused as permissions changed mid-run; a
file system that reports too little room; and a real small tmpfs, where the machine lets the
test mount one. The reference is a run that never failed: the same steps in this process, or
the entry point run again, compared bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import pathlib
import pickle
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import execution.checkpoint.commit as commit
from execution.checkpoint.disk import checkpoint_bytes
from execution.checkpoint.load import load_checkpoint
from execution.checkpoint.logical import full_state
from execution.checkpoint.save import Checkpointer
from execution.parallel.mesh import ParallelLayout
from tests.checkpoint.test_checkpoint import RUN_FLAGS, entry_point, losses
from tests.distributed import (
    CPU,
    engine_batch,
    global_batches,
    learning_rates,
    planned_engine,
    run_ranks,
    small_config,
    world_layout,
)

STEPS = 5
STATES = ("weights", "exp_avg", "exp_avg_sq")
FOLDER_AFTER_FAILURE = ["latest", "run.json", "run.lock", "step_2"]


@contextlib.contextmanager
def full_disk(fails: Callable[[Path], bool]) -> Iterator[None]:
    """Every file ``fails`` names is created when opened for writing, as on a full disk, and
    written on /dev/full, whose writes fail with ENOSPC as a full disk's do (in this process's
    threads, and in processes forked meanwhile)."""
    real_open = io.open

    def opening(file, mode="r", *args, **kwargs):
        if isinstance(file, str | os.PathLike) and "w" in mode and fails(Path(file)):
            real_open(file, mode).close()
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(io, "open", opening)  # pathlib's and DCP's opens
        patch.setattr("builtins.open", opening)
        yield


@contextlib.contextmanager
def refused_rename(name: str) -> Iterator[None]:
    """Renaming the folder ``name`` fails as if the save folder's permissions had changed
    (as root, a chmod would not stop this process)."""
    real_rename = pathlib.Path.rename

    def rename(self, target):
        if self.name == name:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_rename(self, target)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pathlib.Path, "rename", rename)
        yield


@contextlib.contextmanager
def vanished(name: str) -> Iterator[None]:
    """Reading back the file ``name`` fails as on a mount that went away."""
    real_crc = commit.file_crc

    def file_crc(path: Path) -> int:
        if path.name == name:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_crc(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(commit, "file_crc", file_crc)
        yield


@contextlib.contextmanager
def little_room(free: int) -> Iterator[None]:
    """The file system reports ``free`` bytes free."""
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")

    def disk_usage(path):
        total = real(path).total
        return usage(total, total - free, free)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "disk_usage", disk_usage)
        yield


# What fails in the save of step 4, and the reason its line gives.
FAULTS = {
    "the DCP data file": ("write", "__0_0.distcp", "No space left on device"),
    "DCP's index": ("write", ".metadata.tmp", "No space left on device"),
    "the trainer state": ("write", "trainer.json", "No space left on device"),
    "the manifest": ("write", "manifest.json.tmp", "No space left on device"),
    "latest": ("write", "latest.tmp", "No space left on device"),
    "reading the data file back": ("read", "__0_0.distcp", "Input/output error"),
    "the rename into place": ("rename", "step_4.tmp", "Permission denied"),
    "too little room": ("room", "", "not enough space for the checkpoint, nothing was written"),
}


def _fault(kind: str, name: str, room: int):
    if kind == "write":
        return full_disk(lambda path: path.name == name)
    if kind == "read":
        return vanished(name)
    if kind == "rename":
        return refused_rename(name)
    return little_room(room - 1)


def _engine(config):
    return planned_engine(config, ParallelLayout.single(CPU))


def _train(engine, batches, steps, hooks=None) -> list[float]:
    rates = learning_rates(STEPS)
    return [
        engine.train_step(engine_batch(engine, batches[s], 0), s, rates[s], hooks).loss
        for s in steps
    ]


def _states(engine) -> dict[str, dict[str, torch.Tensor]]:
    return {state: full_state(engine, state) for state in STATES}


def _assert_bitwise(actual: dict, expected: dict) -> None:
    for state, tensors in expected.items():
        for name, t in tensors.items():
            assert torch.equal(actual[state][name], t), (state, name)


@pytest.fixture(scope="module")
def uninterrupted():
    """The small config's losses and state after STEPS steps of a run that never saved."""
    config = small_config("--layers", "1")
    batches = global_batches(config, STEPS)
    engine = _engine(config)
    return config, batches, _train(engine, batches, range(STEPS)), _states(engine)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_write_fails_its_save_alone_and_latest_resumes_as_if_it_never_had(
    uninterrupted, tmp_path, fault
):
    config, batches, expected_losses, expected_states = uninterrupted
    kind, name, reason = FAULTS[fault]
    lines: list[str] = []
    engine = _engine(config)
    checkpointer = Checkpointer(tmp_path, engine, config, log=lines.append)
    losses_seen = _train(engine, batches, [0, 1], checkpointer.hooks)
    checkpointer.save(2, {"step": 2})
    losses_seen += _train(engine, batches, [2, 3], checkpointer.hooks)
    checkpointer.wait()  # step 2 is written before the disk fills
    with _fault(kind, name, checkpointer.folder.checkpoint_bytes):
        checkpointer.save(4, {"step": 4})
        checkpointer.wait()  # no error: the save failed alone

    (line,) = [line for line in lines if "was not saved" in line]
    assert line.startswith(f"checkpoint: step 4 was not saved to {tmp_path / 'step_4'}: {reason}")
    assert line.endswith("the newest intact checkpoint is still step_2 (latest)"), line
    assert f"a checkpoint needs {checkpointer.folder.checkpoint_bytes / 1e6:,.1f} MB" in line
    assert checkpointer.folder.failed_saves == 1
    assert checkpointer.folder.last_failure.startswith(f"step 4: {reason}")
    assert sorted(p.name for p in tmp_path.iterdir()) == FOLDER_AFTER_FAILURE
    assert (tmp_path / "latest").read_text() == "step_2\n"

    # A resume from `latest` now is the run that never failed, bit for bit, from step 2.
    resumed = _engine(config)
    assert load_checkpoint(tmp_path, resumed)["step"] == 2
    assert _train(resumed, batches, [2, 3, 4]) == expected_losses[2:]
    _assert_bitwise(_states(resumed), expected_states)

    # Training goes on, and the next save is complete and exact.
    losses_seen += _train(engine, batches, [4], checkpointer.hooks)
    checkpointer.save(5, {"step": 5})
    checkpointer.close()
    assert losses_seen == expected_losses
    assert checkpointer.folder.last_failure is None and "saved step 5" in lines[-1]
    assert (tmp_path / "latest").read_text() == "step_5\n"
    from_disk = _engine(config)
    assert load_checkpoint(tmp_path, from_disk)["step"] == 5
    _assert_bitwise(_states(from_disk), expected_states)


def test_a_failed_save_of_a_step_saved_before_keeps_the_earlier_one(tmp_path):
    """Saving a step again replaces its folder: a failed replacement puts the old one back."""
    config = small_config("--layers", "1")
    engine = _engine(config)
    lines: list[str] = []
    checkpointer = Checkpointer(tmp_path, engine, config, log=lines.append)
    checkpointer.save(2, {"step": 2})
    checkpointer.wait()
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_2").iterdir()}
    with full_disk(lambda path: path.name == "latest.tmp"):
        checkpointer.save(2, {"step": "again"})
        checkpointer.close()
    assert "step 2 was not saved" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == FOLDER_AFTER_FAILURE
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_2").iterdir()} == before


def test_the_start_warns_when_the_folder_cannot_hold_the_checkpoints_it_will_keep(tmp_path):
    config = small_config("--layers", "1")
    lines: list[str] = []
    checkpointer = Checkpointer(tmp_path, _engine(config), config, keep=2, log=lines.append)
    size = checkpointer.folder.checkpoint_bytes
    mb = f"{size / 1e6:,.1f} MB"
    with little_room(3 * size):  # 2 kept and 1 being written: fits
        checkpointer.check_room(10)
    with little_room(3 * size - 1):
        checkpointer.check_room(10)
        checkpointer.check_room(1)  # one save needs room for one
    checkpointer.keep = 0  # keep all: the run's 10 saves
    with little_room(4 * size):
        checkpointer.check_room(10)
        checkpointer.check_room(4)
    checkpointer.close()
    free = f"{(3 * size - 1) / 1e6:,.1f} MB"
    assert lines == [
        f"warning: --save {tmp_path} has room for 2 checkpoint(s) of {mb} ({free} free on its "
        "file system), but --keep_checkpoints 2 needs 3 at once (2 kept and the one being "
        "written); saves that do not fit will fail, and training goes on",
        f"warning: --save {tmp_path} has room for 4 of this run's 10 checkpoint(s) of {mb} "
        f"({4 * size / 1e6:,.1f} MB free on its file system, and --keep_checkpoints 0 keeps them "
        "all); saves that do not fit will fail, and training goes on",
    ]


def _save_on_two_ranks(config, folder, name):
    """Rank 0 and 1 save step 1 (``name`` on a full disk) and step 2; what each rank saw."""
    engine = planned_engine(config, world_layout(config))
    lines: list[str] = []
    checkpointer = Checkpointer(folder, engine, config, log=lines.append)
    outcomes = []
    for step, fails in ((1, name), (2, None)):
        with full_disk(lambda path, fails=fails: path.name == fails):
            checkpointer.save(step, None)
            checkpointer.wait()
        outcomes.append((checkpointer.folder.failed_saves, checkpointer.folder.last_failure))
    checkpointer.close()
    return {"outcomes": outcomes, "lines": lines}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["__1_0.distcp", "latest.tmp"])
def test_every_rank_agrees_that_a_save_failed_on_one(tmp_path, name):
    """A write refused on rank 1 (its data file) or on rank 0 alone (``latest``, after the
    other ranks wrote): both ranks count the save failed and go on to the next save."""
    config = small_config("--layers", "1", "--data_parallel", "2")
    folder = tmp_path / "ckpt"
    results = run_ranks(_save_on_two_ranks, 2, tmp_path / "job", config, folder, name, timeout=180)
    for result in results:
        (failed, why), (still, after) = result["outcomes"]
        assert failed == still == 1 and after is None
        assert why.startswith("step 1: "), why
    (line,) = [line for line in results[0]["lines"] if "was not saved" in line]
    assert line.startswith(f"checkpoint: step 1 was not saved to {folder / 'step_1'}: ")
    assert line.endswith("no checkpoint of this run is complete yet"), line
    assert results[1]["lines"] == []  # rank 0 speaks for the job
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "run.json", "run.lock", "step_2"]


def _mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode:
        pytest.skip(f"this machine does not let the test mount a tmpfs: {done.stderr.strip()}")


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Callable[[int], Path]]:
    """Mounts a tmpfs of a given size (skips where the machine does not allow it)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        _mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("checked", [True, False], ids=["checked first", "written until full"])
def test_a_save_that_does_not_fit_a_real_tmpfs_is_one_line_and_latest_stays(
    uninterrupted, small_tmpfs, monkeypatch, checked
):
    """A tmpfs that holds one checkpoint, not two. Checked first, the second save is refused
    before a byte is written; with the check off, it is written until the disk is full (PyTorch's
    writer then raises over the ENOSPC: 'unexpected pos', as issue 54 found)."""
    config, batches, expected_losses, expected_states = uninterrupted
    engine = _engine(config)
    folder = small_tmpfs(int(1.5 * checkpoint_bytes(engine)))
    if not checked:
        monkeypatch.setattr(commit, "no_room", lambda *_: None)
    lines: list[str] = []
    checkpointer = Checkpointer(folder / "ckpt", engine, config, log=lines.append)
    _train(engine, batches, [0, 1], checkpointer.hooks)
    checkpointer.save(2, {"step": 2})
    _train(engine, batches, [2, 3], checkpointer.hooks)
    checkpointer.save(4, {"step": 4})
    checkpointer.close()
    assert "saved step 2" in lines[1], lines
    (line,) = [line for line in lines if "was not saved" in line]
    reason = "not enough space for the checkpoint" if checked else "No space left on device"
    assert f"step 4 was not saved to {folder / 'ckpt' / 'step_4'}: {reason}" in line, line
    assert line.endswith("the newest intact checkpoint is still step_2 (latest)"), line
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == FOLDER_AFTER_FAILURE
    resumed = _engine(config)
    assert load_checkpoint(folder / "ckpt", resumed)["step"] == 2
    assert _train(resumed, batches, [2, 3, 4]) == expected_losses[2:]
    _assert_bitwise(_states(resumed), expected_states)


@pytest.mark.slow
def test_a_run_whose_saves_fail_trains_on_ends_in_one_line_and_resumes_exactly(
    tmp_path,
):
    """run_pretraining.py saving every 2 of 6 steps, the saves of steps 4 and 6 on a full disk:
    each says so, training goes on as if nothing had failed, the end is one line and exit 74
    (the last save failed), and a resume into the same folder from its `latest` (step 2) is the
    run that never failed, bit for bit: its losses, and the checkpoint it saves."""
    flags = [*RUN_FLAGS, "--checkpoint_steps", "2"]
    reference = entry_point(
        *flags, "--save", str(tmp_path / "ref"), "--output_dir", str(tmp_path / "ref_out")
    )
    assert reference.returncode == 0, reference.stderr
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    full = {"step_4.tmp", "step_6.tmp"}
    with full_disk(lambda path: path.name == "__0_0.distcp" and path.parent.name in full):
        failed = entry_point(*flags, "--save", str(ckpt), "--output_dir", str(out))
    assert failed.returncode == 74, failed.stderr[-3000:]
    assert failed.stderr == (
        "run_pretraining.py: error: 2 of 3 saves failed, the last one too (step 6: No space "
        f"left on device); the newest intact checkpoint is {ckpt / 'step_2'} (resume with "
        f"--load {ckpt})\n"
    )
    said = [line for line in failed.stdout.splitlines() if "was not saved" in line]
    assert len(said) == 2, failed.stdout
    for step, line in zip((4, 6), said, strict=True):
        assert line.startswith(f"checkpoint: step {step} was not saved to {ckpt / f'step_{step}'}")
    expected = losses(tmp_path / "ref_out")
    assert losses(out) == expected and sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in ckpt.iterdir()) == FOLDER_AFTER_FAILURE

    resumed = entry_point(
        *flags, "--load", str(ckpt), "--save", str(ckpt), "--output_dir", str(out)
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / 'step_2'} at step 2" in resumed.stdout
    assert losses(out) == expected  # steps 3 to 6 trained again, each logged once
    # Weights, both AdamW moments and the RNG state, as the uninterrupted run saved them.
    data = "step_6/__0_0.distcp"
    assert (ckpt / data).read_bytes() == (tmp_path / "ref" / data).read_bytes()


def test_a_failure_is_the_disks_only_if_the_file_system_said_so():
    """DCP raises a rank's error wrapped in a CheckpointException (pickled from another rank,
    without the OSError PyTorch's writer raised over); a bug or a lost rank is no disk's."""
    from torch.distributed.checkpoint.api import CheckpointException

    from execution.checkpoint.disk import failure_reason
    from execution.parallel.collective_errors import CollectiveError

    cut_short = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/ckpt/step_4.tmp/__1_0.distcp")

    def from_rank(error: BaseException) -> CheckpointException:
        return CheckpointException("write", {1: (pickle.loads(pickle.dumps(error)), None)})

    assert failure_reason(from_rank(cut_short)) == (
        "the file system took only part of a write (PyTorch's writer: unexpected pos 704 vs 598)"
    )
    assert failure_reason(from_rank(quota)) == (
        "Disk quota exceeded: /ckpt/step_4.tmp/__1_0.distcp"
    )
    # On the rank itself, the writer's error was raised while PyTorch handled the OSError.
    on_the_rank = RuntimeError(*cut_short.args)
    on_the_rank.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert failure_reason(on_the_rank) == "No space left on device"
    assert failure_reason(from_rank(ValueError("a bug"))) is None
    assert failure_reason(RuntimeError("unexpected pos")) is None  # not PyTorch's writer
    lost = CollectiveError("checkpoint", (0, 1), False, 60.0)
    lost.__cause__ = from_rank(quota)
    assert failure_reason(lost) is None


@pytest.mark.slow
def test_a_run_whose_last_save_is_complete_ends_well_and_says_how_many_failed(tmp_path):
    flags = [*RUN_FLAGS, "--steps", "4", "--checkpoint_steps", "2"]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    with full_disk(lambda path: path.name == "__0_0.distcp" and path.parent.name == "step_2.tmp"):
        run = entry_point(*flags, "--save", str(ckpt), "--output_dir", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("was not saved") == 1
    assert run.stdout.splitlines()[-1] == (
        f"checkpoint: 1 of 2 saves failed; the newest intact checkpoint is {ckpt / 'step_4'}"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "run.json", "run.lock", "step_4"]

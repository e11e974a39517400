"""A ``--save`` or ``--output_dir`` folder belongs to one run: a new run given another run's
folder stops in one line (exit 2) and leaves every byte of it as it was; the run itself, resumed
with ``--load``, writes there again and appends to its metrics. An interrupted run says in one
line where it stopped and how to resume.

The reference is the folders' bytes before the refused commands.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.test_checkpoint import RUN_FLAGS, entry_point


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _steps(output_dir: Path) -> list[int]:
    rows = (json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "loss" in row]


@pytest.mark.slow
def test_another_runs_folders_are_refused_and_its_own_resume_appends(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = entry_point(*RUN_FLAGS, "--steps", "1", "--save", str(ckpt), "--output_dir", str(out))
    assert first.returncode == 0, first.stderr
    before = _snapshot(tmp_path)
    refused = {
        # Would replace its step_1 and move its latest back; pruning would delete by step.
        "save": (["--save", str(ckpt)], f"--save {ckpt} holds the checkpoints of another run"),
        "prune": (["--save", str(ckpt), "--keep_checkpoints", "1"], "belongs to one run"),
        "output": (["--output_dir", str(out)], f"{out} already holds the metrics.jsonl"),
    }
    for name, (flags, message) in refused.items():
        fresh = tmp_path / f"fresh-{name}"
        defaults = ["--output_dir", str(fresh), "--save", str(fresh / "ckpt")]
        result = entry_point(*RUN_FLAGS, "--steps", "1", *defaults, *flags)
        assert result.returncode == 2, (name, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert _snapshot(tmp_path) == before, name
        assert not fresh.exists(), name
    # The run itself resumes, with the same flags each time, appending to its metrics.
    resume = [*RUN_FLAGS, "--load", str(ckpt), "--save", str(ckpt), "--output_dir", str(out)]
    for steps in ("2", "3"):
        result = entry_point(*resume, "--steps", steps)
        assert result.returncode == 0, result.stderr
    assert _steps(out) == [1, 2, 3]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest",
        "run.json",
        "step_1",
        "step_2",
        "step_3",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_says_where_it_stopped_in_one_line_and_resumes(tmp_path, stop):
    """Ctrl-C or SIGTERM: one line naming the last step, the last complete checkpoint and how to
    resume (exit 128 + signal, no traceback); the suggested command resumes into the same
    folders."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    flags = [*RUN_FLAGS, "--steps", "100000", "--checkpoint_steps", "2"]
    flags += ["--save", str(ckpt), "--output_dir", str(out)]
    run = entry_point(*flags, popen=True)
    for line in run.stdout:
        if "checkpoint: saved step 2 " in line:
            break
    run.send_signal(stop)
    rest, _ = run.communicate(timeout=120)
    assert run.returncode == 128 + stop, rest
    # By the line's start: the test's own folder (test_an_interrupted_...) is in other lines.
    (last,) = [line for line in rest.splitlines() if line.startswith("run_pretraining.py: ")]
    match = re.fullmatch(
        r"run_pretraining.py: interrupted at step (\d+); the last complete checkpoint is step "
        r"(\d+) \((.*)\); resume with the same flags and --load (.*)",
        last,
    )
    assert match, rest
    assert "Traceback" not in rest
    done, saved = int(match[1]), int(match[2])
    assert saved >= 2 and done >= saved and match[3] == str(ckpt / f"step_{saved}")
    resumed = entry_point(*flags, "--load", match[4], "--steps", str(saved + 1))
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(out)[-1] == saved + 1

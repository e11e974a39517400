"""A rank that dies or stalls costs the job only the steps since its last checkpoint.

A real ``torchrun --max-restarts 1`` job of two gloo ranks has one rank killed (SIGKILL) in the
middle of a step; torchrun restarts it with the same command, which resumes on its own from the
newest checkpoint the job saved. The reference is the same command run uninterrupted: the
losses of every step are bitwise the same (float32 on the CPU; dropout masks are drawn from the
step). A rank that stalls ends every rank of a job after ``--collective_timeout``, each with one
line naming the phase and the group. The faults are the tests' own (tests/rank_faults.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import run_pretraining
from execution.training.entry import run_entry_point
from tests.checkpoint.test_checkpoint import RUN_FLAGS
from tests.distributed import HOST, host_store, published_port, run_ranks
from tests.entry_points import run_script
from tests.rank_faults import Fault, install

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TWO_RANKS = [*RUN_FLAGS, "--data_parallel", "2"]


def _losses(output_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"], row["grad_norm"]) for row in rows if "loss" in row]


def _torchrun(*words: str) -> subprocess.Popen:
    # --standalone binds a free port; stdout and stderr together, as a user sees them.
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", *words]
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_a_rank_killed_mid_step_costs_only_the_steps_since_the_last_checkpoint(tmp_path):
    """Killed in step 14 with checkpoints every 5 steps: the restart resumes from step 10 with
    the same flags (no --load), takes its folders again, and logs steps 11 to 16 once."""
    ckpt, out, reference = tmp_path / "ckpt", tmp_path / "out", tmp_path / "reference"
    flags = [*TWO_RANKS, "--steps", "16", "--checkpoint_steps", "5"]
    fault = Fault("kill", rank=1, step=14)
    job = ["--max-restarts", "1", "tests/fixtures/run_with_fault.py", str(fault)]
    killed = _torchrun(
        *job, "run_pretraining.py", *flags, "--save", str(ckpt), "--output_dir", str(out)
    )
    # The uninterrupted run, meanwhile: the same command in two ranks forked from this process
    # as torchrun's workers (no interpreter to start: seconds less than a second torchrun).
    folders = ["--save", str(reference / "ckpt"), "--output_dir", str(reference / "out")]
    ranks = run_ranks(_entry_point_rank, 2, reference, reference, [*flags, *folders], init=False)
    assert [rank["code"] for rank in ranks] == [0, 0], ranks
    output = killed.communicate(timeout=300)[0]
    assert killed.returncode == 0, output[-3000:]
    assert "exitcode: -9" in output, output[-3000:]  # torchrun saw the kill, and restarted
    restarted = re.search(
        r"restart of torchrun job \w+: the run goes on from its newest checkpoint, (.*)", output
    )
    assert restarted and restarted[1] == str(ckpt / "step_10"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    expected, got = _losses(reference / "out"), _losses(out)
    assert [step for step, *_ in got] == list(range(1, 17))  # each step once
    assert got == expected  # bitwise: float32 values through JSON's shortest repr
    runs = {json.loads((folder / "run.json").read_text())["run_id"] for folder in (ckpt, out)}
    trainer = json.loads((ckpt / "step_16" / "trainer.json").read_text())
    assert runs == {trainer["run_id"]}  # one run over both attempts


def _entry_point_rank(
    rank: int, folder: Path, flags: list[str], fault: Fault | None = None
) -> dict:
    """``run_pretraining.py FLAGS`` as torchrun's worker ``rank`` of 2 runs it (rank 0 hosts
    the store torchrun's agent would), with ``fault``: its exit code and stderr."""
    store = host_store(folder) if rank == 0 else None
    worker = {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2}
    os.environ.update({key: str(value) for key, value in worker.items()})
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=published_port(folder))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if fault is not None:
        install(fault)
    sys.argv = ["run_pretraining.py", *flags]
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            run_entry_point(run_pretraining.main, "run_pretraining.py")
            code = 0
        except SystemExit as stop:
            code = stop.code
    del store  # every rank is done with it: a rank uses the store only to join
    return {"code": code, "stderr": stderr.getvalue()}


def test_a_stalled_rank_ends_every_rank_after_the_collective_timeout(tmp_path):
    """Rank 1 sleeps 2 s longer than --collective_timeout 2 in the middle of step 3: rank 0's
    collective gives up after 2 s, and rank 1's next one finds rank 0 gone. Each says so in
    one line naming the step, the phase and the group, and exits 1; without the flag each
    would wait 30 minutes (run_ranks' 60 s would fail the test)."""
    out = tmp_path / "out"
    flags = [*TWO_RANKS, "--collective_timeout", "2", "--output_dir", str(out)]
    fault = Fault("stall", rank=1, step=3, seconds=4)
    results = run_ranks(
        _entry_point_rank, 2, tmp_path, tmp_path, flags, fault, init=False, timeout=60
    )
    waited = "waited longer than --collective_timeout 2 s: one of its ranks stalled or died"
    said = {0: waited, 1: "lost a rank: another process of the job ended"}
    for rank, result in enumerate(results):
        assert result["code"] == 1, result
        lines = result["stderr"].splitlines()
        assert len(lines) == 1, result["stderr"]
        where = r"step 3, \w+ phase( of layer 0)?: a collective of the dp group \(ranks 0, 1\)"
        pattern = rf"run_pretraining.py: error: rank {rank}: {where} {re.escape(said[rank])}"
        assert re.match(pattern, lines[0]), lines[0]
    assert [step for step, *_ in _losses(out)] == [1, 2]


def test_a_requeued_slurm_job_resumes_and_another_run_of_the_job_is_refused(tmp_path):
    """A requeue runs the batch script again under the same job and step ids, with
    SLURM_RESTART_COUNT 1: the same command resumes from the job's newest checkpoint. A
    second command of the same allocation (no restart) given the run's folders is another
    run, refused as any other would be."""
    ckpt, out, reference = tmp_path / "ckpt", tmp_path / "out", tmp_path / "reference"
    flags = [*RUN_FLAGS, "--checkpoint_steps", "2"]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    folders = ["--save", str(ckpt), "--output_dir", str(out)]
    fault = str(Fault("kill", rank=0, step=4))
    killed = run_script(
        "tests/fixtures/run_with_fault.py", fault, "run_pretraining.py", *flags, *folders, env=slurm
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    another = run_script("run_pretraining.py", *flags, *folders, env=slurm)
    assert another.returncode == 2, another.stderr
    assert f"{out} already holds the metrics.jsonl of another run" in another.stderr
    requeued = run_script(
        "run_pretraining.py", *flags, *folders, env={**slurm, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.returncode == 0, requeued.stderr
    newest = ckpt / "step_2"
    said = f"restart of slurm job 4242 step 0: the run goes on from its newest checkpoint, {newest}"
    assert said in requeued.stdout, requeued.stdout
    elsewhere = ["--save", str(reference / "ckpt"), "--output_dir", str(reference / "out")]
    uninterrupted = run_script("run_pretraining.py", *flags, *elsewhere)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert _losses(out) == _losses(reference / "out")  # steps 1 to 6 once each, bitwise


@pytest.mark.slow
def test_a_job_stopped_while_it_saves_ends_in_one_line_and_keeps_its_last_checkpoint(tmp_path):
    """Both ranks get SIGTERM twice (SLURM signals every process of a job, then torchrun's
    agent its workers) while step 2 is being written: rank 0 says the interrupted line naming
    step 2, which it commits, rank 1 says nothing (a save it began loses rank 0), and each
    exits 128 + SIGTERM with no traceback."""
    ckpt = tmp_path / "ckpt"
    flags = [*TWO_RANKS, "--steps", "100000", "--checkpoint_steps", "1"]
    flags += ["--save", str(ckpt)]
    flags += ["--output_dir", str(tmp_path / "out")]
    with socket.socket() as probe:  # a free port for rank 0's store, as torchrun finds one
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        worker = {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2}
        env = {**os.environ, **{key: str(value) for key, value in worker.items()}}
        env.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        # Each commit held 2 s (a test fault), so the stop lands while step 2 is written.
        slow = ["tests/fixtures/run_with_fault.py", "slow_commits:0:0:2"]
        command = [sys.executable, *slow, "run_pretraining.py", *flags]
        ranks.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 120
        while not ((ckpt / "step_1").is_dir() and (ckpt / "step_2.tmp" / ".metadata").exists()):
            assert all(rank.poll() is None for rank in ranks), [r.communicate()[0] for r in ranks]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        for again in (False, True):
            if again:
                time.sleep(0.5)  # the second lands while the ranks wind down
            for rank in ranks:
                if rank.poll() is None:
                    rank.send_signal(signal.SIGTERM)
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:  # a failed wait leaves no rank running
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 128 + signal.SIGTERM, output
        assert "Traceback" not in output, output
    said = [line for line in outputs[0].splitlines() if line.startswith("run_pretraining.py: ")]
    expected = (
        r"run_pretraining.py: interrupted at step \d+; the last complete checkpoint is step 2 "
        rf"\({re.escape(str(ckpt / 'step_2'))}\); resume with the same flags and --load "
        rf"{re.escape(str(ckpt))}"
    )
    assert len(said) == 1 and re.fullmatch(expected, said[0]), outputs[0]
    assert outputs[1] == "", outputs[1]
    assert (ckpt / "latest").read_text().strip() == "step_2"
    assert not (ckpt / "step_2.tmp").exists()

"""Joining a job from the launcher's environment, and the one-line errors of impossible layouts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from config.loading import ConfigError, parse_config
from execution.parallel.launch import setup_layout, teardown
from tests.distributed import HOST, host_store, layout_flags, published_port, run_ranks
from tests.entry_points import run_script

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ["--data_parallel", "2", "--tensor_parallel_1", "1", "--tensor_parallel_2", "2"]

# The (rank, world size, local rank) variables each launcher sets (README, "Running on several
# processes"; execution/parallel/launch.py reads them).
LAUNCHERS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


def launcher_env(launcher: str, rank: int, world_size: int) -> dict[str, str]:
    """What ``launcher`` exports to process ``rank`` of a single-node job."""
    rank_key, size_key, local_key = LAUNCHERS[launcher]
    return {rank_key: str(rank), size_key: str(world_size), local_key: str(rank)}


def _join_rank(rank: int, launcher: str, folder: Path) -> dict:
    """A rank as a launcher starts it: only environment variables say where it belongs."""
    # Rank 0 hosts the store that torchrun's agent would, so no port is fixed and none is raced
    # for; every rank, rank 0 included, joins it as a client. The pytest process must not host
    # it: the store's server thread formats each client's address with getnameinfo, under
    # glibc's resolver lock, and a rank forked while that lock was held inherited it locked
    # with no thread left to release it, hanging in its own getnameinfo when it connected.
    store = host_store(folder) if rank == 0 else None
    port = published_port(folder)
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
    config, _ = parse_config(["--config", "tiny", "--device", "cpu", *LAYOUT])
    layout, info = setup_layout(config, launcher_env(launcher, rank, 4))
    try:
        me = torch.tensor([float(layout.rank)])
        groups = {a.name: [int(v) for v in a.all_gather(me)] for a in layout.axes()}
        return {
            "rank": info.rank,
            "world": info.world_size,
            "launcher": info.launcher,
            "global_rank": dist.get_rank(),
            "groups": groups,
        }
    finally:
        teardown()
        # Every rank is done with the store once rank 0 is here: a rank uses it only to join
        # and build its groups, before the "world" all_gather that rank 0 has just completed.
        del store


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_variables_build_the_layout(tmp_path, launcher):
    """setup_layout joins the job and builds the (dp 2, tp1 1, tp2 2) groups of the mesh
    (docs/design.md, "The mesh and the rank formula")."""
    results = run_ranks(_join_rank, 4, tmp_path, launcher, tmp_path, init=False)
    expected_groups = {
        "dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "tp1": [[0], [1], [2], [3]],
        "tp2": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "dp_tp1": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_tp2": [[0, 1, 2, 3]] * 4,
        "world": [[0, 1, 2, 3]] * 4,
    }
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"], result["global_rank"]) == (rank, 4, rank)
        assert result["launcher"] == {"openmpi": "mpiexec", "mpich": "mpiexec"}.get(
            launcher, launcher
        )
        for axis, groups in expected_groups.items():
            assert result["groups"][axis] == groups[rank], (rank, axis)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_world_size_mismatch_is_one_line_before_joining(launcher):
    config, _ = parse_config(["--config", "tiny", "--device", "cpu", *LAYOUT])
    with pytest.raises(ConfigError) as err:
        setup_layout(config, launcher_env(launcher, 0, 2))
    message = str(err.value)
    assert "\n" not in message
    assert "= 4 processes, but the job has 2" in message
    assert not dist.is_initialized()


def test_entry_point_reports_world_size_mismatch_in_one_line(tmp_path):
    """What a user sees from each rank of ``torchrun --nproc_per_node 2 ... --data_parallel 4``:
    one line from rank 0; rank 1, which finds the same error, exits 2 without repeating it."""
    batch = ["--micro_batch_size", "2", "--global_batch_size", "8"]
    flags = ["--config", "tiny", "--data_parallel", "4", *batch]
    flags += ["--output_dir", str(tmp_path / "run")]
    other = run_script("run_pretraining.py", *flags, env=launcher_env("torchrun", 1, 2))
    assert (other.returncode, other.stderr) == (2, "")
    proc = run_script("run_pretraining.py", *flags, env=launcher_env("torchrun", 0, 2))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "run_pretraining.py: error: --data_parallel 4 x --tensor_parallel_1 1 x "
        "--tensor_parallel_2 1 = 4 processes, but the job has 2; launch 4 processes "
        "(e.g. torchrun --nproc_per_node 4) or change the layout flags (--dry_run checks "
        "this layout in one process; --plan_for 2 lists layouts of 2)"
    ]
    assert not (tmp_path / "run").exists(), "no work before the error"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--heads", "4", "--tensor_parallel_1", "3"],
            "--heads 4 is not divisible by --tensor_parallel_1 3",
        ),
        (
            ["--hidden_size", "128", "--tensor_parallel_2", "3"],
            "--hidden_size 128 is not divisible by --tensor_parallel_2 3",
        ),
    ],
)
def test_impossible_split_is_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", "tiny", *flags])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_torchrun_trains_the_tiny_preset_like_one_process(tmp_path):
    """torchrun with 2 ranks (dp 2) on the shipped data gives the loss curve of one process:
    the real launcher, its environment, the loader's shards and the entry point, dropout 0,
    float32. (Every layout up to 2 x 2 x 2 is compared with one process in forked ranks,
    test_distributed_parity.py; each further interpreter importing torch on two cores would
    cost this test 4 s more.)"""
    deterministic = ["--dropout_prob", "0", "--precision", "float32"]
    flags = ["--config", "tiny", "--steps", "2", *deterministic, "--device", "cpu"]
    single = tmp_path / "single"
    alone = run_script("run_pretraining.py", *flags, "--output_dir", str(single))
    assert alone.returncode == 0, alone.stderr
    two = tmp_path / "two"
    # --standalone rendezvous binds a free port (localhost:0): nothing is fixed.
    launch = ["torchrun", "--standalone", "--nproc_per_node", "2", "run_pretraining.py"]
    command = [*launch, *flags, *layout_flags(2, 1, 1), "--output_dir", str(two)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curves = _metrics(two / "metrics.jsonl"), _metrics(single / "metrics.jsonl")
    for got, want in zip(*curves, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails")
    dist.barrier()  # the other ranks wait for rank 1 forever unless someone stops them


def test_a_failing_rank_fails_the_job_with_its_traceback(tmp_path):
    """The harness itself: a rank's exception reaches the test at once, nobody hangs."""
    with pytest.raises(AssertionError, match="rank one fails"):
        run_ranks(_raise_on_rank_one, 4, tmp_path, timeout=60)

"""What a restarted job knows of itself, in one process: the namespace each attempt's process
groups use in torchrun's agent store, the job's id and restart from the launchers' variables,
and which errors of a collective are the one-line kind.

The agent store is stood in for by an in-memory store that the ranks (threads here) share, as
torchrun's workers share the agent's over every attempt of a job.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from config.loading import ConfigError
from execution.parallel.collective_errors import CollectiveError, communicating, failure_kind
from execution.parallel.launch import read_launch_environment
from execution.parallel.rendezvous import fresh_namespace, job_of_torchrun


def _attempt(store: dist.Store, world_size: int, order=None) -> dict[int, str]:
    """Each rank's namespace for one attempt of a job, its ranks started in ``order``."""
    namespaces: dict[int, str] = {}

    def join(rank: int) -> None:
        namespaces[rank] = fresh_namespace(store, rank, world_size, timeout_s=10)

    threads = [threading.Thread(target=join, args=(r,)) for r in order or range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(namespaces) == list(range(world_size)), "a rank did not join"
    return namespaces


def _store(timeout_s: float = 10) -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def test_every_attempt_agrees_on_a_namespace_no_earlier_attempt_used():
    """The dead attempts' keys stay in the store; a rank that read one of them would join the
    dead attempt's groups. One dead attempt lost rank 0 before it answered rank 2."""
    store = _store()
    first = set(_attempt(store, 3).values())
    store.set("gpt3_phased/nonce/2", "a dead attempt's, never answered")
    second = set(_attempt(store, 3).values())
    third = set(_attempt(store, 3, order=[1, 2, 0]).values())  # rank 0 last this time
    assert len(first) == len(second) == len(third) == 1
    assert len(first | second | third) == 3


def test_a_rank_that_never_joins_is_a_timeout_on_rank_0():
    store = _store(timeout_s=2)
    threading.Thread(target=fresh_namespace, args=(store, 1, 3, 10), daemon=True).start()
    while not store.check(["gpt3_phased/nonce/1"]):  # rank 1 is there, rank 2 never comes
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"^timed out waiting for rank\(s\) 2 to join$"):
        fresh_namespace(store, 0, 3, timeout_s=0.5)


def test_torchruns_job_id_is_set_once_and_a_restart_finds_it():
    store = dist.HashStore()
    job, earlier = job_of_torchrun(store)
    assert job.startswith("torchrun job ") and not earlier
    assert job_of_torchrun(store) == (job, True)


@pytest.mark.parametrize(
    ("env", "job", "restarted"),
    [
        ({}, None, False),
        ({"SLURM_JOB_ID": "7"}, "slurm job 7 step batch", False),
        (
            {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"},
            "slurm job 7 step 0",
            True,
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_CLUSTER_NAME": "c1"},
            "slurm job 7 step batch of cluster c1",
            False,
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_JOB_ID": "7"}, "slurm job 7 step batch", False),
    ],
)
def test_slurm_names_the_job_over_its_requeues(env, job, restarted):
    info = read_launch_environment(env)
    assert (info.job_id, info.restarted) == (job, restarted)


def test_a_bad_restart_count_is_one_line():
    with pytest.raises(ConfigError, match=r"^SLURM_RESTART_COUNT='x' is not a count$"):
        read_launch_environment({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "x"})


# What gloo and the store raised when a peer stalled or died (torch 2.13 on the CPU).
GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv"
GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2261."
GLOO_RESET = "[../pair.cc:537] Read error [127.0.0.1]:25306: Connection reset by peer."
STORE_TIMEOUT = "wait timeout after 2000ms, keys: /gpt3_phased/answer/0f3a"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (GLOO_TIMEOUT, "timed out"),
        (STORE_TIMEOUT, "timed out"),
        (GLOO_CLOSED, "lost"),
        (GLOO_RESET, "lost"),
        ("shapes [3] and [4] do not match", None),
    ],
)
def test_only_a_stalled_or_lost_rank_becomes_one_line(message, kind):
    assert failure_kind(RuntimeError(message)) == kind
    raised = CollectiveError if kind else RuntimeError
    with pytest.raises(raised) as err, communicating("dp", (0, 1), 2.0):
        raise RuntimeError(message)
    if kind:
        err.value.during("layer_forward phase of layer 1").during("step 3")
        line = str(err.value)
        assert line.startswith("step 3, layer_forward phase of layer 1: a collective of the dp")
        assert "\n" not in line

"""Joining a job through torchrun's agent store, which outlives the job's restarts.

torchrun's agent hosts one TCP store for the whole torchrun command and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``, the store at ``MASTER_ADDR:MASTER_PORT``). It keeps that
store over ``--max-restarts`` restarts, and torch 2.13's ``env://`` no longer puts the keys of
each attempt under a prefix of their own (older versions used the restart count, which is each
node's agent's own count and differs between nodes after one node's failure). So a restarted
attempt finds the dead attempt's keys under the names its own process groups use: gloo reads a
peer's address and port from the store, and a rank that reads the stale one before its peer
has replaced it connects to a dead process ("Gloo connectFullMesh failed ... Connection
refused"), in ``init_process_group`` or any later ``new_group``.

Every attempt therefore first agrees on a namespace no earlier attempt used
(:func:`fresh_namespace`) and keeps all of its process groups' keys under it. The same store
tells a restart that it is one (:func:`job_of_torchrun`).
"""

from __future__ import annotations

import datetime
import time
import uuid

import torch.distributed as dist

_KEYS = "gpt3_phased"  # this program's keys in a store it shares with torchrun's agent
_JOB_KEY = f"{_KEYS}/job"
_POLL_S = 0.01


def agent_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the agent's store (which waits ``timeout_s`` for a key it reads)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def job_of_torchrun(store: dist.Store) -> tuple[str, bool]:
    """This torchrun command's id, and whether an earlier attempt of it set it (this attempt is
    a restart). Rank 0's to call: the first attempt's rank 0 sets it."""
    mine = f"torchrun job {uuid.uuid4().hex}"
    job = store.compare_set(_JOB_KEY, "", mine).decode()
    return job, job != mine


def job_store(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """``store`` under a namespace of this attempt's own, for ``init_process_group``."""
    return dist.PrefixStore(f"{_KEYS}/{fresh_namespace(store, rank, world_size, timeout_s)}", store)


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """A namespace that every rank of this attempt agrees on and no earlier attempt used.

    The store may hold any key of a dead attempt, so nothing read under a fixed name is known
    to be fresh. A rank's own random nonce is: each rank but 0 publishes one under its rank
    and waits for the answer filed under the nonce itself, which only a live rank 0 can have
    written. Rank 0 draws the namespace, answers every nonce it finds (a dead attempt's too,
    harmlessly) until each rank has confirmed under the new namespace.

    Raises:
        RuntimeError: a rank did not join within ``timeout_s`` (the store's own wait raises
            on the other ranks).
    """
    if rank:
        nonce = uuid.uuid4().hex
        store.set(f"{_KEYS}/nonce/{rank}", nonce)
        namespace = store.get(f"{_KEYS}/answer/{nonce}").decode()
        store.set(f"{_KEYS}/{namespace}/joined/{rank}", "1")
        return namespace
    namespace = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    waiting, answered = set(range(1, world_size)), set()
    while waiting:
        for other in sorted(waiting):
            if store.check([f"{_KEYS}/{namespace}/joined/{other}"]):
                waiting.discard(other)
            elif store.check([f"{_KEYS}/nonce/{other}"]):
                nonce = store.get(f"{_KEYS}/nonce/{other}").decode()
                if nonce not in answered:
                    store.set(f"{_KEYS}/answer/{nonce}", namespace)
                    answered.add(nonce)
        if waiting and time.monotonic() > deadline:
            ranks = ", ".join(str(r) for r in sorted(waiting))
            raise RuntimeError(f"timed out waiting for rank(s) {ranks} to join")
        if waiting:
            time.sleep(_POLL_S)
    return namespace

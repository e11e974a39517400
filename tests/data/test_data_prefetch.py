"""The background prefetcher: same batches, positions of the consumed batches, errors, shutdown.

The reference is always the plain :class:`PretrainingDataLoader` driven by hand.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from data.errors import DataError
from data.loader import SAMPLE_DATA_GLOB, PretrainingDataLoader
from data.prefetch import PrefetchingLoader
from tests.data.data_sets import REPO_ROOT, write_numbered_shards

SEQ = 8
LENGTH = 2 * SEQ + 1  # two windows per record
VOCAB = 10**6


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    directory = tmp_path_factory.mktemp("numbered")
    write_numbered_shards(directory, [7, 5, 9], LENGTH)  # 42 windows: epochs cross batches
    return str(directory / "*.tfrecord")


def make(files, **kwargs):
    return PretrainingDataLoader([files], SEQ, 12, 2, 0, 1, 3, VOCAB, **kwargs)


@pytest.mark.parametrize("depth", [1, 3])
def test_same_batches_and_positions_as_the_plain_loader(numbered, depth):
    plain = make(numbered)
    with PrefetchingLoader(make(numbered), depth=depth) as prefetched:
        assert prefetched.state_dict() == plain.state_dict()
        for k in range(1, 9):  # 8 steps of 12 windows: more than two epochs
            assert torch.equal(prefetched.next_batch(), plain.next_batch()), k
            # The wrapped loader is ahead; what the wrapper reports is the plain loader's after k.
            assert prefetched.state_dict() == plain.state_dict()
            assert prefetched.state_dict()["step"] == k
            assert prefetched.epoch == plain.epoch
            assert prefetched.skipped_records == plain.skipped_records == 0


def test_the_sample_data_arrives_unchanged():
    def sample():
        return PretrainingDataLoader([SAMPLE_DATA_GLOB], 128, 8, 4, 0, 1, 42, 50257)

    plain = sample()
    with PrefetchingLoader(sample()) as prefetched:
        for _ in range(4):
            assert torch.equal(prefetched.next_batch(), plain.next_batch())


def test_resuming_from_a_prefetching_loaders_state(numbered):
    with PrefetchingLoader(make(numbered), depth=2) as first:
        for _ in range(3):
            first.next_batch()
        saved = first.state_dict()  # a checkpoint taken after 3 steps
        fourth = first.next_batch()
    plain = make(numbered)
    plain.load_state_dict(saved)
    with PrefetchingLoader(make(numbered), depth=2) as resumed:
        resumed.next_batch()  # reads ahead before the state is loaded: must be discarded
        resumed.load_state_dict(saved)
        assert resumed.state_dict() == saved
        assert torch.equal(resumed.next_batch(), fourth)
        assert torch.equal(fourth, plain.next_batch())


def test_skipped_records_count_only_consumed_batches(tmp_path):
    paths = write_numbered_shards(tmp_path, [6, 6], LENGTH)
    raw = bytearray(paths[1].read_bytes())
    raw[len(raw) // 2] ^= 0x40  # a record in the middle of the second shard: CRC mismatch
    paths[1].write_bytes(bytes(raw))
    files = str(tmp_path / "*.tfrecord")
    plain = make(files, skip_corrupt_records=True)
    with PrefetchingLoader(make(files, skip_corrupt_records=True)) as prefetched:
        counts = []
        for _ in range(4):
            assert torch.equal(prefetched.next_batch(), plain.next_batch())
            assert prefetched.skipped_records == plain.skipped_records
            assert prefetched.state_dict() == plain.state_dict()
            counts.append(plain.skipped_records)
    assert counts[-1] >= 1  # the corrupt record was met (and counted) at some step


class FailingLoader:
    """Yields batches 0, 1, ... and raises ``error`` when reading batch ``fail_at``."""

    def __init__(self, fail_at: int, delay: float = 0.0):
        self.fail_at, self.delay, self.step = fail_at, delay, 0
        self.error = DataError("record 7 of data_0003.tfrecord: CRC mismatch")
        self.reader_threads: set[str] = set()

    def next_batch(self) -> torch.Tensor:
        self.reader_threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if self.step == self.fail_at:
            raise self.error
        self.step += 1
        return torch.full((1, 1, 3), self.step - 1)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def test_a_read_error_reaches_the_step_that_needs_the_batch():
    inner = FailingLoader(fail_at=2)
    prefetched = PrefetchingLoader(inner)
    assert int(prefetched.next_batch().flatten()[0]) == 0
    assert int(prefetched.next_batch().flatten()[0]) == 1  # batch 2 is being read meanwhile
    with pytest.raises(DataError) as raised:
        prefetched.next_batch()
    assert raised.value is inner.error  # the same exception object, traceback included
    assert prefetched.state_dict() == {"step": 2}  # batch 2 was never consumed
    assert inner.reader_threads and threading.current_thread().name not in inner.reader_threads
    inner.fail_at = None  # the file was repaired: the same batch is read again
    assert int(prefetched.next_batch().flatten()[0]) == 2
    prefetched.close()


def test_close_waits_only_for_the_read_in_progress():
    prefetched = PrefetchingLoader(FailingLoader(fail_at=None, delay=0.3), depth=4)
    prefetched.next_batch()
    started = time.perf_counter()
    prefetched.close()  # 3 or 4 reads are queued; only the running one is waited for
    assert time.perf_counter() - started < 1.0
    prefetched.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        prefetched.next_batch()


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_a_process_that_never_closes_the_prefetcher_still_exits():
    code = (
        "from data.loader import SAMPLE_DATA_GLOB, PretrainingDataLoader\n"
        "from data.prefetch import PrefetchingLoader\n"
        "p = PrefetchingLoader(PretrainingDataLoader([SAMPLE_DATA_GLOB], 128, 8, 4, 0, 1, 1, "
        "50257), depth=2)\n"
        "p.next_batch()\n"
        "print('done')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        PrefetchingLoader(FailingLoader(fail_at=None), depth=0)


def test_batches_are_pinned_when_asked(numbered):
    if not torch.cuda.is_available():
        pytest.skip("pinning needs CUDA")
    with PrefetchingLoader(make(numbered), pin_memory=True) as prefetched:
        batch = prefetched.next_batch()
    assert batch.is_pinned() and np.array_equal(batch.numpy(), make(numbered).next_batch().numpy())

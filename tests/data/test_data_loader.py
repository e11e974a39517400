"""The training loader: rank sharding, epoch coverage, layout invariance, resumption, validation.

The data sets are "numbered": record g holds ids g*L .. g*L+L-1, so each loaded row is checked
against the window it must be, computed by hand from its first id.
"""

import itertools
import json

import numpy as np
import pytest
import torch

from data.loader import (
    SAMPLE_DATA_GLOB,
    SAMPLE_VALIDATION_GLOB,
    DataError,
    PretrainingDataLoader,
    validation_batches,
)
from data.prefetch import PrefetchingLoader
from tests.data.data_sets import write_numbered_shards

SEQ = 8
RECORD_LENGTH = 2 * SEQ + 1  # two windows per record
RECORDS = [7, 5, 9, 9]  # 30 records, 60 windows: epochs do not align with the global batch
NUM_WINDOWS = 2 * sum(RECORDS)
VOCAB = 10**6
GBS, MBS = 24, 2  # GA = 12, 6, 4, 3 for 1, 2, 3, 4 replicas


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    directory = tmp_path_factory.mktemp("numbered")
    write_numbered_shards(directory, RECORDS, RECORD_LENGTH)
    return str(directory / "*.tfrecord")


def window_id(row: torch.Tensor) -> int:
    """Which window a row is, from its first id, after checking the row is that window exactly."""
    record, offset = divmod(int(row[0]), RECORD_LENGTH)
    assert offset % SEQ == 0 and offset + SEQ < RECORD_LENGTH, f"row starts mid-window: {offset}"
    expected = record * RECORD_LENGTH + offset + np.arange(SEQ + 1)
    assert row.tolist() == expected.tolist()
    return 2 * record + offset // SEQ


def flat(lists):
    return list(itertools.chain.from_iterable(lists))


def loader(files, rank=0, size=1, seed=5, **kwargs):
    return PretrainingDataLoader(files, SEQ, GBS, MBS, rank, size, seed, VOCAB, **kwargs)


def global_batches(files, world_size, steps, seed=5):
    """Window ids of each step's global batch: ranks' rows concatenated in rank order."""
    ranks = [loader(files, r, world_size, seed) for r in range(world_size)]
    out = []
    for _ in range(steps):
        rows = []
        for rank in ranks:
            batch = rank.next_batch()
            assert batch.shape == (GBS // (MBS * world_size), MBS, SEQ + 1)
            assert batch.dtype == torch.int64
            rows.append([window_id(r) for r in batch.reshape(-1, SEQ + 1)])
        out.append(rows)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_each_epoch_once(numbered, world_size):
    steps = 10  # 240 sequences: 4 whole epochs of 60, epoch boundaries inside batches
    batches = global_batches(numbered, world_size, steps)
    # (window, rank) in global order: step by step, each rank's rows in rank order.
    stream = [(w, rank) for step in batches for rank, rows in enumerate(step) for w in rows]
    assert len(stream) == steps * GBS
    for epoch in range(len(stream) // NUM_WINDOWS):
        seen = stream[epoch * NUM_WINDOWS : (epoch + 1) * NUM_WINDOWS]
        per_rank = [{w for w, r in seen if r == rank} for rank in range(world_size)]
        assert sum(len(s) for s in per_rank) == NUM_WINDOWS, f"epoch {epoch}: a window repeats"
        assert set().union(*per_rank) == set(range(NUM_WINDOWS)), f"epoch {epoch}: not covered"


def test_global_batch_is_the_same_for_every_layout(numbered):
    reference = [flat(step) for step in global_batches(numbered, 1, 6)]
    for world_size in (2, 3, 4):
        assert [flat(step) for step in global_batches(numbered, world_size, 6)] == reference


def test_shuffle_depends_on_seed_and_epoch_only(numbered):
    first = [flat(s) for s in global_batches(numbered, 1, 5, seed=5)]
    again = [flat(s) for s in global_batches(numbered, 1, 5, seed=5)]
    other = [flat(s) for s in global_batches(numbered, 1, 5, seed=6)]
    assert first == again and first != other
    stream = flat(first)
    assert stream[:NUM_WINDOWS] != stream[NUM_WINDOWS : 2 * NUM_WINDOWS]  # reshuffled per epoch
    assert stream[:NUM_WINDOWS] != sorted(stream[:NUM_WINDOWS])  # shuffled at all


def test_argument_order_of_files_does_not_change_the_data(numbered, tmp_path):
    files = sorted(__import__("glob").glob(numbered))
    a = loader(files).next_batch()
    b = loader([*reversed(files), files[0]]).next_batch()
    assert torch.equal(a, b)


@pytest.mark.parametrize("resume_world_size", [2, 4])
def test_resume_after_k_batches_equals_uninterrupted_run(numbered, resume_world_size):
    world_size, k, total = 2, 3, 8
    uninterrupted = global_batches(numbered, world_size, total)
    ranks = [loader(numbered, r, world_size) for r in range(world_size)]
    for _ in range(k):
        for rank in ranks:
            rank.next_batch()
    state = json.loads(json.dumps(ranks[0].state_dict()))  # as a checkpoint stores it
    assert state["step"] == k
    resumed = [loader(numbered, r, resume_world_size) for r in range(resume_world_size)]
    for rank in resumed:
        rank.load_state_dict(state)
        assert rank.epoch == k * GBS // NUM_WINDOWS
    for step in range(k, total):
        rows = [window_id(r) for rank in resumed for r in rank.next_batch().reshape(-1, SEQ + 1)]
        assert rows == flat(uninterrupted[step])


@pytest.mark.parametrize("resume_world_size", [2, 8])
def test_a_position_saved_at_dp_4_resumes_at_dp_2_and_8_on_the_same_global_batches(
    numbered, resume_world_size
):
    """Through the prefetching wrapper the training loop uses: the saved position is the
    batches consumed, not those read ahead, and it is a global step, so any number of
    replicas continues with the global batches an uninterrupted run reads."""
    k, total, micro = 3, 7, 1

    def replicas(size):
        return [
            PrefetchingLoader(PretrainingDataLoader(numbered, SEQ, GBS, micro, r, size, 5, VOCAB))
            for r in range(size)
        ]

    def global_rows(ranks):
        return [window_id(row) for rank in ranks for row in rank.next_batch().reshape(-1, SEQ + 1)]

    single = replicas(1)
    uninterrupted = [global_rows(single) for _ in range(total)]
    saved = replicas(4)
    for step in range(k):
        assert global_rows(saved) == uninterrupted[step]
    state = json.loads(json.dumps(saved[0].state_dict()))  # as a checkpoint stores it
    resumed = replicas(resume_world_size)
    for rank in resumed:
        rank.load_state_dict(state)
    for step in range(k, total):
        assert global_rows(resumed) == uninterrupted[step], step
    for rank in (*single, *saved, *resumed):
        rank.close()


def test_resume_refuses_other_data_seed_or_batch(numbered, tmp_path):
    state = loader(numbered).state_dict()
    with pytest.raises(DataError, match="checkpoint has seed 5, this run has 6"):
        loader(numbered, seed=6).load_state_dict(state)
    other = write_numbered_shards(tmp_path, [30], RECORD_LENGTH)
    with pytest.raises(DataError, match="data files are not the ones the checkpoint") as err:
        loader([str(other[0])]).load_state_dict(state)
    assert state["data_digest"] not in str(err.value)


def test_records_split_into_windows_for_shorter_sequences(tmp_path):
    # Records of 1025 ids (as the sample) serve (1025 - 1) // seq windows sharing boundary ids.
    write_numbered_shards(tmp_path, [3], 1025)
    files = [str(tmp_path / "*.tfrecord")]
    for seq in (128, 256, 512, 1024):
        per_record = 1024 // seq
        data = PretrainingDataLoader(files, seq, 3 * per_record, 1, 0, 1, 0, VOCAB)
        assert data.samples_per_epoch == 3 * per_record
        rows = data.next_batch().reshape(-1, seq + 1)
        expected = {
            tuple(range(r * 1025 + w * seq, r * 1025 + w * seq + seq + 1))
            for r in range(3)
            for w in range(per_record)
        }
        assert {tuple(row.tolist()) for row in rows} == expected


def test_batch_layout_errors(numbered):
    with pytest.raises(DataError, match=r"global_batch_size 24 is not a multiple of .* = 10"):
        PretrainingDataLoader([numbered], SEQ, 24, 2, 0, 5, 0, VOCAB)
    with pytest.raises(DataError, match="data_parallel_rank 2 not in"):
        PretrainingDataLoader([numbered], SEQ, 24, 2, 2, 2, 0, VOCAB)
    assert loader(numbered, 0, 4).gradient_accumulation == 3


def test_validation_fraction_holds_out_whole_records_disjoint_from_training(numbered):
    train = loader(numbered, validation_fraction=0.2)
    assert train.samples_per_epoch == NUM_WINDOWS - 2 * 6  # 6 of 30 records held out
    steps = -(-train.samples_per_epoch // GBS)
    trained = {window_id(r) for _ in range(steps) for r in train.next_batch().reshape(-1, SEQ + 1)}
    held = [
        window_id(r)
        for b in validation_batches([numbered], SEQ, 2, 0, 1, VOCAB, None, validation_fraction=0.2)
        for r in b
    ]
    assert len(held) == 12 and not trained & set(held)
    assert trained | set(held) == set(range(NUM_WINDOWS))
    assert {w // 2 for w in held} == {w // 2 for w in held[::2]}  # records held whole


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_batches_split_a_fixed_order_across_ranks(numbered, world_size):
    mbs = 2
    per_rank = [
        [
            [window_id(r) for r in b]
            for b in validation_batches([numbered], SEQ, mbs, rank, world_size, VOCAB, None)
        ]
        for rank in range(world_size)
    ]
    num_batches = NUM_WINDOWS // (mbs * world_size)
    assert all(len(batches) == num_batches for batches in per_rank)
    in_order = [w for b in range(num_batches) for rank in per_rank for w in rank[b]]
    assert in_order == list(range(num_batches * mbs * world_size))  # file order, dealt by rank
    limited = list(validation_batches([numbered], SEQ, mbs, 0, world_size, VOCAB, 2))
    assert len(limited) == 2


def test_validation_set_smaller_than_one_batch_is_an_error(numbered):
    with pytest.raises(DataError, match="fewer than one batch over all ranks"):
        validation_batches([numbered], SEQ, 31, 0, 2, VOCAB, None)


def test_shipped_sample_serves_the_tiny_model():
    for seq in (128, 2048):  # the tiny preset and the paper presets
        data = PretrainingDataLoader([SAMPLE_DATA_GLOB], seq, 8, 2, 1, 2, 0, 50257)
        batch = data.next_batch()
        assert batch.shape == (2, 2, seq + 1) and int(batch.max()) < 50257
        assert data.samples_per_epoch == 67 * (2048 // seq)
    batches = list(validation_batches([SAMPLE_VALIDATION_GLOB], 128, 4, 0, 1, 50257, None))
    assert len(batches) == 6 * 16 // 4

"""Bad input: each case gives a clear DataError naming the file and record, or is skipped and counted."""

import json
import re
import struct

import numpy as np
import pytest

from data.loader import DataError, PretrainingDataLoader, validation_batches
from data.tfrecord_io import (
    encode_example,
    frame_record,
    index_path_for,
    scan_records,
    write_index,
)
from tests.data.data_sets import numbered_record, write_numbered_shards

SEQ = 8
LENGTH = SEQ + 1
VOCAB = 10**6


def make(tmp_path, records=(4, 4)):
    paths = write_numbered_shards(tmp_path, list(records), LENGTH)
    return paths, str(tmp_path / "*.tfrecord")


def read_all(files, vocab=VOCAB, skip=False):
    """Every window once, in file order."""
    batches = list(
        validation_batches([files], SEQ, 1, 0, 1, vocab, None, skip_corrupt_records=skip)
    )
    return [b[0].tolist() for b in batches]


def replace_record(path, number, ids=None, data=None):
    """Rewrite record `number` of a shard (keeping the others) and its index."""
    entries = [
        tuple(map(int, line.split())) for line in index_path_for(path).read_text().splitlines()
    ]
    raw = path.read_bytes()
    records = [raw[o : o + s] for o, s in entries]
    records[number] = frame_record(data if data is not None else encode_example(np.asarray(ids)))
    path.write_bytes(b"".join(records))
    write_index(scan_records(path), index_path_for(path))


def flip_byte(path, position):
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x40
    path.write_bytes(bytes(raw))


def record_offset(path, number):
    return int(index_path_for(path).read_text().splitlines()[number].split()[0])


def test_empty_file_list():
    with pytest.raises(DataError, match="no input files given"):
        PretrainingDataLoader([], SEQ, 2, 1, 0, 1, 0, VOCAB)


def test_missing_file_and_empty_glob(tmp_path):
    with pytest.raises(
        DataError, match=re.escape(f"input file {tmp_path}/nope.tfrecord does not exist")
    ):
        PretrainingDataLoader([str(tmp_path / "nope.tfrecord")], SEQ, 2, 1, 0, 1, 0, VOCAB)
    with pytest.raises(
        DataError, match=re.escape(f"input pattern {tmp_path}/*.tfrecord matches no files")
    ):
        PretrainingDataLoader([str(tmp_path / "*.tfrecord")], SEQ, 2, 1, 0, 1, 0, VOCAB)


def test_missing_index_says_how_to_make_one(tmp_path):
    paths, files = make(tmp_path)
    index_path_for(paths[1]).unlink()
    with pytest.raises(
        DataError,
        match=r"data_0001.tfrecord has no index file data_0001.index: create it with python data/index_tfrecord.py",
    ):
        read_all(files)


def test_truncated_file_names_the_record(tmp_path):
    paths, files = make(tmp_path)
    paths[0].write_bytes(paths[0].read_bytes()[:-5])
    with pytest.raises(
        DataError, match=r"data_0000.tfrecord record 3 \(byte offset \d+\) is truncated"
    ):
        read_all(files)
    data = PretrainingDataLoader([files], SEQ, 7, 1, 0, 1, 0, VOCAB, skip_corrupt_records=True)
    assert data.samples_per_epoch == 7 and data.skipped_records == 1
    assert sorted(data.next_batch().reshape(-1, LENGTH)[:, 0].tolist()) == [
        n * LENGTH for n in range(8) if n != 3
    ]


def test_stale_index(tmp_path):
    paths, files = make(tmp_path)
    paths[0].write_bytes(paths[0].read_bytes() + frame_record(encode_example(np.arange(LENGTH))))
    with pytest.raises(DataError, match="the index is stale, rebuild it"):
        read_all(files)


@pytest.mark.parametrize(
    ("where", "message"),
    [(2, "CRC mismatch in the length header"), (20, "CRC mismatch in the data")],
)
def test_crc_mismatch_names_file_and_record(tmp_path, where, message):
    paths, files = make(tmp_path)
    flip_byte(paths[1], record_offset(paths[1], 2) + where)
    with pytest.raises(
        DataError, match=rf"data_0001.tfrecord record 2 \(byte offset \d+\) .*{message}"
    ):
        read_all(files)


def test_wrong_feature_name(tmp_path):
    paths, files = make(tmp_path)
    replace_record(paths[0], 1, data=encode_example(np.arange(LENGTH), feature_name="text"))
    with pytest.raises(
        DataError,
        match=r"data_0000.tfrecord record 1 .*no feature 'input_ids' \(features found: 'text'\)",
    ):
        read_all(files)


def test_wrong_record_length(tmp_path):
    paths, files = make(tmp_path)
    replace_record(paths[1], 3, ids=np.arange(LENGTH + 4))
    with pytest.raises(
        DataError,
        match=r"data_0001.tfrecord record 3 .*has 13 tokens but the first record of this file has 9",
    ):
        read_all(files)


def test_token_ids_outside_the_vocabulary(tmp_path):
    paths, files = make(tmp_path)
    ids = numbered_record(5, LENGTH)
    ids[4] = 50257
    replace_record(paths[1], 1, ids=ids)
    with pytest.raises(
        DataError,
        match=r"data_0001.tfrecord record 1 .*token id 50257 at position 4, outside the model's vocabulary \[0, 50257\)",
    ):
        read_all(files, vocab=50257)


def test_records_shorter_than_the_sequence(tmp_path):
    _, files = make(tmp_path)
    with pytest.raises(
        DataError,
        match=r"record 0 .*has 9 tokens, fewer than sequence_length \+ 1 = 17: re-run write_into_tfrecord.py with --seq-length >= 16",
    ):
        PretrainingDataLoader([files], 16, 2, 1, 0, 1, 0, VOCAB)


def test_metadata_with_a_larger_vocabulary_fails_early(tmp_path):
    _, files = make(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"vocab_size": 50257}))
    with pytest.raises(
        DataError,
        match=r"metadata.json: the data was tokenised with a vocabulary of 50257 tokens but the model's vocab_size is 1000",
    ):
        PretrainingDataLoader([files], SEQ, 2, 1, 0, 1, 0, 1000)


def test_opt_in_skipping_counts_bad_records_and_never_returns_a_bad_row(tmp_path):
    paths, files = make(tmp_path, records=(6, 6))
    flip_byte(paths[0], record_offset(paths[0], 2) + 20)  # record 2: CRC
    ids = numbered_record(9, LENGTH)
    ids[0] = VOCAB + 1
    replace_record(paths[1], 3, ids=ids)  # record 9: id out of vocabulary
    good = {tuple(numbered_record(n, LENGTH).tolist()) for n in range(12) if n not in (2, 9)}

    rows = read_all(files, skip=True)
    assert len(rows) == 12 and {tuple(r) for r in rows} <= good

    data = PretrainingDataLoader([files], SEQ, 12, 2, 0, 1, 3, VOCAB, skip_corrupt_records=True)
    for _ in range(3):
        assert {tuple(r) for r in data.next_batch().reshape(-1, LENGTH).tolist()} <= good
    assert data.skipped_records == 2
    assert data.state_dict()["skipped_records"] == 2


def test_skipping_is_the_same_for_every_layout(tmp_path):
    paths, files = make(tmp_path, records=(6, 6))
    flip_byte(paths[1], record_offset(paths[1], 0) + 20)
    batches = {}
    for size in (1, 2, 3):
        ranks = [
            PretrainingDataLoader([files], SEQ, 6, 1, r, size, 1, VOCAB, skip_corrupt_records=True)
            for r in range(size)
        ]
        batches[size] = [
            [row for rank in ranks for row in rank.next_batch().reshape(-1, LENGTH).tolist()]
            for _ in range(4)
        ]
    assert batches[1] == batches[2] == batches[3]


def test_every_record_corrupt(tmp_path):
    paths, files = make(tmp_path, records=(1,))
    flip_byte(paths[0], 20)
    with pytest.raises(DataError, match="every record is corrupt"):
        PretrainingDataLoader([files], SEQ, 1, 1, 0, 1, 0, VOCAB, skip_corrupt_records=True)


def test_header_length_disagreeing_with_index(tmp_path):
    paths, files = make(tmp_path, records=(2,))
    raw = bytearray(paths[0].read_bytes())
    length = struct.unpack_from("<Q", raw)[0]
    struct.pack_into("<Q", raw, 0, length + 1)  # header CRC now fails first
    paths[0].write_bytes(bytes(raw))
    with pytest.raises(
        DataError, match=r"data_0000.tfrecord record 0 .*CRC mismatch in the length header"
    ):
        read_all(files)

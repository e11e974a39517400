"""TFRecord framing, tf.train.Example coding and index files, against independent references."""

from pathlib import Path

import numpy as np
import pytest

from data.errors import DataError
from data.index_tfrecord import index_file
from data.tfrecord_io import (
    RecordError,
    TFRecordWriter,
    decode_example,
    encode_example,
    frame_record,
    index_path_for,
    masked_crc32c,
    read_record,
    scan_records,
)
from tests.data.data_sets import run_data_script

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The ids in tests/fixtures/tiny.tfrecord, written by the independent `tfrecord` package.
FIXTURE_RECORDS = [
    [15496, 995, 50256, 0, 1, 127, 128, 16383, 16384, 2097151],
    [0] * 10,
    [2**40, 2**62 + 5, 7, 300, 50255, 1, 2, 3, 4, 5],
]


def test_masked_crc32c_of_the_standard_check_string():
    # CRC-32C("123456789") = 0xE3069283 (the published check value); TFRecord's mask rotates it
    # right by 15 bits and adds 0xA282EAD8, computed here by hand.
    crc = 0xE3069283
    expected = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert masked_crc32c(b"123456789") == expected


def test_example_bytes_match_protobuf_encoding_by_hand():
    # Example{features{feature{key:"input_ids" value{int64_list{value:[1, 300]}}}}}, packed:
    # 300 = 0b10_0101100 -> varint AC 02.
    int64_list = b"\x0a\x03" + b"\x01\xac\x02"
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    entry = b"\x0a\x09input_ids" + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    expected = b"\x0a" + bytes([len(features)]) + features
    assert encode_example(np.array([1, 300])) == expected
    assert decode_example(expected).tolist() == [1, 300]


def test_reads_and_reproduces_a_file_written_by_the_tfrecord_package():
    path = FIXTURES / "tiny.tfrecord"
    index = [
        tuple(map(int, line.split())) for line in index_path_for(path).read_text().splitlines()
    ]
    assert scan_records(path) == index
    with open(path, "rb") as file:
        got = [decode_example(read_record(file, o, s)).tolist() for o, s in index]
    assert got == FIXTURE_RECORDS
    ours = b"".join(frame_record(encode_example(np.array(r))) for r in FIXTURE_RECORDS)
    assert ours == path.read_bytes()


def test_round_trip_of_random_ids_of_every_varint_length():
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 2**b, 50) for b in range(1, 64, 3)])
    assert np.array_equal(decode_example(encode_example(ids)), ids)
    assert decode_example(encode_example(np.zeros(0, np.int64))).size == 0


def test_unpacked_int64_list_is_read_too():
    # Same as the hand example but with two unpacked values: tag 08 (field 1, varint) each.
    int64_list = b"\x08\x05\x08\xac\x02"
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    entry = b"\x0a\x09input_ids\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    assert decode_example(b"\x0a" + bytes([len(features)]) + features).tolist() == [5, 300]


def test_decode_names_the_features_found_when_input_ids_is_missing():
    with pytest.raises(RecordError, match=r"no feature 'input_ids' \(features found: 'text'\)"):
        decode_example(encode_example(np.array([1, 2]), feature_name="text"))


@pytest.mark.parametrize("cut", [1, 5])
def test_decode_rejects_truncated_protobuf(cut):
    with pytest.raises(RecordError):
        decode_example(encode_example(np.array([1, 300, 70000]))[:-cut])


def test_read_record_checks_both_crcs(tmp_path):
    record = bytearray(frame_record(encode_example(np.arange(20))))
    with open(tmp_path / "ok", "wb") as f:
        f.write(record)
    with open(tmp_path / "ok", "rb") as f:
        assert decode_example(read_record(f, 0, len(record))).tolist() == list(range(20))
    for position, message in [(20, "CRC mismatch in the data"), (2, "CRC mismatch in the length")]:
        bad = bytearray(record)
        bad[position] ^= 0x01
        (tmp_path / "bad").write_bytes(bad)
        with open(tmp_path / "bad", "rb") as f, pytest.raises(RecordError, match=message):
            read_record(f, 0, len(record))


def test_writer_index_equals_a_scan_of_the_file(tmp_path):
    path = tmp_path / "x.tfrecord"
    with TFRecordWriter(path) as writer:
        for n in (1, 7, 300):
            writer.write(np.arange(n) * 1000)
    lines = index_path_for(path).read_text().splitlines()
    assert [tuple(map(int, line.split())) for line in lines] == scan_records(path)
    assert writer.num_records == 3 and writer.num_bytes == path.stat().st_size


def test_index_tool_rebuilds_the_index_and_reports_truncation(tmp_path):
    path = tmp_path / "copy.tfrecord"
    path.write_bytes((FIXTURES / "tiny.tfrecord").read_bytes())
    assert index_file(str(path)) == 3
    assert index_path_for(path).read_text() == (FIXTURES / "tiny.index").read_text()
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"copy.tfrecord record 2 at offset 104: truncated"):
        index_file(str(path))
    result = run_data_script("index_tfrecord.py", path)
    assert result.returncode == 2
    assert (
        result.stderr.startswith("index_tfrecord.py: error: ") and "Traceback" not in result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1

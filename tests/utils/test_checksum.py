"""CRC-32C without the crc32c package: the numpy fallback against the package and a bitwise
reference, and the TFRecord reader and checkpoint CRCs running on the fallback alone."""

import contextlib
import importlib
import itertools
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from data.loader import SAMPLE_DATA_GLOB, DataError, validation_batches
from execution.checkpoint import files
from utils import checksum
from utils.checksum import crc32c_fallback

SAMPLE_SHARD = Path(SAMPLE_DATA_GLOB).parent / "data_0000.tfrecord"
# Lengths either side of each switch inside the fallback: the Python loop below 512 bytes, short
# blocks, long blocks from 64 KiB, 1 MiB pieces; and lengths that are not whole blocks.
LENGTHS = [0, 1, 3, 4, 5, 8, 15, 16, 17, 511, 512, 513, 1000, 3977, 65535, 65536, 65537]
LONG_LENGTHS = [(1 << 20) - 1, 1 << 20, (1 << 20) + 13, (3 << 20) + 5]


def bitwise_crc32c(data: bytes, value: int = 0) -> int:
    """CRC-32C straight from its definition, one bit at a time."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def random_bytes(length: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


@pytest.fixture
def package():
    return pytest.importorskip("crc32c")


@contextlib.contextmanager
def package_blocked():
    """`utils.checksum` reloaded as if the crc32c package were not installed.

    Reloading runs the module again in the same namespace, so the `crc32c` that the TFRecord and
    checkpoint modules imported from it takes the fallback too.
    """
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "crc32c", None)
            importlib.reload(checksum)
            assert not checksum.USING_PACKAGE
            yield
    finally:
        importlib.reload(checksum)


@pytest.fixture
def without_package():
    with package_blocked():
        yield


def test_standard_check_value_and_empty_input():
    assert crc32c_fallback(b"123456789") == 0xE3069283
    assert checksum.crc32c(b"123456789") == 0xE3069283
    assert crc32c_fallback(b"") == 0
    assert crc32c_fallback(b"", 0x12345678) == 0x12345678


@pytest.mark.parametrize("value", [0, 0xE3069283, 0xFFFFFFFF])
def test_fallback_equals_the_bitwise_definition(value):
    for length in [n for n in LENGTHS if n <= 4000]:
        data = random_bytes(length, seed=length)
        assert crc32c_fallback(data, value) == bitwise_crc32c(data, value), length


def test_fallback_equals_the_package_on_random_buffers(package):
    for length in LENGTHS + LONG_LENGTHS:
        data = random_bytes(length, seed=length)
        for value in (0, 0x9ABCDEF0):
            assert crc32c_fallback(data, value) == package.crc32c(data, value), (length, value)


def test_chained_over_chunks_equals_one_pass(package):
    data = random_bytes((2 << 20) + 77, seed=1)
    cuts = [0, 3, 600, 5000, 70000, 1 << 20, (1 << 20) + 1, len(data)]
    crc = 0
    for start, end in itertools.pairwise(cuts):
        crc = crc32c_fallback(data[start:end], crc)
    assert crc == crc32c_fallback(data) == package.crc32c(data)


def test_any_contiguous_buffer_is_read_as_its_bytes():
    data = random_bytes(4000, seed=2)
    expected = bitwise_crc32c(data)
    for buffer in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert crc32c_fallback(buffer) == expected
    assert crc32c_fallback(np.frombuffer(data, np.uint32)) == expected


def test_sample_tfrecords_read_and_verify_on_the_fallback(capfd):
    def every_record():  # one window per record: each record read and both its CRCs checked
        return list(validation_batches([SAMPLE_DATA_GLOB], 2048, 1, 0, 1, 50257, None))

    expected = every_record()
    capfd.readouterr()
    with package_blocked():
        batches = every_record()
        notes = capfd.readouterr().err.splitlines()
    assert len(batches) == 67
    assert all(a.equal(b) for a, b in zip(batches, expected, strict=True))
    assert notes == [checksum.FALLBACK_NOTE]  # once per process, however many checksums


@pytest.mark.parametrize(
    ("where", "message"),
    [(2, "CRC mismatch in the length header"), (100, "CRC mismatch in the data")],
)
def test_a_corrupt_byte_is_still_detected_on_the_fallback(
    without_package, tmp_path, where, message
):
    shard = tmp_path / SAMPLE_SHARD.name
    shutil.copy(SAMPLE_SHARD, shard)
    shutil.copy(SAMPLE_SHARD.with_suffix(".index"), shard.with_suffix(".index"))
    record_5 = int(shard.with_suffix(".index").read_text().splitlines()[5].split()[0])
    raw = bytearray(shard.read_bytes())
    raw[record_5 + where] ^= 0x08
    shard.write_bytes(raw)
    with pytest.raises(DataError, match=rf"{shard.name} record 5 .*{message}"):
        list(validation_batches([str(shard)], 2048, 1, 0, 1, 50257, None))


def test_checkpoint_file_crc_on_the_fallback(without_package, tmp_path):
    data = random_bytes((5 << 20) + 3, seed=3)  # over the 4 MiB read size: chained CRCs
    (tmp_path / "blob").write_bytes(data)
    assert files.file_crc(tmp_path / "blob") == crc32c_fallback(data)

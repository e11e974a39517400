"""Weighted blends of corpora: the interleave's proportions, each corpus' epochs, resuming at
another data-parallel size, the counts logged, validation blends, and bad blends.

Corpora are "numbered" TFRecord sets with disjoint id ranges, so a row says which corpus and
window it is; the references are hand counts and the plain loader of one corpus.
"""

import json

import numpy as np
import pytest
import torch

from config.loading import parse_config
from data.blend import BlendedDataLoader, Interleave, parse_blend
from data.loader import DataError, PretrainingDataLoader, validation_source
from data.tfrecord_io import TFRecordWriter
from tests.data.data_sets import numbered_record, write_numbered_shards

SEQ = 4
LENGTH = SEQ + 1
GBS, MBS, VOCAB = 24, 2, 10**6


@pytest.mark.parametrize(
    "weights",
    [[0.7, 0.3], [1, 1, 1], [0.5, 0.3, 0.2], [0.99, 0.01], [3.0, 0.25, 1.5, 7.0, 0.5]],
)
def test_drawn_proportions_are_within_1_percent_of_the_weights_over_10000_windows(weights):
    interleave = Interleave(weights)
    shares = np.asarray(weights) / sum(weights)
    corpus, draw = interleave.locate(np.arange(10_000))
    counts = np.bincount(corpus, minlength=len(weights))
    assert np.all(np.abs(counts / 10_000 - shares) < 0.01), counts
    # Tighter, at every prefix: the running counts stay within K + 1 windows of the shares.
    running = np.cumsum(np.eye(len(weights), dtype=int)[corpus], axis=0)
    ideal = np.arange(1, 10_001)[:, None] * shares[None, :]
    assert np.abs(running - ideal).max() <= len(weights) + 1
    for number in range(len(weights)):  # each corpus' draws are numbered in order, no gaps
        assert draw[corpus == number].tolist() == list(range(counts[number]))


def test_counts_drawn_before_a_position_are_those_of_the_positions():
    interleave = Interleave([0.6, 0.1, 0.3])
    corpus, _ = interleave.locate(np.arange(3 * 4096 + 17))
    for position in (0, 1, 4095, 4096, 4097, 3 * 4096 + 17):
        expected = np.bincount(corpus[:position], minlength=3)
        assert Interleave([0.6, 0.1, 0.3]).drawn_before(position).tolist() == expected.tolist()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora: A of 40 windows (ids below 1,000), B of 9 windows (ids from 1,000,000)."""
    root = tmp_path_factory.mktemp("blend")
    write_numbered_shards(root / "a", [25, 15], LENGTH)
    (root / "b").mkdir()
    with TFRecordWriter(root / "b" / "data_0000.tfrecord") as writer:
        for number in range(9):
            writer.write(numbered_record(1000 + number, LENGTH))
    return str(root / "a" / "*.tfrecord"), str(root / "b" / "*.tfrecord")


def identify(row: torch.Tensor) -> tuple[int, int]:
    """(corpus, window) of a row, after checking it is that window exactly."""
    record = int(row[0]) // LENGTH
    assert row.tolist() == (record * LENGTH + np.arange(LENGTH)).tolist()
    return (1, record - 1000) if record >= 1000 else (0, record)


def blend(corpora, weights=(0.75, 0.25), rank=0, size=1, seed=3, **kwargs):
    pairs = list(zip(weights, corpora, strict=True))
    return BlendedDataLoader(pairs, SEQ, GBS, MBS, rank, size, seed, VOCAB, **kwargs)


def global_rows(ranks):
    return [identify(row) for rank in ranks for row in rank.next_batch().reshape(-1, LENGTH)]


def test_each_corpus_runs_through_its_own_epochs(corpora):
    data = blend(corpora)
    rows = [r for _ in range(20) for r in global_rows([data])]  # 480 windows
    for number, size in ((0, 40), (1, 9)):
        windows = [w for c, w in rows if c == number]
        for epoch in range(len(windows) // size):
            assert sorted(windows[epoch * size : (epoch + 1) * size]) == list(range(size))
    drawn = data.windows_drawn(20)
    assert drawn == {f"windows_drawn_{n}": sum(c == n for c, _ in rows) for n in (0, 1)}
    assert drawn == {"windows_drawn_0": 360, "windows_drawn_1": 120}
    assert data.epoch == 120 // 9  # the most revisited corpus


def test_a_blend_of_one_corpus_reads_the_batches_of_its_files(corpora):
    single = BlendedDataLoader([(2.0, corpora[0])], SEQ, GBS, MBS, 0, 1, 3, VOCAB)
    plain = PretrainingDataLoader([corpora[0]], SEQ, GBS, MBS, 0, 1, 3, VOCAB)
    for _ in range(5):
        assert torch.equal(single.next_batch(), plain.next_batch())


@pytest.mark.parametrize("resume_size", [3, 4])
def test_a_blend_resumes_exactly_at_another_data_parallel_size(corpora, resume_size):
    reference = blend(corpora)
    uninterrupted = [global_rows([reference]) for _ in range(9)]
    saved = [blend(corpora, rank=r, size=2) for r in range(2)]
    for step in range(4):
        assert global_rows(saved) == uninterrupted[step]
    state = json.loads(json.dumps(saved[1].state_dict()))  # as a checkpoint stores it
    resumed = [blend(corpora, rank=r, size=resume_size) for r in range(resume_size)]
    for rank in resumed:
        rank.load_state_dict(state)
    for step in range(4, 9):
        assert global_rows(resumed) == uninterrupted[step], step


def test_resuming_refuses_another_blend(corpora):
    state = blend(corpora).state_dict()
    with pytest.raises(DataError, match="this run's blend is not the checkpoint's"):
        blend(corpora, weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(DataError, match="trained on a --data_blend"):
        PretrainingDataLoader([corpora[0]], SEQ, GBS, MBS, 0, 1, 3, VOCAB).load_state_dict(state)
    plain = PretrainingDataLoader([corpora[0]], SEQ, GBS, MBS, 0, 1, 3, VOCAB).state_dict()
    with pytest.raises(DataError, match="trained on --input_files, not on a blend"):
        blend(corpora).load_state_dict(plain)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["0.7 'a/*' 0.3"], "--data_blend is pairs of WEIGHT GLOB, e.g."),
        (
            ["0.7", "a/*", "0", "b/*"],
            "--data_blend: the weight '0' of b/* must be a positive number",
        ),
        (["-1 a/* 2 b/*"], "--data_blend: the weight '-1' of a/* must be a positive number"),
        (["a/* 0.5"], "--data_blend: the weight 'a/*' of 0.5 must be a positive number"),
        (["0.5 'a/*"], 'the blend "0.5 \'a/*" cannot be split into words'),
    ],
)
def test_bad_blends_are_one_line(entries, message):
    with pytest.raises(DataError) as error:
        parse_blend(entries, "--data_blend")
    assert str(error.value).startswith(message)


def test_a_blend_corpus_glob_that_matches_nothing(corpora, tmp_path):
    with pytest.raises(DataError, match=f"input pattern {tmp_path}/none/\\*.bin matches no files"):
        blend([corpora[0], f"{tmp_path}/none/*.bin"])


def test_one_string_and_separate_words_are_the_same_blend():
    words = parse_blend(["0.7", "a dir/*.tfrecord", "0.3", "b/*.bin"], "--data_blend")
    assert parse_blend(["0.7 'a dir/*.tfrecord' 0.3 b/*.bin"], "--data_blend") == words
    assert words == [(0.7, "a dir/*.tfrecord"), (0.3, "b/*.bin")]


def test_a_validation_blend_reports_each_corpus_and_their_weighted_mean(corpora):
    flags = ["--config", "tiny", "--sequence_length", str(SEQ), "--input_files", corpora[0]]
    flags += ["--validation_files", "1", corpora[0], "3", corpora[1]]
    flags += ["--eval_every", "1", "--eval_batches", "0", "--vocab_size", str(VOCAB)]
    config, _ = parse_config([*flags, "--micro_batch_size", "1", "--global_batch_size", "8"])
    validation = validation_source(config, 0, 1)

    def first_ids(batches) -> float:  # stands in for the model's loss: a number per corpus
        return float(np.mean([int(b[0, 0]) for b in batches]))

    scores = validation.scores(first_ids)
    a = np.mean([r * LENGTH for r in range(40)])  # corpus A's windows, each once
    b = np.mean([(1000 + r) * LENGTH for r in range(9)])
    assert scores == pytest.approx(
        {"eval_loss": (a + 3 * b) / 4, "eval_loss_0": a, "eval_loss_1": b}
    )


def test_a_blend_goes_with_no_input_files_and_no_fine_tuning(corpora, tmp_path):
    from config.errors import ConfigError
    from execution.planning.dry_run import check_input_files
    from tasks.specs import parse_finetuning_config

    blend_flag = ["--data_blend", f"1 {corpora[0]} 1 {corpora[1]}"]
    with pytest.raises(ConfigError, match="give either --input_files or --data_blend, not both"):
        parse_config(["--config", "tiny", *blend_flag, "--input_files", corpora[0]])
    with pytest.raises(ConfigError, match="--data_blend does not apply to fine-tuning"):
        parse_finetuning_config(["--task", "mnli", *blend_flag])
    check_input_files([], blend_flag[1:])  # what --dry_run checks: the corpora exist
    with pytest.raises(DataError, match="matches no files"):
        check_input_files([], [f"1 {corpora[0]} 1 {tmp_path}/none/*"])

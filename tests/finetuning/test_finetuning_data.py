"""SQuAD and MNLI readers, windows, prompts, answer post-processing and the SQuAD metric."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from data.errors import DataError
from data.mnli import LABELS, mnli_prompts, read_mnli
from data.squad import SquadAnswer, SquadExample, no_answer_index, read_squad, squad_windows
from data.squad_answers import best_answers, normalize_answer, squad_scores
from data.tokenizer import GPT2_EOT_ID, TokenizerSpec, load_tokenizer

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "sample"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TokenizerSpec())[0]


def _long_example() -> SquadExample:
    words = [f"word{n}" for n in range(300)]
    context = " ".join(words)
    answer = "word250 word251"
    return SquadExample(
        "long", "Which two words?", context, (SquadAnswer(answer, context.find(answer)),)
    )


# ----------------------------------------------------------------------------- SQuAD reader


def test_sample_squad_files_read():
    train = read_squad(SAMPLES / "squad" / "train-v1.1.json")
    dev = read_squad(SAMPLES / "squad" / "dev-v1.1.json")
    assert (len(train), len(dev)) == (29, 10)
    for example in train + dev:
        for answer in example.answers:
            assert example.context[answer.start : answer.end] == answer.text


def _squad_file(tmp_path: Path, qa: dict, context: str = "Paris is in France.") -> Path:
    path = tmp_path / "bad.json"
    document = {"data": [{"title": "t", "paragraphs": [{"context": context, "qas": [qa]}]}]}
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda tmp: tmp / "missing.json", "does not exist"),
        (
            lambda tmp: (tmp / "x.json").write_text('{"data": [') and tmp / "x.json",
            "not valid JSON",
        ),
        (
            lambda tmp: (tmp / "x.json").write_text('{"version": "1.1"}') and tmp / "x.json",
            "'data'",
        ),
        (
            lambda tmp: _squad_file(
                tmp,
                {
                    "id": "q1",
                    "question": "Where?",
                    "answers": [{"text": "France", "answer_start": 3}],
                },
            ),
            "not in its context",
        ),
        (lambda tmp: _squad_file(tmp, {"id": "q1", "question": "Where?"}), "'answers'"),
    ],
)
def test_bad_squad_files_get_one_clear_line(tmp_path, write, words):
    with pytest.raises(DataError, match=words) as err:
        read_squad(write(tmp_path))
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- windows


def test_windows_put_the_question_first_and_point_at_the_answer(tokenizer):
    examples = read_squad(SAMPLES / "squad" / "train-v1.1.json")
    windows = squad_windows(examples, tokenizer, max_length=384, doc_stride=128)
    assert len(windows) == len(examples)  # the sample paragraphs fit one window
    for w, example in enumerate(examples):
        ids = windows.input_ids[w].tolist()
        question = tokenizer.encode(example.question).ids
        assert ids[: len(question) + 1] == [*question, GPT2_EOT_ID]
        assert ids[-1] == GPT2_EOT_ID and windows.offsets[w][-1] is None
        start, end = windows.targets[w].tolist()
        spans, answer = windows.offsets[w], example.answers[0]
        # The fewest whole tokens that cover the answer (a token may run past it: '".').
        assert spans[start][0] <= answer.start < spans[start][1]
        assert spans[end][0] < answer.end <= spans[end][1]


def test_long_contexts_overflow_into_overlapping_windows(tokenizer):
    example = _long_example()
    max_length, stride = 96, 16
    windows = squad_windows([example], tokenizer, max_length=max_length, doc_stride=stride)
    assert len(windows) > 2 and windows.input_ids.shape[1] == max_length
    context_tokens = [[s for s in spans if s is not None] for spans in windows.offsets]
    for before, after in itertools.pairwise(context_tokens):
        assert before[-stride:] == after[:stride]  # consecutive windows share `stride` tokens
    holding = []
    for w in range(len(windows)):
        start, end = windows.targets[w].tolist()
        if start == no_answer_index(max_length):
            assert end == start and windows.offsets[w][start] is None  # never a context token
        else:
            spans = windows.offsets[w]
            assert example.context[spans[start][0] : spans[end][1]].strip() == "word250 word251"
            holding.append(w)
    assert holding and len(holding) < len(windows)


# ----------------------------------------------------------------------------- answers


def test_best_answer_takes_the_best_valid_span_over_windows(tokenizer):
    example = _long_example()
    windows = squad_windows([example], tokenizer, max_length=96, doc_stride=16)
    starts = torch.full(windows.input_ids.shape, -100.0)
    ends = torch.full(windows.input_ids.shape, -100.0)
    w = next(n for n in range(len(windows)) if windows.targets[n, 0] != 95)
    start, end = windows.targets[w].tolist()
    starts[w, start], ends[w, end] = 5.0, 5.0
    starts[0, 0] = ends[0, 0] = 50.0  # a question token: never an answer
    starts[1, 40], ends[1, 39] = 20.0, 20.0  # end before start: never an answer
    assert best_answers([example], windows, starts, ends) == {"long": "word250 word251"}
    starts[w, start - 40] = 9.0  # would beat it, but 41 tokens long (> 30)
    assert best_answers([example], windows, starts, ends)["long"] == "word250 word251"
    assert best_answers([example], windows, starts, ends, max_answer_length=50)["long"] != (
        "word250 word251"
    )


@pytest.mark.slow  # over 2.5 s: the whole suite's, not the fast lane's
def test_squad_metric_agrees_with_torchmetrics():
    from torchmetrics.text import SQuAD

    examples = read_squad(SAMPLES / "squad" / "dev-v1.1.json") + read_squad(
        SAMPLES / "squad" / "train-v1.1.json"
    )
    rng = random.Random(0)
    predictions = {}
    for example in examples:  # exact, re-cased, punctuated, partial, wrong and empty answers
        text = rng.choice(example.answers).text
        words = text.split()
        predictions[example.id] = rng.choice(
            [
                text,
                text.upper(),
                f"The {text}!",
                " ".join(words[: max(1, len(words) // 2)]),
                example.context[:20],
                "",
            ]
        )
    ours = squad_scores(predictions, examples)
    reference = SQuAD()(
        [{"prediction_text": predictions[e.id], "id": e.id} for e in examples],
        [
            {
                "answers": {
                    "text": [a.text for a in e.answers],
                    "answer_start": [a.start for a in e.answers],
                },
                "id": e.id,
            }
            for e in examples
        ],
    )
    assert 0 < ours["exact_match"] < 100 and 0 < ours["f1"] < 100
    assert ours["exact_match"] == pytest.approx(float(reference["exact_match"]), abs=1e-4)
    assert ours["f1"] == pytest.approx(float(reference["f1"]), abs=1e-4)
    assert normalize_answer("  The Quick,  brown fox! ") == "quick brown fox"


# ----------------------------------------------------------------------------- MNLI


def test_sample_mnli_files_read_by_header_name(tokenizer):
    sizes = {
        name: len(read_mnli(SAMPLES / "mnli" / name))
        for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv")
    }
    assert sizes == {"train.tsv": 36, "dev_matched.tsv": 9, "dev_mismatched.tsv": 9}
    example = read_mnli(SAMPLES / "mnli" / "dev_matched.tsv")[0]
    assert (example.id, LABELS[example.label]) == ("200e", "entailment")
    batch = mnli_prompts([example], tokenizer, max_length=64)
    hypothesis = tokenizer.encode(example.hypothesis).ids
    premise = tokenizer.encode(example.premise).ids
    prompt = [*hypothesis, GPT2_EOT_ID, *premise]
    assert batch.input_ids[0, : len(prompt)].tolist() == prompt
    assert batch.targets[0].tolist() == [0, len(prompt) - 1]
    assert (batch.input_ids[0, len(prompt) :] == GPT2_EOT_ID).all()
    cut = mnli_prompts([example], tokenizer, max_length=12)
    assert cut.targets[0, 1] == 11 and GPT2_EOT_ID in cut.input_ids[0].tolist()


def _tsv(tmp_path: Path, header: str, row: str) -> Path:
    path = tmp_path / "dev_matched.tsv"
    path.write_text(f"{header}\n{row}\n")
    return path


@pytest.mark.parametrize(
    ("header", "row", "words"),
    [
        (
            "pairID\tsentence1\tsentence2\tgold_label",
            "1e\tA cat.\tAn animal.\tmaybe",
            "label 'maybe'",
        ),
        ("pairID\tsentence1\tsentence2\tgold_label", "1e\tA cat.\tentailment", "3 tab-separated"),
        (
            "pairID\tsentence1\tsentence2\tlabel",
            "1e\tA cat.\tAn animal.\tentailment",
            "'gold_label'",
        ),
    ],
)
def test_bad_mnli_files_get_one_clear_line(tmp_path, header, row, words):
    with pytest.raises(DataError, match=words) as err:
        read_mnli(_tsv(tmp_path, header, row))
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="does not exist"):
        read_mnli(tmp_path / "train.tsv")


# ----------------------------------------------------------------------------- loader


def test_task_loader_batches_do_not_depend_on_the_layout_and_resume():
    from data.finetuning_data import TaskDataLoader, evaluation_chunks

    rows = torch.arange(13 * 5).view(13, 5)
    one = TaskDataLoader(rows, 8, 2, 0, 1, seed=3)
    two = [TaskDataLoader(rows, 8, 2, d, 2, seed=3) for d in range(2)]
    for _ in range(4):  # past an epoch: 13 rows, 8 per step
        whole = one.next_batch().reshape(-1, 5)
        halves = torch.cat([loader.next_batch().reshape(-1, 5) for loader in two])
        assert torch.equal(whole, halves)
    assert one.epoch == 2
    resumed = TaskDataLoader(rows, 8, 2, 0, 1, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_batch(), one.next_batch())
    with pytest.raises(DataError, match="--sequence_length or --doc_stride") as err:
        TaskDataLoader(rows + 1, 8, 2, 0, 1, seed=3).load_state_dict(one.state_dict())
    assert one.state_dict()["rows_digest"] not in str(err.value)
    chunks = [evaluation_chunks(rows, 2, d, 2)[0] for d in range(2)]
    interleaved = torch.cat([c for pair in zip(*chunks, strict=True) for c in pair])
    assert torch.equal(interleaved[:13], rows) and len(interleaved) == 16

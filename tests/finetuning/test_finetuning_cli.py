"""run_finetuning.py's bad input: one line naming the problem and exit status 2, never a traceback."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import run_finetuning
from config.loading import ConfigError, load_presets
from data.errors import DataError
from tasks.specs import SQUAD, evaluation_files, parse_finetuning_config, training_files
from tests.entry_points import assert_refused, run_script

ROOT = Path(__file__).resolve().parents[2]
SMALL = shlex.split(
    "--config tiny --layers 1 --hidden_size 32 --heads 2 --global_batch_size 4 "
    "--micro_batch_size 2 --steps 1 --device cpu"
)


def _fails(argv: list[str], error: type, words: str) -> None:
    with pytest.raises(error, match=words) as err:
        run_finetuning.main(argv)
    assert "\n" not in str(err.value)


def test_unknown_flag_exits_2_with_one_line():
    result = run_script("run_finetuning.py", "--task", "squad", "--nonsense", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "run_finetuning.py: error: unrecognized arguments: --nonsense 1"
    )


def test_bad_task_files_fail_before_training(tmp_path):
    out = ["--output_dir", str(tmp_path / "run")]
    _fails([*SMALL, *out, "--input_files", str(tmp_path / "no.json")], DataError, "does not exist")
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [')
    _fails([*SMALL, *out, "--input_files", str(broken)], DataError, "not valid JSON")
    moved = tmp_path / "moved.json"
    paragraph = {"context": "Paris is in France.", "qas": []}
    paragraph["qas"].append(
        {"id": "q", "question": "Where?", "answers": [{"text": "France", "answer_start": 2}]}
    )
    moved.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [paragraph]}]}))
    _fails([*SMALL, *out, "--input_files", str(moved)], DataError, "not in its context")
    labels = tmp_path / "train.tsv"
    labels.write_text("pairID\tsentence1\tsentence2\tgold_label\n1\tA.\tB.\tunsure\n")
    mnli = [*SMALL, *out, "--task", "mnli", "--input_files", str(labels)]
    _fails(mnli, DataError, "label 'unsure' is not one of")
    _fails([*SMALL, *out, "--context_parallel", "2"], ConfigError, "--context_parallel 2")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # MNLI has no windows or answer spans: the flags would be ignored.
        ("--task mnli --doc_stride 32", "--doc_stride only applies to --task squad"),
        (
            "--task mnli --n_best_size 5 --max_answer_length 9",
            "--n_best_size and --max_answer_length only apply to --task squad",
        ),
        # A window of 128 tokens cannot overlap the next by 128 and still move on.
        ("--task squad --doc_stride 128", "--doc_stride 128 does not fit a SQuAD window of"),
    ],
)
def test_squad_flags_that_mnli_ignores_or_no_window_fits_exit_2(flags, message):
    result = run_script("run_finetuning.py", "--config", "tiny", *shlex.split(flags))
    assert_refused(result, "run_finetuning.py", message)
    assert result.stdout == ""


def test_squad_runs_on_every_preset_with_the_default_doc_stride():
    """The overlap is a third of the window unless given: 128 of SQuAD's usual 384, 42 of
    tiny's 128 (a fixed 128 left no room for context there); the sample's windows build."""
    from data.tokenizer import TokenizerSpec, load_tokenizer

    strides = {}
    for preset in load_presets():
        config, _ = parse_finetuning_config(["--config", preset, "--task", "squad"])
        strides[config.model.sequence_length] = config.finetuning.doc_stride
    assert strides == {128: 42, 384: 128}
    config, _ = parse_finetuning_config(["--config", "tiny", "--task", "squad"])
    tokenizer = load_tokenizer(TokenizerSpec())[0]
    for path in (*training_files(config), *evaluation_files(config)):
        SQUAD.read(path, tokenizer, 128, config.finetuning)
    given, _ = parse_finetuning_config(
        ["--config", "tiny", "--task", "squad", "--doc_stride", "32"]
    )
    assert given.finetuning.doc_stride == 32


def _word_tokenizer(path: Path) -> None:
    """A HuggingFace tokenizer.json of its own: the words of the shipped MNLI sample, split at
    whitespace and punctuation, ``<eot>`` first (the sample's other words are ``<unk>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    text = (ROOT / "data" / "sample" / "mnli" / "train.tsv").read_text().split()[:400]
    words = ["<eot>", "<unk>", *dict.fromkeys(w.strip(".,;:!?\"'()") for w in text)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_a_model_s_own_tokenizer_json_tokenizes_the_task(tmp_path):
    """--tokenizer and --eot_token: the pairs are the given tokenizer's ids, joined and padded
    with its end-of-text id, and the run trains and scores on them (a model of a vocabulary
    of its own, as an imported Llama's)."""
    from data.mnli import mnli_prompts, read_mnli
    from data.tokenizer import TokenizerSpec, load_tokenizer

    words = tmp_path / "words.json"
    _word_tokenizer(words)
    tokenizer, eot, vocab = load_tokenizer(TokenizerSpec(str(words), "<eot>"))
    examples = read_mnli(str(ROOT / "data" / "sample" / "mnli" / "train.tsv"))[:2]
    prompts = mnli_prompts(examples, tokenizer, 64, "<eot>")
    first = prompts.input_ids[0]
    hypothesis = tokenizer.encode(examples[0].hypothesis).ids
    assert first[: len(hypothesis) + 1].tolist() == [*hypothesis, eot]  # then the premise
    assert first[int(prompts.targets[0, 1]) + 1 :].eq(eot).all()  # padded with it
    flags = ["--task", "mnli", "--vocab_size", str(vocab), "--tokenizer", str(words)]
    flags += ["--eot_token", "<eot>", "--output_dir", str(tmp_path / "run")]
    run_finetuning.main([*SMALL, *flags])
    scores = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert scores["dev_matched"]["examples"] > 0


def test_a_tokenizer_that_cannot_serve_the_model_is_one_line(tmp_path):
    words = tmp_path / "words.json"
    _word_tokenizer(words)
    out = ["--task", "mnli", "--output_dir", str(tmp_path / "run")]
    _fails([*SMALL, *out, "--tokenizer", str(tmp_path / "none.json")], DataError, "--tokenizer")
    _fails([*SMALL, *out, "--tokenizer", str(words)], ConfigError, "no end-of-text token")
    small = ["--vocab_size", "8", "--tokenizer", str(words), "--eot_token", "<eot>"]
    _fails([*SMALL, *out, *small], ConfigError, "--vocab_size 8 is smaller than")
    assert not (tmp_path / "run").exists()

"""SQuAD v1.1 for fine-tuning: the official JSON reader and the windows the model reads.

A causal model sees only what comes before a token, so each window puts the question first::

    question (<= 64 tokens) | <|endoftext|> | a window of the context | <|endoftext|> padding

Contexts longer than a window overflow into further windows that overlap by ``doc_stride``
tokens (the meaning HuggingFace's ``run_qa.py`` gives it). The windows and their offset mapping
(token -> characters of the context) come from the GPT-2 BPE tokenizer run by ``tokenizers``
(:func:`data.tokenizer.load_tokenizer`); nothing is downloaded.

**Windows without the answer** (the answer lies in another window of the same context) point
both their start and their end at :func:`no_answer_index`, the window's last position
``max_length - 1``. Every window is cut to ``max_length - 1`` tokens and the last position is
always a padding token, so that index is never a context token that an answer could start at,
and under causal attention it is the one position that has read the whole window. (BERT's
choice, index 0, would here see only the first question token, the same in every window of a
question, and could not tell an answer-holding window from the others.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, processors

from config.errors import ConfigError
from config.finetuning import FinetuningConfig, FinetuningRunConfig
from data.errors import DataError
from data.finetuning_data import TaskSet
from data.tokenizer import GPT2_EOT_TOKEN

MAX_QUESTION_TOKENS = 64  # BERT's max_query_length: questions are short; a long one is cut
# What a window holds besides its context at the least: one question token, the separator and
# the padding token at its end.
LEAST_WINDOW_OVERHEAD = 3


@dataclass(frozen=True)
class SquadAnswer:
    """One reference answer: its text and the character where it starts in the context."""

    text: str
    start: int

    @property
    def end(self) -> int:
        """The character after the answer."""
        return self.start + len(self.text)


@dataclass(frozen=True)
class SquadExample:
    """One question over one paragraph, with its reference answers (the first trains)."""

    id: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]


def read_squad(path: str | Path) -> list[SquadExample]:
    """Reads a SQuAD v1.1 file (``data`` -> ``paragraphs`` -> ``qas``).

    Raises:
        DataError: the file is missing or not JSON, lacks a key of the format, repeats a
            question id, or has an answer that is not at its ``answer_start`` in the context.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(
            f"SQuAD file {path} does not exist; give the path of a v1.1 JSON file"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read SQuAD file {path}: {err}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"SQuAD file {path} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); it must be in the official v1.1 format"
        ) from None
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(_field(document, "data", list, path, "the top level")):
        for p, paragraph in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", str, path, where)
            for q, qa in enumerate(_field(paragraph, "qas", list, path, where)):
                example = _example(qa, context, path, f"{where}.qas[{q}]")
                if example.id in seen:
                    raise DataError(
                        f"SQuAD file {path}: question id {example.id!r} appears twice; "
                        "predictions are keyed by id, so ids must be unique"
                    )
                seen.add(example.id)
                examples.append(example)
    if not examples:
        raise DataError(f"SQuAD file {path} holds no questions")
    return examples


def _example(qa: object, context: str, path: Path, where: str) -> SquadExample:
    qid = str(_field(qa, "id", (str, int), path, where))
    question = _field(qa, "question", str, path, where)
    answers = []
    for n, answer in enumerate(_field(qa, "answers", list, path, where)):
        text = _field(answer, "text", str, path, f"{where}.answers[{n}]")
        start = _field(answer, "answer_start", int, path, f"{where}.answers[{n}]")
        found = context[start : start + len(text)] if start >= 0 else ""
        if found != text or not text:
            raise DataError(
                f"SQuAD file {path}: answer {text!r} of question {qid} is not in its context at "
                f"answer_start {start} (the context holds {found!r} there); fix answer_start"
            )
        answers.append(SquadAnswer(text, start))
    if not answers:
        raise DataError(
            f"SQuAD file {path}: question {qid} has no answers; SQuAD v1.1 questions all have "
            "one (v2.0's unanswerable questions are not supported)"
        )
    return SquadExample(qid, question, context, tuple(answers))


def _field(node: object, key: str, kind, path: Path, where: str):
    """``node[key]``, checked to be of ``kind``; a one-line DataError otherwise."""
    if not isinstance(node, dict) or key not in node:
        raise DataError(f"SQuAD file {path}: {where} has no {key!r}; not the v1.1 format")
    value = node[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(
            f"SQuAD file {path}: {where}.{key} is {type(value).__name__}, not the v1.1 format"
        )
    return value


def no_answer_index(max_length: int) -> int:
    """Where a window that does not hold the answer points its start and end: the last
    position, always padding (module docstring)."""
    return max_length - 1


@dataclass
class SquadWindows:
    """The windows of a list of examples, as the model reads them.

    Attributes:
        input_ids: int64 ``[windows, max_length]``.
        targets: int64 ``[windows, 2]``: the answer's first and last token, or
            :func:`no_answer_index` twice when the window does not hold the whole answer.
        example_index: int64 ``[windows]``: which example each window belongs to.
        offsets: per window and position, the ``(start, end)`` characters of the context that
            the token covers, or None for question, separator and padding tokens.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    example_index: torch.Tensor
    offsets: list[list[tuple[int, int] | None]]

    def __len__(self) -> int:
        return len(self.input_ids)


def squad_windows(
    examples: list[SquadExample],
    tokenizer: Tokenizer,
    max_length: int = 384,
    doc_stride: int = 128,
    eot_token: str = GPT2_EOT_TOKEN,
) -> SquadWindows:
    """Tokenizes every example into overlapping question-first windows (module docstring).

    Args:
        examples: As read by :func:`read_squad`.
        tokenizer: GPT-2's BPE or the model's own (:func:`data.tokenizer.load_tokenizer`);
            not modified.
        max_length: Tokens per window, padding included (the model's sequence length).
        doc_stride: Tokens each window of a context shares with the previous one.
        eot_token: The tokenizer's end-of-text token: the separator and the padding.

    Raises:
        DataError: the lengths leave no room for the context.
    """
    questions = [_cut_question(tokenizer, e.question) for e in examples]
    longest = max(len(encoding.ids) for encoding in tokenizer.encode_batch(questions))
    room = max_length - 1 - longest - 1  # the last position and the separator
    if room <= doc_stride:
        raise DataError(
            f"a SQuAD window of {max_length} tokens leaves {room} for the context after the "
            f"longest question ({longest} tokens), not more than --doc_stride {doc_stride}; "
            "raise --sequence_length or lower --doc_stride"
        )
    pair = _pair_tokenizer(tokenizer, max_length - 1, doc_stride, eot_token)
    eot = pair.token_to_id(eot_token)
    encodings = pair.encode_batch(list(zip(questions, [e.context for e in examples], strict=True)))
    ids, targets, owner, offsets = [], [], [], []
    for index, (example, encoding) in enumerate(zip(examples, encodings, strict=True)):
        for window in [encoding, *encoding.overflowing]:
            spans = [
                span if sequence == 1 else None
                for span, sequence in zip(window.offsets, window.sequence_ids, strict=True)
            ]
            ids.append([*window.ids, eot])
            offsets.append([*spans, None])
            targets.append(_answer_tokens(spans, example.answers[0], max_length))
            owner.append(index)
    return SquadWindows(
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(targets, dtype=torch.int64),
        torch.tensor(owner, dtype=torch.int64),
        offsets,
    )


def check_squad_flags(config: FinetuningRunConfig) -> None:
    """Raises a one-line ConfigError when ``--doc_stride`` leaves a window no new context."""
    length, stride = config.model.sequence_length, config.finetuning.doc_stride
    if stride > length - LEAST_WINDOW_OVERHEAD - 1:
        raise ConfigError(
            f"--doc_stride {stride} does not fit a SQuAD window of --sequence_length "
            f"{length}: besides its question, a separator and a padding token, a window needs "
            f"more context than the overlap (--doc_stride at most "
            f"{length - LEAST_WINDOW_OVERHEAD - 1}, less for longer questions); lower "
            "--doc_stride or raise --sequence_length"
        )


def read_squad_set(
    path: str, tokenizer: Tokenizer, sequence_length: int, options: FinetuningConfig
) -> TaskSet:
    """One SQuAD JSON file as rows: its windows of ``options.doc_stride`` overlap.

    Raises:
        DataError: the file is missing or malformed (one line naming it).
    """
    examples = read_squad(path)
    windows = squad_windows(
        examples, tokenizer, sequence_length, options.doc_stride, options.eot_token
    )
    return TaskSet.of(path, windows.input_ids, windows.targets, examples, windows)


def _pair_tokenizer(
    tokenizer: Tokenizer, length: int, doc_stride: int, eot_token: str = GPT2_EOT_TOKEN
) -> Tokenizer:
    """A copy of ``tokenizer`` that joins question and context with the separator
    (``eot_token``), cuts the context into overflowing windows of ``length`` tokens and pads
    the last."""
    pair = Tokenizer.from_str(tokenizer.to_str())
    eot = pair.token_to_id(eot_token)
    pair.post_processor = processors.TemplateProcessing(
        single="$A",
        pair=f"$A:0 {eot_token}:0 $B:1",
        special_tokens=[(eot_token, eot)],
    )
    pair.enable_truncation(length, stride=doc_stride, strategy="only_second")
    pair.enable_padding(pad_id=eot, pad_token=eot_token, length=length)
    return pair


def _cut_question(tokenizer: Tokenizer, question: str) -> str:
    """The question, cut after :data:`MAX_QUESTION_TOKENS` tokens."""
    encoding = tokenizer.encode(question)
    if len(encoding.ids) <= MAX_QUESTION_TOKENS:
        return question
    return question[: encoding.offsets[MAX_QUESTION_TOKENS - 1][1]]


def _answer_tokens(
    spans: list[tuple[int, int] | None], answer: SquadAnswer, max_length: int
) -> tuple[int, int]:
    """The first and last token of ``answer`` in a window, or the no-answer index twice when
    the window does not hold all of it (as HuggingFace's ``run_qa.py`` labels windows)."""
    context = [n for n, span in enumerate(spans) if span is not None]
    first, last = context[0], context[-1]
    if not (spans[first][0] <= answer.start and spans[last][1] >= answer.end):
        return no_answer_index(max_length), no_answer_index(max_length)
    # GPT-2 tokens carry their leading space (" Paris" covers " Paris"), so the first token is
    # the last one starting at or before the answer, the last the first ending at or after it.
    start = max(n for n in context if spans[n][0] <= answer.start)
    end = min(n for n in context if spans[n][1] >= answer.end)
    return start, end

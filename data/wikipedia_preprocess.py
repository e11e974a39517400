"""Turn wikiextractor output into one clean article per line, the input of write_into_tfrecord.py.

wikiextractor writes files (`AA/wiki_00`, ...; `.bz2` with its `-c`) of articles, either as

    <doc id="12" url="..." title="Anarchism">
    Anarchism
    <blank line>
    Anarchism is a political philosophy ...
    </doc>

or, with `--json`, one JSON object per line with `title` and `text` fields. For every article the
title is dropped, each line is stripped and its runs of whitespace collapsed, blank lines go, and the
remaining lines (paragraphs and section headings) are joined with single spaces. Articles with fewer
than `--min-length` words (stubs, leftover redirects, disambiguation fragments) are dropped.
Articles are written in input order whatever the number of `--workers`.

Example:
    python data/wikipedia_preprocess.py --input-file-path extracted/ --output-file-path corpus/
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/wikipedia_preprocess.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.errors import DataError
from data.parallel import ordered_map, run_script
from data.progress import Progress
from data.script_checks import output_file, output_folder, positive

OUTPUT_NAME = "wikicorpus_en_one_article_per_line.txt"
_DOC_START = re.compile(r'^<doc id="[^"]*"[^>]*>\s*$')


def clean_article(lines: list[str]) -> str:
    """Join an article's body lines into one line: strip, collapse whitespace, drop blank lines."""
    return " ".join(" ".join(line.split()) for line in lines if line.strip())


def iter_articles(text: str, name: str):
    """Yield the body lines of each article in one wikiextractor output file (title excluded).

    Raises:
        DataError: the text is neither wikiextractor `<doc>` nor JSON output.
    """
    if text.lstrip().startswith("{"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                article = json.loads(line)["text"]  # the body only: the title is its own field
            except (ValueError, KeyError, TypeError):
                raise DataError(
                    f"{name} line {number} is not a wikiextractor JSON article"
                ) from None
            yield article.split("\n")
        return
    body: list[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if body is None:
            if _DOC_START.match(line):
                body = []
            elif line.strip():
                raise DataError(
                    f"{name} line {number}: text outside a <doc> element; is this wikiextractor output?"
                )
        elif line.startswith("</doc>"):
            yield body[1:]  # the first line is the title
            body = None
        else:
            body.append(line)
    if body is not None:
        raise DataError(f"{name} ends inside a <doc> element (truncated file?)")


def preprocess_file(args: tuple[str, int]) -> tuple[list[str], int, int]:
    """Clean the articles of one wikiextractor output file (runs in a worker process).

    Args:
        args: (path, minimum number of words).

    Returns:
        (kept articles, number of articles read, bytes read).
    """
    path, min_words = args
    opener = bz2.open if path.endswith(".bz2") else open
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            text = file.read()
    except (UnicodeDecodeError, OSError, EOFError) as error:
        raise DataError(f"cannot read {path}: {error}") from None
    kept, seen = [], 0
    for body in iter_articles(text, path):
        seen += 1
        article = clean_article(body)
        if len(article.split()) >= min_words:
            kept.append(article)
    return kept, seen, len(text.encode("utf-8"))


def find_inputs(patterns: list[str]) -> list[str]:
    """Files to read: given files, and every file under given directories, sorted.

    Raises:
        DataError: a path does not exist or no files are found.
    """
    files: list[str] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            files.extend(sorted(str(p) for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(str(path))
        else:
            raise DataError(f"input {pattern} does not exist (check --input-file-path)")
    if not files:
        raise DataError(f"no wikiextractor output files under {' '.join(patterns)}")
    return files


def preprocess(inputs: list[str], output: Path, min_words: int, workers: int) -> tuple[int, int]:
    """Write the cleaned articles of `inputs` to `output`, one per line.

    Returns:
        (articles written, articles read).
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    progress = Progress("preprocess")
    written = 0
    tmp = output.with_name(output.name + ".partial")  # a crash leaves no complete-looking file
    with open(tmp, "w", encoding="utf-8") as out:
        for articles, seen, num_bytes in ordered_map(
            preprocess_file, ((path, min_words) for path in inputs), workers
        ):
            for article in articles:
                out.write(article + "\n")
            written += len(articles)
            progress.update(seen, 0, num_bytes)
    progress.finish()
    if progress.documents == 0:
        tmp.unlink()
        raise DataError(f"no articles found in {len(inputs)} files: are they wikiextractor output?")
    os.replace(tmp, output)
    print(
        f"[preprocess] {written} of {progress.documents} articles written to {output}",
        file=sys.stderr,
    )
    return written, progress.documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input-file-path",
        nargs="+",
        required=True,
        help="wikiextractor output directory or files",
    )
    parser.add_argument(
        "--output-file-path",
        required=True,
        type=Path,
        help=f"output directory (writes {OUTPUT_NAME}) or a .txt file",
    )
    parser.add_argument(
        "--min-length", type=int, default=10, help="drop articles with fewer words (default 10)"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    positive("--workers", args.workers)
    if args.min_length < 0:
        raise DataError(f"--min-length must be 0 or more, not {args.min_length}")
    inputs = find_inputs(args.input_file_path)
    output = args.output_file_path
    if output.suffix != ".txt":
        output_folder("--output-file-path", output)
        output = output / OUTPUT_NAME
    output_file("--output-file-path", output, map(Path, inputs), "--input-file-path")
    preprocess(inputs, output, args.min_length, args.workers)
    return 0


if __name__ == "__main__":
    run_script(main)

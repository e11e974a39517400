"""docs/design.md's map of the code names every module of the library where it lives: each
Python file outside tests/ (by git, so the tree as committed) is in its folder's row of the
"Layout of the code" table, so a new file without its line there fails here. And the library
keeps two rules of its shape: no class over 300 lines, and torch's private storage identity
(``_cdata``) used only through ``utils/torch_private.py``, where every private torch API is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.library_files import committed_python_files, known_python_files, library_files

ROOT = Path(__file__).resolve().parents[2]


def _layout_rows() -> dict[str, str]:
    """The table's rows by their path cell (a folder ends with a slash)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `([^`]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _modules() -> list[str]:
    return [f for f in library_files() if not f.endswith("__init__.py")]


def test_every_module_has_its_line_in_its_folder_s_row():
    rows = _layout_rows()
    missing = []
    for module in _modules():
        if module in rows:  # an entry script: a row of its own
            continue
        folder = max((p for p in rows if p.endswith("/") and module.startswith(p)), key=len)
        if f"`{Path(module).name}`" not in rows[folder]:
            missing.append(f"{module} (row {folder})")
    assert not missing, "docs/design.md's layout table misses: " + ", ".join(missing)


def test_the_check_catches_a_module_left_out():
    rows = _layout_rows()
    assert "`optimizer.py`" in rows["execution/engine/update/"]
    assert "`optimizer.py`" not in rows["execution/planning/"]


def test_every_docstring_that_cites_a_heading_of_the_docs_names_one_that_exists():
    cited = re.compile(r'docs/([\w/]+\.md), "([^"]+)"')
    wrong = []
    for module in _modules():
        for document, heading in cited.findall((ROOT / module).read_text()):
            headings = {
                line.lstrip("#").strip().split(":")[0]
                for line in (ROOT / "docs" / document).read_text().splitlines()
                if line.startswith("#")
            }
            if heading not in headings:
                wrong.append(f'{module}: docs/{document}, "{heading}"')
    assert not wrong, "no such heading: " + "; ".join(wrong)


def test_the_known_folders_hold_every_committed_library_file():
    """Where git cannot list the tree, the tests walk the known folders instead: they must hold
    the same files, or a copy of the tree outside git would check less (or a venv more)."""
    committed = committed_python_files()
    if committed is None:
        pytest.skip("needs the git checkout")
    missing = {f for f in committed if not f.startswith("tests/")} - set(known_python_files())
    assert not missing, "tests/library_files.py's KNOWN_FOLDERS miss: " + ", ".join(sorted(missing))


MOST_CLASS_LINES = 300


def test_no_class_of_the_library_is_over_300_lines():
    """From its ``class`` line to its last, docstring and blank lines counted."""
    long = []
    for module in library_files():
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MOST_CLASS_LINES:
                    long.append(f"{module}: {node.name} ({lines} lines)")
    assert not long, "classes over 300 lines: " + ", ".join(long)


def test_private_storage_identity_is_used_only_through_torch_private():
    home = "utils/torch_private.py"
    assert "_cdata" in (ROOT / home).read_text()  # the check looks for the right name
    users = [m for m in library_files() if m != home and "_cdata" in (ROOT / m).read_text()]
    assert not users, f"_cdata outside {home} (use its storage_id): " + ", ".join(users)


def test_every_committed_python_file_is_under_450_lines():
    """The house rule (files stay under 450 lines): a file that grows past it is split where
    its parts have homes of their own, not let through."""
    longest = {f: len((ROOT / f).read_text().splitlines()) for f in committed_python_files()}
    over = sorted(f"{f} ({n})" for f, n in longest.items() if n >= 450)
    assert not over, "over 450 lines: " + ", ".join(over)

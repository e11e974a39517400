"""The project's own Python files: what the tests that read the source walk, never whatever
else lies under the root (a venv, a build folder, a run folder: people keep them inside their
checkout)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where the library lives, for a copy of the tree that is not a git checkout (an unpacked
# release): its folders and the entry scripts beside them.
KNOWN_FOLDERS = ("benchmarks", "config", "data", "execution", "modelling", "tasks", "utils")


def committed_python_files() -> list[str] | None:
    """Every Python file git holds, or None where this is not a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return listed


def known_python_files() -> list[str]:
    found = [p for folder in KNOWN_FOLDERS for p in (ROOT / folder).rglob("*.py")]
    found += ROOT.glob("*.py")
    return sorted(str(p.relative_to(ROOT)) for p in found)


def library_files() -> list[str]:
    """Every Python file of the library outside tests/: git's list (the tree as committed, not
    stray files), or the known folders' files where git cannot say."""
    listed = committed_python_files()
    if listed is None:
        listed = known_python_files()
    return [f for f in listed if not f.startswith("tests/")]

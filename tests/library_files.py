"""The library's Python files as committed: what the checks of docs/design.md's map read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def library_files() -> list[str]:
    """Every Python file git holds outside tests/ (the tree as committed, not stray files)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the git checkout")
    return [f for f in listed if not f.startswith("tests/")]

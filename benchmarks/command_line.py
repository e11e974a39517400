"""The benchmark scripts' command lines: bad input is one line and exit status 2, as for the
entry points (execution/training/entry.py), and a file they write at the end is checked before
their minutes of measuring."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.errors import ConfigError
from data.errors import DataError


def exit_on_bad_input(main: Callable[[], Any], program: str) -> None:
    """Runs ``main()``; the user's bad input (a ConfigError or DataError) is one line on stderr
    and exit status 2 instead of a traceback."""
    try:
        main()
    except (ConfigError, DataError) as err:
        print(f"{program}: error: {err}", file=sys.stderr)
        sys.exit(2)


def check_output_file(flag: str, path: str | Path) -> None:
    """Raises a one-line ConfigError unless ``path`` can be written: its folder exists and is
    writable, and it is not a folder or a read-only file. Nothing is written."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name (in it, say)")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(
            f"{flag} {path}: its folder {folder} {what}; create it or give another path"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: its folder {folder} is not writable; give another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is read-only; give another path")


def check_output_folder(flag: str, path: str | Path) -> None:
    """Raises a one-line ConfigError unless ``path`` is a writable folder or can be made one (its
    nearest existing ancestor is a writable folder). Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a folder; give another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == path else f"cannot be made: {existing} is"
        raise ConfigError(f"{flag} {path} {what} not writable; give another path")

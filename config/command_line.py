"""Every entry point's command line: the user's bad input (a ``BadInput``: a ConfigError or a
DataError) is one line, ``{program}: error: {message}``, and exit status 2, never a traceback;
and a file a command writes at its end is checked before its minutes of work."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from config.errors import BadInput, ConfigError

BAD_INPUT_EXIT = 2  # argparse's status for a usage error


def exit_for_bad_input(program: str, message: object, say: bool = True) -> NoReturn:
    """Ends the process as bad input does: ``{program}: error: {message}`` on stderr (unless
    not ``say``: a rank of a job whose rank 0 says it) and exit status 2."""
    if say:
        print(f"{program}: error: {message}", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


def exit_on_bad_input(main: Callable[[], Any], program: str) -> Any:
    """``main()``'s result; the user's bad input it raises ends the process as
    :func:`exit_for_bad_input` does."""
    try:
        return main()
    except BadInput as err:
        exit_for_bad_input(program, err)


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

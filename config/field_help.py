"""Metadata of a config field: its ``--help`` text and, optionally, its allowed values."""

from __future__ import annotations

from typing import Any


def doc(text: str, **choices: Any) -> dict[str, Any]:
    """Field metadata: the help text shown by ``--help`` and, optionally, allowed values."""
    return {"help": text, **choices}

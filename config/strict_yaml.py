"""A YAML reader for preset files that refuses what plain ``yaml.safe_load`` lets pass silently.

PyYAML keeps the last of two equal keys in a mapping, so a preset file with a second ``model:``
section would quietly drop every setting of the first. Here a repeated key is an error that
names the key and both lines.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges, it does not repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                earlier = first_line.setdefault(key, line)
            except TypeError:  # an unhashable key; SafeLoader reports it itself
                continue
            if earlier != line:
                raise DuplicateKeyError(
                    f"key {key!r} appears twice, at lines {earlier} and {line}; "
                    "the second would silently replace the first: merge them into one"
                )
        return super().construct_mapping(node, deep=deep)


def load_strict(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` on a repeated mapping key."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects

"""Presets, flat command-line flags and validation for :class:`PretrainingConfig`.

Every user mistake raises :class:`ConfigError` (a ``ValueError``) whose message is one line naming
the flag or preset key and what would be accepted; ``run_pretraining.py`` prints it and exits 2.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from config.errors import ConfigError
from config.schema import PretrainingConfig, leaf_fields
from config.strict_yaml import load_strict
from config.validation import validate

__all__ = [
    "ConfigError",
    "OneLineParser",
    "config_to_dict",
    "load_presets",
    "one_line",
    "parse_config",
    "validate",
]

PRESETS_FILE = Path(__file__).with_name("pretraining.yml")
DEFAULT_PRESET = "tiny"
_BASE_KEY = "base"


def load_presets(path: str | Path = PRESETS_FILE) -> dict[str, dict[str, Any]]:
    """Reads the preset file and resolves ``base:`` inheritance into full nested dicts.

    Args:
        path: YAML file whose top-level keys are preset names.

    Returns:
        Preset name -> nested dict of overrides (base presets merged in).
    """
    path = Path(path)
    try:
        raw = load_strict(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read preset file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"preset file {path} is not valid YAML: {one_line(err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"preset file {path} must map preset names to settings")

    def resolve(name: str, chain: tuple[str, ...]) -> dict[str, Any]:
        if name in chain:
            raise ConfigError(f"preset {name!r} inherits from itself via {' -> '.join(chain)}")
        body = raw.get(name)
        if not isinstance(body, dict):
            raise ConfigError(f"preset {name!r} in {path} must be a mapping of settings")
        body = copy.deepcopy(body)
        parent = body.pop(_BASE_KEY, None)
        if parent is None:
            return body
        if parent not in raw:
            raise ConfigError(f"preset {name!r} has base {parent!r}, which is not in {path}")
        return _deep_merge(resolve(parent, (*chain, name)), body)

    return {name: resolve(name, ()) for name in raw}


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_from_dict(
    settings: dict[str, Any], source: str, root: type[PretrainingConfig] = PretrainingConfig
) -> PretrainingConfig:
    """Builds a config (of class ``root``) from nested overrides, rejecting keys the tree does
    not have."""
    config = root()
    leaves = {path: (owner, f) for path, owner, f in leaf_fields(config)}

    def apply(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                if not any(p.startswith(path + ".") for p in leaves):
                    raise ConfigError(f"{source}: unknown section {path!r}")
                apply(value, path + ".")
                continue
            if path not in leaves:
                if any(p.startswith(path + ".") for p in leaves):
                    raise ConfigError(
                        f"{source}: {path!r} is a section and needs a mapping of its settings, "
                        f"not {value!r}"
                    )
                raise ConfigError(f"{source}: unknown setting {path!r}")
            owner, f = leaves[path]
            setattr(owner, f.name, _coerce(value, f, f"{source}: {path}"))

    apply(settings, "")
    return config


def _coerce(value: Any, f: Any, where: str) -> Any:
    """Converts a YAML or command-line value to the field's type and checks its choices."""
    result = _coerce_type(value, f.type, where)
    choices = f.metadata.get("choices")
    if choices is not None and result not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return result


def _coerce_type(value: Any, type_name: str, where: str) -> Any:
    try:
        if type_name == "bool":
            return _parse_bool(value)
        if type_name == "int":
            return _integer(value, where)
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if type_name == "str":
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if type_name == "list[str]":
            if isinstance(value, str):
                return [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return list(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be {_TYPE_WORDS[type_name]}, got {value!r}") from None
    raise AssertionError(f"unsupported config field type {type_name}")


# Every size reaches torch, whose sizes and counts are int64: a larger integer is a bad flag,
# said here, not an OverflowError wherever it first meets a tensor.
INT64 = (-(2**63), 2**63 - 1)


def _integer(value: Any, where: str) -> int:
    """An int flag or preset value: digits exactly (a float would round past 2^53), or a
    whole number written as one (``1e6``, ``4.0``), within int64."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = float(value)
    else:
        number = value
    if isinstance(number, float) and not number.is_integer():
        raise ValueError  # nan and infinity too
    number = int(number)
    if not INT64[0] <= number <= INT64[1]:
        raise ConfigError(
            f"{where} {value} does not fit a 64-bit integer (at most 2^63 - 1 = {INT64[1]}), "
            "the sizes torch counts in; check the number"
        )
    return number


_TYPE_WORDS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "list[str]": "a list of strings",
}


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(
    presets: Sequence[str], root: type[PretrainingConfig] = PretrainingConfig
) -> argparse.ArgumentParser:
    """The command line: ``--config``, ``--config_file`` and one flag per leaf of ``root``."""
    parser = OneLineParser(
        prog=root.PROGRAM,
        description=root.DESCRIPTION,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_PRESET,
        help=f"Preset from config/pretraining.yml: {', '.join(presets)}.",
    )
    parser.add_argument(
        "--config_file", default=str(PRESETS_FILE), help="YAML file holding the presets."
    )
    for path, _, f in leaf_fields(root()):
        kwargs: dict[str, Any] = {"dest": path, "help": f.metadata.get("help", "")}
        if f.type == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif f.type == "list[str]":
            kwargs.update(nargs="*", metavar="PATH")
        else:
            kwargs["metavar"] = f.type.upper()
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_config(
    argv: Sequence[str] | None = None,
    root: type[PretrainingConfig] = PretrainingConfig,
    adjust: Callable[[PretrainingConfig, set[str]], None] | None = None,
) -> tuple[PretrainingConfig, str]:
    """Parses the command line into a validated config.

    Args:
        argv: Arguments without the program name (``sys.argv[1:]`` when None).
        root: The tree's root class (a fine-tuning run's adds its own section).
        adjust: Called before validation with the config and the dotted paths of the flags
            given (``model.sequence_length``): a root's defaults that depend on other values.

    Returns:
        The config and the name of the preset it started from.

    Raises:
        ConfigError: Unknown flag or preset, malformed value or inconsistent sizes.
    """
    pre = OneLineParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=DEFAULT_PRESET)
    pre.add_argument("--config_file", default=str(PRESETS_FILE))
    known, _ = pre.parse_known_args(argv)
    presets = load_presets(known.config_file)
    if known.config not in presets:
        raise ConfigError(
            f"unknown preset {known.config!r}; choose one of: {', '.join(sorted(presets))}"
        )
    config = config_from_dict(presets[known.config], f"preset {known.config!r}", root)

    args = vars(build_parser(sorted(presets), root).parse_args(argv))
    leaves = {path: (owner, f) for path, owner, f in leaf_fields(config)}
    for path, value in args.items():
        if path in ("config", "config_file"):
            continue
        owner, f = leaves[path]
        setattr(owner, f.name, _coerce(value, f, f"--{f.name}"))
    given = set(args) - {"config", "config_file"}
    if adjust is not None:
        adjust(config, given)
    validate(config, given)
    return config, known.config


def config_to_dict(config: PretrainingConfig) -> dict[str, Any]:
    """Nested plain-python dict of the whole tree (for config.yml and wandb)."""
    out: dict[str, Any] = {}
    for path, owner, f in leaf_fields(config):
        node = out
        *parents, _ = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[f.name] = copy.copy(getattr(owner, f.name))
    return out


def one_line(err: Exception, limit: int | None = None) -> str:
    """An exception's message on one line (whitespace collapsed), cut at ``limit`` chars."""
    return " ".join(str(err).split())[:limit]

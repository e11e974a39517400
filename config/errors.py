"""The user's bad input: its exception types (``ConfigError`` here, ``data.errors.DataError``
for data), which every entry point says as one line and exit 2 (``config/command_line.py``)."""


class BadInput(ValueError):
    """A mistake of the user's (a flag, a file, a preset), not a bug: its message is one line
    that names what is wrong and what to do."""


class ConfigError(BadInput):
    """A preset, flag or combination of values that cannot be trained.

    Its message is one line naming the flag or preset key and what would be accepted;
    An entry point prints it and exits 2.
    """


def refuse_ignored_flags(flags: list[str], applies_to: str, instead: str) -> None:
    """One line for flags given that the run would ignore: ``--a and --b only apply to
    {applies_to}; {instead}``, ``{them}`` in ``instead`` naming the flags; nothing if none."""
    if flags:
        applies, them = ("applies", "it") if len(flags) == 1 else ("apply", "them")
        raise ConfigError(
            f"{' and '.join(flags)} only {applies} to {applies_to}; {instead.format(them=them)}"
        )

"""The one exception type for a user's configuration mistakes."""


class ConfigError(ValueError):
    """A preset, flag or combination of values that cannot be trained.

    Its message is one line naming the flag or preset key and what would be accepted;
    ``run_pretraining.py`` prints it and exits 2.
    """


def refuse_ignored_flags(flags: list[str], applies_to: str, instead: str) -> None:
    """One line for flags given that the run would ignore: ``--a and --b only apply to
    {applies_to}; {instead}``, ``{them}`` in ``instead`` naming the flags; nothing if none."""
    if flags:
        applies, them = ("applies", "it") if len(flags) == 1 else ("apply", "them")
        raise ConfigError(
            f"{' and '.join(flags)} only {applies} to {applies_to}; {instead.format(them=them)}"
        )

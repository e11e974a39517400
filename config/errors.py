"""The one exception type for a user's configuration mistakes."""


class ConfigError(ValueError):
    """A preset, flag or combination of values that cannot be trained.

    Its message is one line naming the flag or preset key and what would be accepted;
    ``run_pretraining.py`` prints it and exits 2.
    """

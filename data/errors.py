"""The one exception type for user-facing data problems."""

from config.errors import BadInput


class DataError(BadInput):
    """A problem with the user's data or data options.

    The message names the file (and record, where there is one) and says what to do about it.
    Command-line scripts print it as one line and exit with status 2.
    """

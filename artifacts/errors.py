"""The one exception type for a user's mistake.

Raise :class:`PrunusError` with one line that names the input and says what to
do. The CLI prints it as a single ``Error: ...`` line and exits with code 2; the
Python API lets it propagate like any exception.
"""


class PrunusError(Exception):
    """A user-facing error: bad input, not a bug."""

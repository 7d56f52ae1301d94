"""Error types that reach the user as one line (no traceback): bad config, bad data, bad layout.

Anything else is a bug and is shown with its traceback. Messages start with the offending file or key.
"""


class UserError(Exception):
    """A problem with the user's input; printed as `error: <message>` and exit status 2."""


class ConfigError(UserError):
    """Unknown, missing or ill-typed configuration key."""

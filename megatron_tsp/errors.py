"""Mistakes a user can fix, as exceptions whose message is the one line the user sees.

``megatron-tsp`` prints a :class:`UserError` as ``megatron-tsp COMMAND: error: <message>`` and exits
non-zero, with no traceback: the message names the flag, key or file and the fix. Anything
else is a bug or a fault; the command line prints its last line and keeps the traceback in
the run's log (see ``cli.main``).
"""


class UserError(Exception):
    """A mistake with a fix; ``str()`` is one line that names the flag, key or file."""


class ConfigError(UserError, ValueError):
    """A bad configuration value, combination or file."""


class DataError(UserError):
    """Training data that cannot be used as configured (missing, truncated, out of vocabulary)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read, or does not match the model."""


class TrainingStopped(UserError):
    """Training stopped on purpose: a NaN/Inf loss or gradient norm."""

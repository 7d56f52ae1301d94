"""Error types that reach the user as one line (no traceback): bad config, bad data, bad layout.

Anything else is a bug and is shown with its traceback. Messages start with the offending file or key.
"""
from data_tools.errors import UserError  # noqa: F401 - the shared base (data_tools never imports hpctrain)


class ConfigError(UserError):
    """Unknown, missing or ill-typed configuration key."""


class CheckpointError(UserError):
    """A checkpoint could not be saved, found or loaded; the message starts with what and where.
    `state_written`: a load failed after it began writing into the job's tensors in place."""
    state_written = False


class NoIntactCheckpoint(CheckpointError):
    """The run directory holds checkpoints and none of them can be resumed from."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asked to unpickle something outside the allow-list."""


class PeerLostError(UserError):
    """A peer rank is gone or a collective failed because of it."""


class RendezvousError(UserError):
    """No address that every node can reach, or rank 0's address is not reachable."""


class RunDirBusy(UserError):
    """Another job trains in this run directory."""


class TrainingDivergedError(UserError):
    """Too many non-finite steps in a row."""

"""Exceptions keepalive raises. Each message says what happened, where, and what the user can do."""
from __future__ import annotations

from typing import Tuple


class KeepaliveError(Exception):
    """Base class of keepalive's own errors."""


class StorageError(KeepaliveError, OSError):
    """The checkpoint location cannot be used (unwritable, vanished, full, unreachable)."""


class CheckpointCorruptError(KeepaliveError):
    """A checkpoint failed verification: missing manifest or file, size or checksum mismatch."""

    def __init__(self, location: str, reason: str):
        self.location = location
        self.reason = reason
        super().__init__(f"checkpoint {location} is not valid: {reason}")


class NoCheckpointError(KeepaliveError):
    """No valid checkpoint exists where one was asked for."""


class RunLockedError(KeepaliveError):
    """Another live session holds the writer lease of this run."""


class LeaseLostError(KeepaliveError):
    """This session's writer lease was taken over by another session; it stops writing."""


class StateMismatchError(KeepaliveError):
    """A checkpoint does not fit the live objects (other keys or shapes); nothing was changed."""


class UnsupportedStateError(KeepaliveError, TypeError):
    """A value in the training state cannot be stored without pickling (loading never runs code)."""


class TrainingStopped(KeepaliveError):
    """In a notebook, the training stopped before the session's deadline after a durable save: the
    cell ends with this error so that "Run all" does not go on into cells that use the model (an
    evaluation, a ``torch.save``) as if the training had completed."""


class IncompatibleFrameworkError(KeepaliveError, RuntimeError):
    """The installed framework lacks an internal an adapter relies on (raised when the callback is
    created, never mid-training); the message is one line naming it, the version, the tested range."""

    def __init__(self, message: str, *, framework: str, missing: Tuple[str, ...]):
        self.framework = framework
        self.missing = missing
        super().__init__(message)

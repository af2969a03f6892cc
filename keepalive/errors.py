"""Exceptions keepalive raises. Each message says what happened, where, and what the user can do."""
from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Callable, Optional, Tuple, Type

#: the exit status of a script whose training keepalive stopped before its end (SIGTERM, a cloud's
#: preemption notice, the session's deadline) after a durable save: "stopped, run me again to
#: continue". 128 + SIGTERM, what a process stopped by SIGTERM reports, so torchrun, a job scheduler
#: and ``keepalive run`` restart it alike; 0 means the training ran to its end.
EXIT_STOPPED = 143


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


# ------------------------------------------------------------------ one line instead of a traceback
#: set on an exception instance whose message is the whole story (a destination that cannot be used
#: at the start of training): uncaught, it is shown as one line, in a script and in IPython alike
ONE_LINE = "keepalive_one_line"

#: the end of that line in a script: how to get the traceback back
DEBUG_HINT = "(KEEPALIVE_VERBOSITY=debug shows the traceback)"


def in_one_line(exc: BaseException) -> BaseException:
    """Mark ``exc`` (raised on, unchanged: its class, ``errno`` and message stay) so that, uncaught,
    it ends a script with :func:`one_line` as the only line on stderr (exit status 1, as for any
    uncaught exception) instead of a traceback through keepalive's internals, and a notebook cell with
    that line (:mod:`keepalive.magics.tracebacks`). ``KEEPALIVE_VERBOSITY=debug`` keeps the traceback.
    The hook only ever acts on a marked exception; every other goes to the hook that was there."""
    try:
        setattr(exc, ONE_LINE, True)
    except (AttributeError, TypeError):  # an exception with __slots__: shown as Python shows it
        return exc
    if not getattr(sys.excepthook, ONE_LINE, False):
        sys.excepthook = _OneLineHook(sys.excepthook)
    return exc


def is_one_line(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`in_one_line`."""
    return bool(getattr(exc, ONE_LINE, False))


def one_line(exc: BaseException) -> str:
    """``StorageError: cannot create or write the run folder ...``: the class and the message,
    without ``OSError``'s ``[Errno N]`` prefix (the message names the system's error itself)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}"


def first_line(exc: BaseException) -> str:
    """``ValueError: loss is nan``: the class and the first line of the message (the class alone
    without one), what a notification or a supervisor's record says of an error that ended a run.

    >>> first_line(ValueError("loss is nan\\nat step 3")), first_line(KeyboardInterrupt())
    ('ValueError: loss is nan', 'KeyboardInterrupt')
    """
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _debug() -> bool:
    from . import settings  # the same layer; read when an error is shown, not at import

    try:
        return str(settings.get("KEEPALIVE_VERBOSITY")) == "debug"
    except Exception:  # noqa: BLE001 - a malformed setting: keep the short form
        return False


class _OneLineHook:
    """``sys.excepthook`` while a marked exception may end the process: the one line for it, the
    previous hook for everything else."""

    keepalive_one_line = True

    def __init__(self, previous: Callable[..., Any]):
        self.previous = previous

    def __call__(self, etype: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if not is_one_line(value) or _debug():
            self.previous(etype, value, tb)
            return
        try:
            sys.stderr.write(f"{one_line(value)} {DEBUG_HINT}\n")
            sys.stderr.flush()
        except (ValueError, OSError):  # no stderr left: Python's own hook does its best
            self.previous(etype, value, tb)

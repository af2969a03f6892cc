"""How a supervised training process ended, written for its supervisor (``keepalive run``).

An exit status says too little: a crash and a refusal both end a script with status 1. A refusal must
not be retried (the checkpoint does not fit the model, another live session holds the run, the
framework lacks what the adapter needs: the next try ends the same way), a crash may be. So when the
supervisor names a file in ``KEEPALIVE_END_FILE``, the child's keepalive writes one JSON object there
as the interpreter exits after an uncaught exception: ``{"outcome": "refused" | "crashed", "error":
"<type>: <first line>", "type": "<type>"}``.

The exception is read at exit from ``sys.last_value``, which Python sets for an uncaught exception
before it calls ``sys.excepthook``: whatever hooks other code installed (and whether they call the
previous one), the record is written. A stopped training (status 143) and a finished one (0) write
nothing: the status says it.

>>> outcome_of(StateMismatchError("other shapes")), outcome_of(RuntimeError("CUDA out of memory"))
('refused', 'crashed')
"""
from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any, Dict, Optional

from .errors import (
    IncompatibleFrameworkError,
    LeaseLostError,
    RunLockedError,
    StateMismatchError,
    UnsupportedStateError,
    first_line,
)

__all__ = ["ENV", "REFUSALS", "outcome_of", "read", "record_at_exit"]

#: the environment variable that names the file (set by the supervisor for each child)
ENV = "KEEPALIVE_END_FILE"
#: errors that end the same way however often the training is started again
REFUSALS = (StateMismatchError, RunLockedError, LeaseLostError, UnsupportedStateError, IncompatibleFrameworkError)

_REGISTERED = False


def outcome_of(exc: BaseException) -> str:
    """``refused`` for an error a restart cannot mend, else ``crashed``."""
    return "refused" if isinstance(exc, REFUSALS) else "crashed"


def _write_at_exit() -> None:
    path = os.environ.get(ENV)
    exc = getattr(sys, "last_value", None)
    if not path or not isinstance(exc, BaseException) or isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"outcome": outcome_of(exc), "error": first_line(exc), "type": type(exc).__name__}, f)
    except OSError:  # the supervisor then judges by the exit status alone
        pass


def record_at_exit() -> None:
    """Write the end record at the interpreter's exit when ``KEEPALIVE_END_FILE`` is set (once per
    process; called when a checkpointer is made)."""
    global _REGISTERED
    if _REGISTERED or not os.environ.get(ENV):
        return
    _REGISTERED = True
    atexit.register(_write_at_exit)


def read(path: str) -> Optional[Dict[str, Any]]:
    """The record a child wrote to ``path`` (None when it wrote none, or something unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None

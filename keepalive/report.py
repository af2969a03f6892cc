"""The one way keepalive talks to the user: :func:`say` for news, :func:`warn` for problems.

Both print a line that starts with ``keepalive:`` (a notebook shows stdout and stderr under the cell; a
terminal shows both), and log it to the ``keepalive`` logger for those who collect logs. One gate
decides what is shown: ``KEEPALIVE_VERBOSITY`` (``quiet`` / ``normal`` / ``debug``) and the ``quiet=``
argument of every checkpointer, passed along as ``quiet``.

* :func:`say` — resumed, stopped, saved on a signal, uploads pending: silenced by ``quiet``.
* :func:`warn` — something the user must act on or know to trust the result (a resume that will not be
  exact, a value ignored, a mount gone): **never** silenced by ``quiet=True`` (only by
  ``KEEPALIVE_VERBOSITY=quiet`` together with ``quiet=True``), printed to stderr, and once per ``key``
  when a key is given, so a warning raised at every step is shown at the first one only.
* :func:`debug` — the log only (and the screen with ``KEEPALIVE_VERBOSITY=debug``).

>>> from keepalive.report import say, warn
>>> say("resuming run 'x'")
keepalive: resuming run 'x'
>>> say("hidden", quiet=True)
>>> warn("the batch size changed", key="doctest-bs", stream="stdout")
keepalive: warning: the batch size changed
True
>>> warn("the batch size changed", key="doctest-bs", stream="stdout")  # once per key: not shown again
False
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Optional, Set

from . import settings

__all__ = ["say", "warn", "debug", "verbosity", "reset_once"]

log = logging.getLogger("keepalive")
log.addHandler(logging.NullHandler())  # a library adds no output handler: we print ourselves

_ONCE: Set[str] = set()
_LOCK = threading.Lock()


def verbosity() -> str:
    """``quiet``, ``normal`` or ``debug`` (``KEEPALIVE_VERBOSITY``)."""
    return str(settings.get("KEEPALIVE_VERBOSITY"))


def _emit(line: str, stream: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    try:
        # one write() with its newline: print() writes the two apart, and a line said from the writer
        # thread could land inside a line the training loop prints at the same moment
        out.write(line + "\n")
        out.flush()
    except (ValueError, OSError):  # a closed stream (interpreter exit, closed pipe): the log has it
        pass


def say(message: str, *, quiet: bool = False, stream: str = "stdout") -> None:
    """One line of news for the user, unless ``quiet`` or ``KEEPALIVE_VERBOSITY=quiet``."""
    log.info(message)
    if quiet or verbosity() == "quiet":
        return
    _emit(f"keepalive: {message}", stream)


def warn(message: str, *, key: Optional[str] = None, quiet: bool = False,
         stream: str = "stderr") -> bool:
    """A problem the user must see: printed (stderr) and logged at WARNING; once per ``key``.

    Returns True when it was shown now (False: shown before under the same key, or silenced by both
    ``quiet`` and ``KEEPALIVE_VERBOSITY=quiet``).
    """
    if key is not None:
        with _LOCK:
            if key in _ONCE:
                return False
            _ONCE.add(key)
    log.warning(message)
    if quiet and verbosity() == "quiet":
        return False
    _emit(f"keepalive: warning: {message}", stream)
    return True


def debug(message: str) -> None:
    """Logged; shown only with ``KEEPALIVE_VERBOSITY=debug``."""
    log.debug(message)
    if verbosity() == "debug":
        _emit(f"keepalive: {message}", "stderr")


def reset_once(prefix: str = "") -> None:
    """Forget which keyed warnings were shown (those starting with ``prefix``), e.g. for a new run."""
    with _LOCK:
        for key in [k for k in _ONCE if k.startswith(prefix)]:
            _ONCE.discard(key)


# settings reports a KEEPALIVE_* value that does not parse through warn(); it cannot import this module,
# which reads the verbosity from it
settings.report_with(warn)

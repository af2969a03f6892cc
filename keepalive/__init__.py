"""keepalive: long notebook trainings that survive disconnects, restarts and session limits.

Importing this package stays light: no torch, TensorFlow or fastai is imported until an adapter
(``keepalive.callbacks.torch`` / ``.keras`` / ``.fastai``) is.

>>> import keepalive
>>> store = keepalive.CheckpointStore("memory://doctest/run")
"""
from __future__ import annotations

import logging

from . import rendezvous as _rendezvous
from ._version import __version__
from .errors import (
    CheckpointCorruptError,
    KeepaliveError,
    LeaseLostError,
    NoCheckpointError,
    RunLockedError,
    StateMismatchError,
    StorageError,
    TrainingStopped,
    UnsupportedStateError,
)
from .store import CheckpointInfo, CheckpointStore

logging.getLogger("keepalive").addHandler(logging.NullHandler())

__all__ = [
    "__version__", "CheckpointStore", "CheckpointInfo", "KeepaliveError", "CheckpointCorruptError",
    "NoCheckpointError", "RunLockedError", "LeaseLostError", "StateMismatchError", "StorageError",
    "TrainingStopped", "UnsupportedStateError", "load_ipython_extension", "unload_ipython_extension",
]


def _short_tracebacks_in_ipython() -> None:
    """Inside a running IPython (a notebook importing a callback, before or without
    ``%load_ext keepalive``), keepalive's own errors get a one-line traceback
    (:mod:`keepalive.magics.tracebacks`). Only where IPython is imported already: a plain script
    never imports it."""
    import sys

    module = sys.modules.get("IPython")
    try:
        shell = module.get_ipython() if module is not None else None
    except Exception:  # noqa: BLE001 - a half-imported IPython: nothing to hook
        shell = None
    if shell is None:
        return
    try:
        from .magics import tracebacks

        tracebacks.install(shell)
    except Exception as exc:  # noqa: BLE001 - tracebacks stay long; importing keepalive never fails
        logging.getLogger("keepalive").debug("no short tracebacks: %r", exc)


def load_ipython_extension(ipython) -> None:  # pragma: no cover - exercised in a real kernel
    """``%load_ext keepalive``."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:  # pragma: no cover
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)


_short_tracebacks_in_ipython()
# a torchrun restart must not read the previous attempt's peer addresses, whoever creates the group
# (torch, Accelerate, Lightning, the HF Trainer): wrap torch's env:// rendezvous now or when torch is imported
_rendezvous.install()

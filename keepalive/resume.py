"""Reading what to resume: a checkpoint's state tree, verified in the same pass that reads it.

Verification reads every byte once (the checksum pass) and the same buffers then become the state's
tensors, so a resume costs one pass over the checkpoint. Nothing from a checkpoint is executed: the
state is JSON plus raw tensor bytes (:mod:`keepalive.state`). Which checkpoint to read -- the newest
of the run's spool and destination, falling back past damaged ones -- is decided by
:meth:`keepalive.runs.Run.load_newest`, which reads each candidate with :func:`read_state`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .state import STATE_FILE, TENSOR_FILE, from_files
from .store import CheckpointInfo, CheckpointStore

if TYPE_CHECKING:  # pragma: no cover
    from .spool import Spool

__all__ = ["read_state", "load_newest"]


def read_state(info: CheckpointInfo, store: CheckpointStore) -> Dict[str, Any]:
    """The state tree of checkpoint ``info`` held by ``store``; raises
    :class:`~keepalive.errors.CheckpointCorruptError` when any byte differs from its manifest (every
    file is checked; only the state's own two are kept in memory, not an FSDP2 checkpoint's shards)."""
    return from_files(store.read_files(info, only=(STATE_FILE, TENSOR_FILE)), info.url)


def load_newest(store: CheckpointStore, spool: Optional["Spool"] = None, *, quiet: bool = False
                ) -> Optional[Tuple[CheckpointInfo, Dict[str, Any], Optional[dict]]]:
    """``(info, state tree, progress of the last writer)`` of the newest valid checkpoint of the run
    ``store`` (and its local ``spool``), or None. Shorthand for
    ``keepalive.runs.Run(store, spool=spool).load_newest()``."""
    from .runs import Run  # runs.py reads through this module: import it when called

    return Run(store, spool=spool).load_newest(quiet=quiet)

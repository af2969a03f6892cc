"""Reading what to resume: the newest valid checkpoint of a run, as a state tree.

Which checkpoint to read -- the newest of the run's spool and destination, falling back past damaged
ones -- is decided by :meth:`keepalive.runs.Run.load_newest`, which reads each candidate with
:func:`read_state` (verified in the same pass that reads it: every byte once; nothing from a
checkpoint is executed, the state is JSON plus raw tensor bytes, :mod:`keepalive.state`). Both live
in :mod:`keepalive.runs`, the one place that knows runs; this module is the shorthand for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .runs import Run, read_state
from .store import CheckpointInfo, CheckpointStore

if TYPE_CHECKING:  # pragma: no cover
    from .spool import Spool

__all__ = ["read_state", "load_newest"]


def load_newest(store: CheckpointStore, spool: Optional["Spool"] = None, *, quiet: bool = False
                ) -> Optional[Tuple[CheckpointInfo, Dict[str, Any], Optional[dict]]]:
    """``(info, state tree, progress of the last writer)`` of the newest valid checkpoint of the run
    ``store`` (and its local ``spool``), or None. Shorthand for
    ``keepalive.runs.Run(store, spool=spool).load_newest()``."""
    return Run(store, spool=spool).load_newest(quiet=quiet)

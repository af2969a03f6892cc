"""The parts :class:`keepalive.core.Checkpointer` is a facade over, one job each.

Whether a save is due is decided below this package, by the pure state machine of
:mod:`keepalive.boundary` fed the schedule's answer (:mod:`keepalive.trigger`). What the core does with
that answer lives here:

* :mod:`~keepalive.lifecycle.boundaries` -- the boundary driver: the state machine's state, and an
  adapter's batch, epoch and stage ends turned into its events, decisions carried out;
* :mod:`~keepalive.lifecycle.saving` -- what happens at a save: the writer lease, the state tree, the
  copy to host memory, the save path, waiting for the write and the uploads;
* :mod:`~keepalive.lifecycle.snapshots` -- the lazy-copy policy: which tensors a save may copy after
  the loop went on, and settling that copy before they change;
* :mod:`~keepalive.lifecycle.between_steps` -- the pause guard: saves while the loop pauses between
  steps (an evaluation), only while the state is still that of the last step;
* :mod:`~keepalive.lifecycle.resuming` -- resume: the newest valid checkpoint loaded, the counters
  positioned;
* :mod:`~keepalive.lifecycle.stops` -- the end of a training before a deadline or a VM's reclaim: the
  notice's uploads, the words, the :class:`~keepalive.errors.TrainingStopped` a notebook cell ends with
  (a script's ``SystemExit(EXIT_STOPPED)``);
* :mod:`~keepalive.lifecycle.messages` -- the one-line messages users see, and their words.

Each part holds the checkpointer it serves and uses its public attributes only: the adapters set
those (``total_epochs``, ``fingerprint``, ``lazy_sources``, ...), and the parts read them when they act.
"""
from __future__ import annotations

from typing import Callable

from ..statetree import Captured

#: an adapter's capture: its objects' and its data's state, taken when a save needs it
Capture = Callable[[], Captured]

__all__ = ["Capture"]

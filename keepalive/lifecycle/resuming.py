"""Resume: the newest valid checkpoint of a run loaded, and the checkpointer positioned at it.

The run is its destination and this machine's spool of it (:class:`keepalive.runs.Run`: the newest
valid checkpoint of both, falling back past corrupt ones). Loading takes the writer lease at once,
so that a second session on the same run learns it at the start of training, not after its first
epoch. The adapter's ``check`` may refuse the tree before anything changes; then the counters, the
plan, the extras and the epoch length come from the checkpoint, and one line says what is resumed.
The adapter restores its objects and the random state from the tree itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, cast

from .. import boundary as bd
from .. import kagglechain, resumefrom
from ..runidentity import newest_of_own_run
from ..runs import resuming_line
from ..savepath import Found
from ..statetree import StateTree

if TYPE_CHECKING:
    from ..core import Checkpointer

__all__ = ["load"]


def load(ckpt: "Checkpointer", describe: Optional[Callable[[StateTree], str]] = None,
         check: Optional[Callable[[StateTree], None]] = None) -> Optional[StateTree]:
    """:meth:`keepalive.core.Checkpointer.load`."""
    # the run = its destination and this machine's spool of it: the newest valid checkpoint of both
    # (an unnamed checkpointer moves off a finished run of another training first: keepalive.runidentity)
    found = cast(Optional[Found], newest_of_own_run(ckpt, check))
    elsewhere = None  # resume_from= (or Kaggle's input copy): read only, when the run has no checkpoint
    if found is None:
        found, elsewhere = resumefrom.newest_elsewhere(ckpt.url, ckpt.config.resume_from,
                                                       ckpt.config.storage_options, ckpt.quiet)
    kagglechain.attach(ckpt)  # opt-in: on Kaggle, the next version pushed at the session's deadline
    # Take the writer lease now, at the start of training: a second session on the same run
    # learns it at once instead of after its first epoch.
    ckpt.saver.open()
    ckpt.messages.tell_budget_used_up()
    found = ckpt.path.localize(found, ckpt.url, lambda text: ckpt.warn(text, key="world-size"))
    if found is None:
        ckpt.events.started(None)
        return None
    info, tree, previous = found
    if check is not None:
        ckpt.resumed_from = info  # for the check's messages; reset if it refuses
        try:
            check(tree)
        except BaseException:
            ckpt.resumed_from = None
            raise
    ckpt.resumed_from, ckpt.last_writer_progress = info, previous
    ckpt.saved_plan = dict(tree.get("plan") or {}) or None
    ckpt.machine.feed(bd.Restored(bd.Counters.of(tree.get("counters") or {})))
    ckpt.between_steps.mark_checkpoint()
    header = tree.get("keepalive")
    saved_length = header.get("epoch_batches") if header else None
    if ckpt.epoch_batches is None and isinstance(saved_length, int) and saved_length > 0:
        ckpt.epoch_batches = saved_length
    ckpt.extras.update(tree.get("extras") or {})
    ckpt.trigger.saved()
    if not ckpt.quiet:
        words = (lambda: describe(tree)) if describe is not None else None
        line = resuming_line(ckpt.store.run, info, ckpt.state.counters.as_dict(), previous, words)
        ckpt.say(resumefrom.told(line, info.name, elsewhere, ckpt.url) if elsewhere else line)
    ckpt.events.started(info)
    return tree

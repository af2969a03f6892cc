"""The end of a training before its time: a session's deadline, a cloud's preemption notice.

After a boundary's save (:mod:`keepalive.lifecycle.boundaries`) or a save during a pause
(:mod:`keepalive.lifecycle.between_steps`) that a cloud's notice asked for, the spooled uploads get
the time the notice leaves, then the notice is acknowledged (Azure lets the VM go early). A stop is
said in one line with its reason and what to run next; in a notebook the training call then ends
with :class:`~keepalive.errors.TrainingStopped` (once, after the save is durable), so that "Run all"
does not go on into cells that use the model as if it were trained.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .. import boundary as bd
from .. import session as _session
from ..errors import TrainingStopped
from ..session import cloud as _cloud

if TYPE_CHECKING:
    from ..core import Checkpointer

__all__ = ["Stops", "cloud_notice"]


def cloud_notice() -> Optional[_cloud.Notice]:
    """The cloud's newest preemption notice (None off a cloud VM: nothing is watched there)."""
    watcher = _cloud.watcher()
    return watcher.notice() if watcher is not None else None


class Stops:
    """How ``ckpt``'s training ends early, and the stop its training call still has to raise."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        #: in a notebook, the stop before the deadline the end of the training call raises (once)
        self.to_raise: Optional[str] = None

    def raise_stop(self) -> None:
        """In a notebook, end the training call with :class:`TrainingStopped` after a stop (once)."""
        message, self.to_raise = self.to_raise, None
        if message is not None:
            raise TrainingStopped(message)

    def notice_in(self, reason: str) -> Optional[_cloud.Notice]:
        """The cloud's notice a decision's ``reason`` comes from, if it does."""
        notice = self.ckpt.trigger.notice_hit
        if notice is None or not reason.startswith(notice.detail):
            return None
        return notice  # type: ignore[return-value]

    def flush_for_notice(self) -> None:
        """After a save a cloud's notice asked for: the uploads within the time the notice leaves,
        then the notice is acknowledged (Azure lets the VM go early)."""
        trigger = self.ckpt.trigger
        notice = trigger.notice_hit
        if notice is None:
            return
        left = notice.seconds_left()
        self.ckpt.spooled.flush(max(1.0, left - 2.0) if left is not None else None, end_of_run=False)
        watcher = _cloud.watcher()
        if watcher is not None and notice.kind != "rebalance" and trigger.on_preempt == "save_and_stop":
            watcher.acknowledge(notice)  # type: ignore[arg-type]

    def after_decision(self, decision: bd.Decision, where: str) -> None:
        """After a boundary's save (or flush): a notice's uploads, and a stop's or a notice's words."""
        ckpt = self.ckpt
        notice = self.notice_in(decision.reason)
        if notice is not None and (decision.save or decision.flush):
            self.flush_for_notice()
        if decision.stop and notice is not None:
            ckpt.say(f"stopping before the VM is reclaimed: saved {where} to {ckpt.url}. Why: {notice.detail}. "
                     "On a new VM run the same code again (or %resume_training) to continue from here; "
                     "on_preempt='save' saves and trains on instead.")
            if _session.in_notebook():
                self.to_raise = (f"training stopped: {notice.detail}; saved {where} to {ckpt.url}. The cells "
                                 "after this one did not run. Run the same code again on a new VM to continue.")
        elif notice is not None and decision.save:
            ckpt.say(f"{notice.detail}: saved {where} to {ckpt.url}; the training goes on")
        elif decision.stop:
            words = ckpt.messages.stop_words
            ckpt.say(f"stopping before the session ends: saved {where} to {ckpt.url}. Why: "
                     f"{words(decision.reason)}. In a new "
                     "session run the same code again (or %resume_training) to continue from here.")
            if _session.in_notebook():
                # "Run all" must not go on into the cells that use the model as if it were trained:
                # the end of the training call raises, after the save is durable
                self.to_raise = (
                    f"training stopped before the session ends ({words(decision.reason, short=True)}); "
                    f"saved {where} to {ckpt.url}. The "
                    "cells after this one did not run. In a new session run the same code again (or "
                    "%resume_training) to continue; on_deadline='save' saves and trains on instead.")

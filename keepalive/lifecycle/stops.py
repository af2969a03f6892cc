"""The end of a training before its time: a session's deadline, a cloud's preemption notice.

After a boundary's save (:mod:`keepalive.lifecycle.boundaries`) or a save during a pause
(:mod:`keepalive.lifecycle.between_steps`) that a cloud's notice asked for, the spooled uploads get
the time the notice leaves, then the notice is acknowledged (Azure lets the VM go early). A stop is
said in one line with its reason and what to run next. The training call then does not return as if
the training had finished (once, after the save is durable): in a notebook it ends with
:class:`~keepalive.errors.TrainingStopped`, so that "Run all" does not go on into cells that use the
model as if it were trained; in a script with ``SystemExit(EXIT_STOPPED)`` (143:
:data:`keepalive.errors.EXIT_STOPPED`), as a SIGTERM does (:func:`keepalive.interrupts.raise_for`), so
that the code after the loop does not run and a supervisor, a job scheduler or torchrun sees "stopped,
run me again to continue" (its ``finally`` blocks and ``atexit`` functions still run).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from .. import boundary as bd
from .. import distributed as _distributed
from .. import session as _session
from ..errors import EXIT_STOPPED, TrainingStopped
from ..session import cloud as _cloud
from .messages import exit_words

if TYPE_CHECKING:
    from ..core import Checkpointer

log = logging.getLogger("keepalive")

__all__ = ["Stops", "cloud_notice"]


def cloud_notice() -> Optional[_cloud.Notice]:
    """The cloud's newest preemption notice (None off a cloud VM: nothing is watched there)."""
    watcher = _cloud.watcher()
    return watcher.notice() if watcher is not None else None


class Stops:
    """How ``ckpt``'s training ends early, and the stop its training call still has to raise."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        #: what the end of the training call raises after a stop (once): :class:`TrainingStopped` in
        #: a notebook, ``SystemExit(EXIT_STOPPED)`` in a script
        self.to_raise: Optional[BaseException] = None

    def raise_stop(self) -> None:
        """End the training call after a stop (once; the caller made the stop's save durable). Under a
        process group every rank leaves together: the first to exit makes torchrun's agent SIGTERM the
        others, which must not hit rank 0 while it still uploads the stop's checkpoint."""
        stop, self.to_raise = self.to_raise, None
        if stop is None:
            return
        try:
            _distributed.GROUP.barrier()
        except Exception as exc:  # noqa: BLE001 - a peer already gone: this rank stops all the same
            log.debug("no barrier before the stop: %s", exc)
        raise stop

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
        if decision.stop:
            self.stopped(decision, where, notice)
        elif notice is not None and decision.save:
            ckpt.say(f"{notice.detail}: saved {where} to {ckpt.url}; the training goes on")

    def stopped(self, decision: bd.Decision, where: str, notice: Optional[_cloud.Notice]) -> None:
        """A stop's line, and what the end of the training call raises (nothing when the training
        reached its end all the same: its call returns as a finished one does)."""
        ckpt = self.ckpt
        notebook = _session.in_notebook()
        if notice is not None:
            line = (f"stopping before the VM is reclaimed: saved {where} to {ckpt.url}. Why: {notice.detail}. "
                    "On a new VM run the same code again (or %resume_training) to continue from here; "
                    "on_preempt='save' saves and trains on instead")
            cause = "a preemption notice"
            cell = (f"training stopped: {notice.detail}; saved {where} to {ckpt.url}. The cells after this one "
                    "did not run. Run the same code again on a new VM to continue.")
        else:
            words = ckpt.messages.stop_words
            line = (f"stopping before the session ends: saved {where} to {ckpt.url}. Why: "
                    f"{words(decision.reason)}. In a new session run the same code again (or %resume_training) "
                    "to continue from here")
            cause = "another rank" if decision.reason.startswith("another rank") else "the session's deadline"
            cell = (f"training stopped before the session ends ({words(decision.reason, short=True)}); "
                    f"saved {where} to {ckpt.url}. The cells after this one did not run. In a new session run "
                    "the same code again (or %resume_training) to continue; on_deadline='save' saves and trains "
                    "on instead.")
        ends = not decision.finished
        ckpt.say(line + (exit_words(cause) if ends and not notebook else "."))
        if ends:
            # "Run all" must not go on into the cells that use the model as if it were trained, nor a
            # script into its code after the loop; the end of the training call raises, after the
            # save is durable
            self.to_raise = TrainingStopped(cell) if notebook else SystemExit(EXIT_STOPPED)

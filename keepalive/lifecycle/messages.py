"""The one-line messages a checkpointer gives its user, and the words it explains itself with.

News (:meth:`Messages.say`) is silenced by ``quiet=True`` and said by the process that writes only;
a problem (:meth:`Messages.warn`) is always said, once per key and run, by rank 0 under a process
group (every rank finds the same problems) unless it is one rank's own. The words of a stop before the
session's deadline (its arithmetic, or the session's budget and the clock it counts from) and of the
exit of a stopped script (:data:`~keepalive.errors.EXIT_STOPPED`, whatever stopped it) are made here
too, so that every message that names them says the same.
"""
from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Optional, Union

from .. import distributed as _distributed
from .. import report
from .. import session as _session
from ..errors import EXIT_STOPPED
from ..interrupts import signal_name
from ..units import format_duration

if TYPE_CHECKING:
    from ..core import Checkpointer

log = logging.getLogger("keepalive")

__all__ = ["Messages", "exit_words"]


class Messages:
    """What ``ckpt`` says, and whether the session's used-up budget was told at the start."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        #: the warning that the session's time is (nearly) used up was given at the start of training
        self.budget_told = False

    def say(self, message: str) -> None:
        """:meth:`keepalive.core.Checkpointer.say`."""
        report.say(message, quiet=self.ckpt.quiet or not self.ckpt.path.writes)

    def warn(self, message: str, key: Optional[str] = None, own: bool = False) -> None:
        """:meth:`keepalive.core.Checkpointer.warn`."""
        group = _distributed.GROUP
        if group.active:
            if not own and not group.is_main:
                log.debug("said by rank 0: %s", message)
                return
            if own:
                message = f"rank {group.rank}: {message}"
        report.warn(message, key=None if key is None else f"{self.ckpt.url}:{key}", quiet=self.ckpt.quiet)

    def stop_words(self, reason: str, short: bool = False) -> str:
        """Why the training stops, in words: the deadline's arithmetic, or, when the session's time
        is used up, its budget and the clock it counts from (only named when the warning at the start
        of training said it all). ``short``: the first clause only."""
        why = reason[len("deadline: "):] if reason.startswith("deadline: ") else reason
        remaining = self.ckpt.trigger.remaining()
        if remaining is not None and remaining <= 0:
            if short or self.budget_told:
                return "the session's time is already used up" + ("" if short else " (said at the start of training)")
            why = self.budget_words(remaining)
        return (why.split(";")[0] if short else why).rstrip(".")

    def tell_budget_used_up(self) -> None:
        """At the start of training: when the session's time is already (nearly) used up, say so and
        from which clock it counts, before a training that stops at its first chance surprises."""
        # A checkpointer's own remaining_fn is the caller's clock: asked only at boundaries, where its
        # answer is acted on (a clock that counts its calls must not see an extra one here).
        trigger = self.ckpt.trigger
        if self.budget_told or trigger.on_deadline == "ignore" or self.ckpt.config.remaining_fn is not None:
            return
        remaining = trigger.remaining()
        if remaining is None or remaining > trigger.margin:
            return
        self.budget_told = True
        self.warn(self.budget_words(remaining), key="budget-used-up")

    def budget_words(self, remaining: float) -> str:
        """Why the session's time is up: the session module's account (the budget, its clock), or,
        with the checkpointer's own ``remaining_fn``, what it answered."""
        line = _session.budget_used_up() if self.ckpt.config.remaining_fn is None else None
        if line:
            return line
        return (f"the session has {format_duration(max(0.0, remaining))} left, less than the "
                f"{format_duration(self.ckpt.trigger.margin)} kept before its end: a training saves and stops at "
                "its first chance")


def exit_words(cause: Union[int, str]) -> str:
    """Why the process ends with a failure code after the save of a stop (torchrun reports it): the
    program did not run to its end, and a failure is what makes a supervisor start it again. The
    same words for every cause (``cause``: a signal's number, or what stopped it: "a preemption
    notice"); none for Ctrl-C (a ``KeyboardInterrupt``, as Python has it)."""
    if cause == signal.SIGINT:
        return ""
    by = signal_name(cause) if isinstance(cause, int) else cause
    return (f"; exiting with code {EXIT_STOPPED} (stopped by {by}), not 0: the program did "
            "not run to its end, and only a failed exit makes torchrun --max-restarts or a job scheduler start "
            "it again, which resumes from this checkpoint")

"""The boundary driver: what the core does at each boundary an adapter reports.

Whether a boundary saves, stops or re-raises a signal is decided by the pure state machine of
:mod:`keepalive.boundary`, fed the schedule's answer (:mod:`keepalive.trigger`); this module only
feeds it and carries its decisions out. :class:`BoundaryMachine` holds the machine's state and what
is owed to the next boundary, and takes events under one lock (the training thread's boundaries and
the pause guard's save take turns there). :class:`BoundaryDriver` turns an adapter's batch, epoch or
stage end into the machine's event, adds the schedule's answer and what is owed, combines the ranks'
decisions under a process group, and carries the decision out: a save
(:mod:`keepalive.lifecycle.saving`), a signal re-raised after its save, the words of a stop
(:mod:`keepalive.lifecycle.stops`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

from .. import boundary as bd
from .. import distributed as _distributed
from ..interrupts import raise_for, signal_name
from ..runs import position
from . import Capture
from .messages import exit_words
from .reach import ScheduleReach

if TYPE_CHECKING:
    from ..core import Checkpointer

Decision = bd.Decision

__all__ = ["BoundaryDriver", "BoundaryMachine"]


class BoundaryMachine:
    """The boundary state machine's state (:mod:`keepalive.boundary`), changed only by its events,
    and what came due where it could not be saved (a pause, a lazy copy found changed): owed to the
    next boundary."""

    def __init__(self) -> None:
        #: the training thread's boundaries and the pause guard's save take turns through the lock
        self.lock = threading.RLock()
        self.state = bd.BoundaryState()
        self._owed = bd.Due()

    def feed(self, event: bd.Event) -> Decision:
        with self.lock:  # the pause guard's thread feeds events too
            self.state, decision = bd.transition(self.state, event)
        return decision

    def count(self, event: bd.BatchEnd | bd.EpochEnd) -> bd.BatchEnd | bd.EpochEnd:
        """Move the counters for a batch or epoch end; the event that then acts without counting."""
        self.state, counted = bd.count(self.state, event)
        return counted

    def agreed(self, decision: Decision, *, save: bool, stop: bool, signal: Optional[int]) -> Decision:
        """``decision`` after every rank's save / stop / signal were combined."""
        self.state, decision = bd.agreed(self.state, decision, save=save, stop=stop, signal=signal)
        return decision

    def forget_signal(self) -> None:
        self.state = bd.evolve(self.state, pending=bd.evolve(self.state.pending, signal=None))

    def owe(self, due: bd.Due) -> None:
        self._owed = self._owed | due

    def take_owed(self) -> bd.Due:
        owed, self._owed = self._owed, bd.Due()
        return owed


class BoundaryDriver:
    """Carries out what the state machine decides at the boundaries of ``ckpt``'s training."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        #: tells once, at the first whole epoch's end, an every= that can never fire in this loop
        self.reach = ScheduleReach(ckpt)

    def before_boundary(self, capture: Capture) -> None:
        # (no settling of a lazy snapshot here: gradient accumulation's micro-batches have boundaries
        # too, and the copy may run until the optimizer step itself)
        self.ckpt.between_steps.alive()  # a boundary acts on what is due itself (not as a pause)
        self.reach.boundary(self.ckpt.state.counters)
        self.ckpt.saver.reserve(capture)  # the first boundary prepares the first save's host buffer
        self.drain_signals()

    def drain_signals(self) -> None:
        signals, machine = self.ckpt.signals, self.ckpt.machine
        signum = signals.take()
        while signum is not None:
            machine.feed(bd.Signal(signum))
            signum = signals.take()

    def batch_end(self, capture: Capture, *, steps: Optional[int], batch: Optional[int], samples: int,
                  can_save: bool, pending: bool, requested: bool, length: Optional[int]) -> Decision:
        """:meth:`keepalive.core.Checkpointer.advance`, under the machine's lock."""
        ckpt, machine = self.ckpt, self.ckpt.machine
        self.before_boundary(capture)
        n = int(steps if steps is not None else machine.state.counted_steps if ckpt.watched else 1)
        consistent = can_save and not pending
        event = machine.count(bd.BatchEnd(
            steps=n, batch=batch, samples=int(samples), positionable=can_save, grads_pending=pending,
            requested=requested))
        event = bd.evolve(event, last=self._last_batch())
        due = ckpt.trigger.after_step(n, consistent=consistent)  # sees the counters moved
        decision = machine.feed(bd.evolve(event, due=due | machine.take_owed()))
        if consistent:
            c = machine.state.counters
            decision = self.agree(decision, _distributed.Position(_distributed.BATCH_END, c.epoch, c.batch,
                                                                  int(length or 0)))
        return self.carry_out(decision, capture)

    def epoch_end(self, capture: Capture, *, last: bool, epoch: Optional[int], requested: bool,
                  count: bool) -> Decision:
        """:meth:`keepalive.core.Checkpointer.end_epoch`, under the machine's lock."""
        ckpt, machine = self.ckpt, self.ckpt.machine
        self.before_boundary(capture)
        steps = machine.state.counted_steps
        if count and machine.state.counters.batch > 0:
            ckpt.epoch_batches = machine.state.counters.batch  # this epoch's length, in the batch counter
        event = machine.count(bd.EpochEnd(epoch=epoch, last=last, requested=requested, count=count))
        due = ckpt.trigger.after_step(steps) if steps else bd.Due()  # see the counters moved
        due = due | ckpt.trigger.after_epoch() | machine.take_owed()
        decision = machine.feed(bd.evolve(event, due=due))
        if count:
            self.reach.epoch_end(machine.state.counters, last)
        if not last:
            c = machine.state.counters
            decision = self.agree(decision, _distributed.Position(_distributed.EPOCH_END, c.epoch, c.batch))
        if ckpt.training_progress is not None:
            ckpt.training_progress.epoch_end(last)
        return self.carry_out(decision, capture)

    def stage_end(self, capture: Capture, *, reason: str, epoch_end: bool, finished: bool) -> Decision:
        """:meth:`keepalive.core.Checkpointer.end_stage`."""
        ckpt = self.ckpt
        self.drain_signals()
        due = bd.Due()
        if epoch_end:
            due = bd.Due(stop=ckpt.trigger.after_epoch().stop)
            if ckpt.training_progress is not None:
                ckpt.training_progress.epoch_end(True)
        return self.carry_out(ckpt.machine.feed(bd.StageEnd(reason=reason, finished=finished, due=due)), capture)

    def _last_batch(self) -> bool:
        """Whether the batch just counted is, as far as the core can tell, the training's last: the
        last planned epoch has reached the length of the epochs before it. A guess that is wrong
        only delays a scheduled save to the next boundary."""
        c, total, length = self.ckpt.state.counters, self.ckpt.total_epochs, self.ckpt.epoch_batches
        return bool(total and length and c.epoch + 1 >= total and c.batch >= length)

    def agree(self, decision: Decision, position: _distributed.Position) -> Decision:
        """At a consistent boundary of several processes: every rank's decision combined (and every
        rank at the same ``position``, else each raises the same line)."""
        agreement = self.ckpt.path.agree(decision.save, decision.stop,
                                         decision.signal if decision.signal_note == "saved" else None, position)
        if agreement is not None:  # None: one process
            decision = self.ckpt.machine.agreed(decision, save=agreement.save, stop=agreement.stop,
                                                signal=agreement.signal)
        return decision

    def carry_out(self, decision: Decision, capture: Capture) -> Decision:
        ckpt = self.ckpt
        c = ckpt.state.counters
        news = ckpt.trigger.take_news()
        if news:
            ckpt.say(news)
        if costly := ckpt.trigger.take_costs():  # saves that cost too much of the training: once
            ckpt.warn(costly, key="save-costs")
        if decision.signal is not None and decision.signal_note == "unsaveable":
            ckpt.uninstall_signal_handlers()
            ckpt.warn(f"{signal_name(decision.signal)}: this loop cannot be saved inside an epoch "
                      f"({ckpt.mid_epoch_obstacle or 'see the earlier warning'}); stopping without a new "
                      f"checkpoint: a restart continues from the last one (epoch {c.epoch} begins again)")
            ckpt.events.ended("stopped", signal_name(decision.signal))
            raise_for(decision.signal)
        if decision.save:
            ckpt.save(capture, sync=decision.sync, reason=decision.reason, finished=decision.finished)
        elif decision.flush:
            ckpt.flush()
        where = position(c.as_dict())
        if decision.signal is not None:
            ckpt.uninstall_signal_handlers()
            ckpt.saver.give_back_lease()  # the save above is durable (sync); the process stops or idles
            had = "training had finished; " if decision.signal_note == "finished" else ""
            ckpt.say(f"{signal_name(decision.signal)}: {had}saved {where} to {ckpt.url}{exit_words(decision.signal)}")
            ckpt.events.ended("finished" if had else "stopped", signal_name(decision.signal))
            raise_for(decision.signal)
        ckpt.stops.after_decision(decision, where)
        if decision.finished:
            ckpt.events.ended("finished", "end of training")
        elif decision.stop:
            ckpt.events.ended("stopped", decision.reason)
        if decision.finished or decision.stop:
            ckpt.saver.give_back_lease()  # the training is over (the save is durable: sync)
        return decision

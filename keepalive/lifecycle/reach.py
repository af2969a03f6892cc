"""Whether the schedule the user chose (``every=``) can fire in the loop at hand.

``every=10`` counts optimizer steps, and a loop whose steps keepalive never sees (an optimizer it was
not given, a framework step it has no hook for) counts none: no save comes before the training's
end, and a kill re-trains from the start, silently. A duration (``every="10min"``) is looked at
after each step or batch keepalive counts, so such a loop never saves by time either. A schedule
longer than the whole training (more steps than it has, a duration longer than it runs) is the
same. :class:`ScheduleReach` looks once, at the end of the first whole epoch this process trains (the
first place where an epoch's steps and time are known), and says in one line what will happen and
what fixes it; it says nothing when the schedule can fire. Every adapter's epoch ends come through
the boundary driver, which feeds it.

>>> ScheduleReach.unreachable(steps_every=10, seconds_every=None, text="10", steps=0, epoch=0,
...                           batches=0, total_epochs=3, epoch_seconds=1.0)[:63]
'every=10 counts optimizer steps and none was counted in epoch 0'
>>> ScheduleReach.unreachable(steps_every=10, seconds_every=None, text="10", steps=5, epoch=0,
...                           batches=0, total_epochs=3, epoch_seconds=1.0) is None
True
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from ..boundary import Counters
from ..units import format_duration

if TYPE_CHECKING:
    from ..core import Checkpointer

__all__ = ["NO_STEPS_FIX", "ScheduleReach"]

#: what makes a loop's optimizer steps counted, for an adapter that counts them through the
#: optimizer's own hooks (torch-based loops); an adapter that counts them otherwise sets its words
#: on :attr:`ScheduleReach.no_steps_fix`
NO_STEPS_FIX = ("give DriveCheckpoint the optimizer your loop steps (optimizer=opt) so that its steps are "
                "counted, or save at every epoch's end: every='epoch'")

#: what every such line says will happen
NEVER = "no checkpoint will be saved before the training's end (a kill re-trains from its start)"


class ScheduleReach:
    """Tells once whether ``ckpt``'s ``every=`` can never fire in its loop (module docstring)."""

    def __init__(self, ckpt: "Checkpointer", clock: Callable[[], float] = time.monotonic):
        self.ckpt = ckpt
        self.clock = clock
        #: the one line that makes the loop's steps counted (an adapter may set its own words)
        self.no_steps_fix = NO_STEPS_FIX
        self.checked = False
        #: the counters where the epoch under way began (None: not seen yet), and when
        self._start: Optional[Counters] = None
        self._started_at: Optional[float] = None
        #: the counters before the newest boundary counted (an epoch end's: the batches it had)
        self._before: Counters = Counters()

    def boundary(self, counters: Counters) -> None:
        """Before a boundary counts (``counters``: what they were): the first one marks the epoch's start."""
        if self.checked:
            return
        self._before = counters
        if self._start is None:
            self._start, self._started_at = counters, self.clock()

    def epoch_end(self, counters: Counters, last: bool) -> None:
        """An epoch ended (``counters``: after it was counted). The first whole one (begun at its first
        batch, not resumed inside it) is checked, unless it ends the training: nothing to tell then."""
        start, started_at = self._start, self._started_at
        self._start, self._started_at = counters, self.clock()  # the next epoch begins here
        if self.checked or start is None or started_at is None:
            return
        if last or start.batch != 0 or counters.epoch != start.epoch + 1 or counters.step < start.step:
            return  # not one whole epoch of this process (or a new fit started the counters over)
        self.checked = True
        trigger = self.ckpt.trigger
        schedule = trigger.schedule
        if schedule.steps is None and schedule.seconds is None:
            return  # every epoch, or "auto": an epoch end always comes
        line = self.unreachable(steps_every=schedule.steps, seconds_every=schedule.seconds, text=schedule.text,
                                steps=counters.step - start.step, batches=self._before.batch, epoch=start.epoch,
                                total_epochs=self.ckpt.total_epochs,
                                # the trigger's figure holds the epoch's first batch, this one an epoch
                                # begun at the last epoch end (the trigger's mixes in a resumed part)
                                epoch_seconds=max(trigger.epoch_seconds or 0.0, self.clock() - started_at),
                                no_steps_fix=self.no_steps_fix)
        if line is not None:
            self.ckpt.warn(line, key="schedule-never-fires")

    @staticmethod
    def unreachable(*, steps_every: Optional[int], seconds_every: Optional[float], text: str, steps: int,
                    batches: int, epoch: int, total_epochs: Optional[int], epoch_seconds: float,
                    no_steps_fix: str = NO_STEPS_FIX) -> Optional[str]:
        """The line saying that the schedule cannot fire, or None when it can (or that is not known).
        ``steps``: optimizer steps counted in epoch ``epoch`` (numbered as the loop numbers it), which
        took ``epoch_seconds``; ``batches``: the batch ends it had; ``total_epochs``: the training's
        planned epochs, when known."""
        if steps_every is not None:
            if steps == 0:
                return (f"every={steps_every} counts optimizer steps and none was counted in epoch {epoch}: "
                        f"{NEVER}. To fix it, {no_steps_fix}")
            if total_epochs and steps_every > steps * total_epochs:
                return (f"every={steps_every} counts optimizer steps, and the whole training has "
                        f"{steps * total_epochs} ({total_epochs} epochs of {steps}): {NEVER}. To fix it, give "
                        f"a number it reaches, e.g. every={steps} (once an epoch), or every='epoch'")
            return None
        if seconds_every is not None and steps == 0 and batches == 0:
            return (f"every='{text}' is looked at after each optimizer step or batch keepalive counts, and none "
                    f"was counted in epoch {epoch}: {NEVER}. To fix it, {no_steps_fix}")
        if seconds_every is not None and total_epochs and seconds_every > epoch_seconds * total_epochs:
            return (f"every='{text}' is longer than the whole training (about "
                    f"{format_duration(epoch_seconds * total_epochs)}: {total_epochs} epochs of "
                    f"{format_duration(epoch_seconds)}): {NEVER}. To fix it, give a shorter duration or "
                    "every='epoch'")
        return None

"""Saves that cost the training more than a few percent: said once, with the figure and what to change.

``every=`` chooses how often to save, and a large state saved often can cost as much as the training
itself (``every=1`` with a 190 MB state ran twice as slow), with nothing said. What saves cost is
measured as ``every="auto"`` measures it (:class:`keepalive.autointerval.SaveCostMeter`: each save's
stall, plus what its background write took from the steps that ran beside it), and set against the
wall time from the first measured save to the newest: the share of the training the saves took.

It is told once (a warning: it asks for a change), when the figure is sure and matters: at least
:data:`MIN_SAVES` saves measured, at least :data:`MIN_SPENT_SECONDS` lost to them in all (a short or
toy run that saves often is not worth a line), and more than :data:`THRESHOLD` of the time. The line
names the schedule, the cost of one save and the ``every=`` that keeps saving under 1 %. Where no step
ran without a write in flight (saved at every step) the write's toll cannot be measured: the figure is
the stalls' alone, said as "at least"
(:data:`keepalive.autointerval.BUDGET`). Not for ``every="auto"``, which keeps itself under that
budget; the saves that end a training (a stop, a signal, the deadline) wait for their write and are
not measured here.

Pure arithmetic on what it is fed (no clock, no I/O); the trigger feeds it beside ``every="auto"``.
"""
from __future__ import annotations

import math
from typing import Optional

from .autointerval import BUDGET, SaveCostMeter

__all__ = ["THRESHOLD", "MIN_SAVES", "MIN_SPENT_SECONDS", "SaveCosts", "steps_within_budget",
           "duration_within_budget"]

#: the share of the training time above which the saves' cost is told ("more than a few percent")
THRESHOLD = 0.05
#: saves measured (after the first) before the share is trusted: one slow save (the first one's
#: buffer allocation, a disk's hiccup) is no pattern
MIN_SAVES = 5
#: seconds lost to saves in all before they are worth a line
MIN_SPENT_SECONDS = 5.0


def _round_up(value: float) -> int:
    """``value`` rounded up to two significant digits: 90 -> 90, 137 -> 140, 1234 -> 1300."""
    n = max(1, math.ceil(value))
    unit = 10 ** max(0, len(str(n)) - 2)
    return int(math.ceil(n / unit) * unit)


def steps_within_budget(save_seconds: float, step_seconds: float) -> int:
    """How many optimizer steps apart saves of ``save_seconds`` each must be to cost at most
    :data:`~keepalive.autointerval.BUDGET` of steps of ``step_seconds``.

    >>> steps_within_budget(0.9, 1.0)
    90
    """
    return _round_up(save_seconds / BUDGET / max(step_seconds, 1e-6))


def duration_within_budget(save_seconds: float) -> str:
    """The ``every=`` duration that keeps saves of ``save_seconds`` each within the budget.

    >>> duration_within_budget(0.9), duration_within_budget(3.0), duration_within_budget(120.0)
    ('90s', '5min', '4h')
    """
    seconds = save_seconds / BUDGET
    if seconds <= 120:
        return f"{math.ceil(seconds)}s"
    if seconds <= 2 * 3600:
        return f"{math.ceil(seconds / 60)}min"
    return f"{math.ceil(seconds / 3600)}h"


class SaveCosts:
    """What the saves of a fixed schedule cost the training, and the one line that says it when too
    much. Fed like :class:`~keepalive.autointerval.SaveCostMeter` (``step``, ``skip_step``,
    ``durable``), and :meth:`stall` with when the save began (the trigger's clock)."""

    def __init__(self) -> None:
        self.meter = SaveCostMeter()
        self._first: Optional[float] = None  # when the first measured save began
        #: the newest figures: saves measured since the first, their cost, the time they were part of
        self.saves = 0
        self.spent_seconds = 0.0
        self.elapsed_seconds = 0.0
        self._told = False

    # ------------------------------------------------------------------------------------ feeds
    def step(self, seconds: float) -> None:
        self.meter.step(seconds)

    def skip_step(self) -> None:
        self.meter.skip_step()

    def durable(self) -> None:
        self.meter.durable()

    def stall(self, seconds: float, already_durable: bool, began: float) -> None:
        """A background save began at ``began`` and kept the training waiting ``seconds``. The saves
        before it and the time up to it make one figure: what they cost (their stalls and the
        measured writes) of the time from the first one to this one."""
        if self._first is None:
            self._first = began
        else:
            self.saves = self.meter.saves
            self.spent_seconds = self.meter.spent_seconds
            self.elapsed_seconds = max(0.0, began - self._first)
        self.meter.stall(seconds, already_durable)

    # ---------------------------------------------------------------------------------- answers
    @property
    def share(self) -> Optional[float]:
        """The share of the training time the saves took (None before two saves)."""
        if not self.saves or self.elapsed_seconds <= 0:
            return None
        return min(1.0, self.spent_seconds / self.elapsed_seconds)

    def too_costly(self) -> bool:
        """Whether the saves are measured well enough, and cost enough, to be told."""
        share = self.share
        return (share is not None and self.saves >= MIN_SAVES and self.spent_seconds >= MIN_SPENT_SECONDS
                and share > THRESHOLD)

    def news(self, every: str, steps: Optional[int]) -> Optional[str]:
        """The line to say once the saves of ``every=`` (``steps``: every that many optimizer steps)
        cost more than :data:`THRESHOLD` of the training; None otherwise, and after it was said."""
        if self._told or not self.too_costly():
            return None
        self._told = True
        share = self.share or 0.0
        per_save = self.spent_seconds / self.saves
        schedule = f"every={steps}" if steps is not None else f"every={every!r}"
        if steps is not None:
            step_seconds = max(0.0, self.elapsed_seconds - self.spent_seconds) / (self.saves * steps)
            instead = f"every={max(steps + 1, steps_within_budget(per_save, step_seconds))}"
        else:
            instead = f"every={duration_within_budget(per_save)!r}"
        # a write's toll on the steps is measured against steps with no write in flight: saved at
        # every step, there are none, and the figure is the stalls' alone (a lower bound)
        least = "at least " if self.meter.idle_step_seconds is None else ""
        return (f"saves cost {least}{100 * share:.0f} % of the training time ({schedule}, {per_save:.2f} s per save, "
                f"measured over {self.saves} saves): every='auto' or {instead} keeps it under "
                f"{100 * BUDGET:.0f} %")

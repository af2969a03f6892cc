"""``every="auto"``: how often to save, from what a save costs the training and how often it is interrupted.

The interval between checkpoints balances two losses. Saving often costs time at every save: the
stall while the state is copied to host memory, plus what the background write takes from the
training (its CPU, memory bandwidth and disk compete with the steps). Saving rarely costs the work
since the last save at every interruption. With ``C`` seconds lost per save and an interruption every
``M`` seconds on average, the interval that minimises the sum is Young/Daly's ``sqrt(2 * M * C)``.
Whatever ``M`` says, checkpointing never takes more than :data:`BUDGET` (1 %) of the training time
(CheckFreq's rule): the interval is at least ``C / BUDGET``.

``C`` is measured, not guessed: the stall of each background save (the core reports it), and the
write's cost as the steps that ran while a write was in flight took longer than the steps that ran
with none (their excess, summed over the write). Both are moving averages, so the interval follows
the training as step and save times change. ``M`` is the platform profile's expected time between
interruptions (:attr:`keepalive.session.PlatformProfile.mtbf_seconds`), shorter on a cloud VM that
may be a Spot / preemptible one (:data:`keepalive.session.platforms.SPOT_VM_MTBF_SECONDS`).

Before the first save nothing is measured: the first save comes at the first epoch end or after
:data:`FIRST_SAVE_SECONDS`, whichever comes first; it measures ``C``.

This module is pure arithmetic on the figures it is fed (no clock, no I/O); the trigger feeds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .units import format_duration

__all__ = ["BUDGET", "FIRST_SAVE_SECONDS", "MIN_INTERVAL_SECONDS", "RETELL_FACTOR", "Uptime",
           "young_daly", "expected_uptime", "SaveCostMeter", "AutoInterval"]

#: the share of training time checkpointing may cost at most (CheckFreq keeps it within a few percent)
BUDGET = 0.01
#: before anything is measured: the first save comes at the first epoch end or after this long. Five
#: minutes of training is what an interruption can cost before the first checkpoint exists, and one
#: save in five minutes stays within the budget for any save that stalls less than 3 s.
FIRST_SAVE_SECONDS = 300.0
#: never more often than this, even when saves are nearly free: Young/Daly's optimum is flat (saving
#: every 60 s instead of every 10 s loses at most 25 s more per interruption, minutes apart from hours),
#: while every checkpoint is a folder of files to upload and to delete again (Drive, object stores)
MIN_INTERVAL_SECONDS = 60.0
#: the chosen interval is said again only when it changed by this factor since it was last said, and
#: the newest save's cost is within :data:`SETTLED` of the average (not in the middle of a change,
#: which would be said twice on its way), or when it changed by twice this factor
RETELL_FACTOR = 2.0
SETTLED = 0.25


def young_daly(mtbf_seconds: float, cost_seconds: float) -> float:
    """Young's first-order optimum of the interval between checkpoints, ``sqrt(2 * MTBF * C)``
    (Daly's higher-order correction changes it by less than ``C``, negligible here).

    >>> round(young_daly(3 * 3600, 0.5))
    104
    """
    return math.sqrt(2.0 * max(mtbf_seconds, 0.0) * max(cost_seconds, 0.0))


@dataclass(frozen=True)
class Uptime:
    """The expected time between interruptions and where the figure comes from."""

    seconds: float
    source: str


#: platforms that run on a VM of one's own, which may be a Spot one (Colab and Kaggle run on cloud VMs
#: too, but their profiles' figures already describe them)
OWN_VM_PLATFORMS = ("jupyter", "local")


def expected_uptime() -> Uptime:
    """The expected time between interruptions of this session: the platform profile's figure, or
    on a cloud VM of one's own (which may be a Spot / preemptible one) the Spot VM figure, whichever
    is shorter."""
    from .session import cloud, platforms

    info = platforms.detect()
    profile = platforms.get_profile(info.profile)
    uptime = Uptime(profile.mtbf_seconds, f"{profile.name} profile: {profile.mtbf_source}")
    if info.platform not in OWN_VM_PLATFORMS:
        return uptime
    try:
        vm = cloud.detect()
    except Exception:  # noqa: BLE001 - the cloud's detection never stops a training
        vm = None
    if vm and platforms.SPOT_VM_MTBF_SECONDS < uptime.seconds:
        uptime = Uptime(platforms.SPOT_VM_MTBF_SECONDS,
                        f"a {vm} VM, maybe Spot / preemptible: {platforms.SPOT_VM_MTBF_SOURCE}")
    return uptime


def _short(seconds: float) -> str:
    """A save's cost in words: ``0.21 s``; under 0.1 s in milliseconds (``4 ms``, not ``0.00 s``)."""
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.0f} ms"


def _ewma(old: Optional[float], new: float, alpha: float = 0.3) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class SaveCostMeter:
    """What one save costs the training, measured from the step times around it (fed by the trigger).

    Fed: :meth:`step` (the seconds between two step boundaries), :meth:`skip_step` (the next interval
    is no plain step: an epoch's end or start lies in it), :meth:`stall` (a background save kept the
    training waiting this long; its write begins), :meth:`durable` (the write in flight is durable).
    Besides the moving averages it keeps running totals, so that a caller can tell what the saves of
    a stretch of training cost in all (:mod:`keepalive.savecosts`).
    """

    def __init__(self) -> None:
        #: seconds between boundaries while no write is in flight (the baseline)
        self.idle_step_seconds: Optional[float] = None
        #: the stall of one save (copy to host memory)
        self.stall_seconds: Optional[float] = None
        #: what one background write takes from the training: its steps' excess over the baseline
        self.write_seconds: Optional[float] = None
        #: every stall and every measured write's cost so far, summed (seconds)
        self.stall_total = 0.0
        self.write_total = 0.0
        self._window: Optional[str] = None  # None | "open": a write in flight | "closing": it just ended
        self._excess = 0.0
        self._excess_steps = 0
        self._unpaid_stall = 0.0  # a stall inside the next step interval (the save ran at its start)
        self._skip = False
        self._last_stall: Optional[float] = None
        self._stalls = 0
        self._last_write: Optional[float] = None

    # ------------------------------------------------------------------------------------ feeds
    def skip_step(self) -> None:
        self._skip = True

    def step(self, seconds: float) -> None:
        """One interval between step boundaries."""
        seconds -= self._unpaid_stall
        self._unpaid_stall = 0.0
        if self._skip:  # an epoch's end or start (evaluation, loader start-up): no step's time
            self._skip = False
            if self._window == "closing":
                self._close()
            return
        if self._window is None:
            self.idle_step_seconds = _ewma(self.idle_step_seconds, seconds)
            return
        if self.idle_step_seconds is not None:
            self._excess += seconds - self.idle_step_seconds
            self._excess_steps += 1
        if self._window == "closing":  # this interval still overlapped the write: counted, then done
            self._close()

    def stall(self, seconds: float, already_durable: bool = False) -> None:
        """A background save kept the training waiting ``seconds``; its write is in flight unless
        ``already_durable`` (a write that finished before the copy's end was timed)."""
        self.stall_seconds = _ewma(self.stall_seconds, seconds)
        self.stall_total += seconds
        self._last_stall = seconds
        self._stalls += 1
        self._unpaid_stall = seconds
        if self._window is not None:  # a write still in flight from before: its measure is spoilt
            self._excess, self._excess_steps = 0.0, 0
        self._window = "closing" if already_durable else "open"

    def durable(self) -> None:
        """The write in flight is durable: the next step interval is its last."""
        if self._window == "open":
            self._window = "closing"

    def _close(self) -> None:
        if self._excess_steps:
            # noise can make the sum negative; a write never speeds the training up
            self._last_write = max(0.0, self._excess)
            self.write_seconds = _ewma(self.write_seconds, self._last_write)
            self.write_total += self._last_write
        elif self.write_seconds is None:
            self.write_seconds = 0.0  # no baseline yet to compare with: the stall alone, until there is
        self._window, self._excess, self._excess_steps = None, 0.0, 0

    # ---------------------------------------------------------------------------------- answers
    @property
    def saves(self) -> int:
        """How many saves' stalls were measured."""
        return self._stalls

    @property
    def measured(self) -> bool:
        """Whether a save's stall has been measured. Its write's cost counts from when it is known: a
        process that does not write (a rank other than the writer under DDP) never learns it, and
        must not wait for it."""
        return self.stall_seconds is not None

    @property
    def cost_seconds(self) -> Optional[float]:
        """What one save costs the training: its stall plus its write's cost (None before a save)."""
        if self.stall_seconds is None:
            return None
        return self.stall_seconds + (self.write_seconds or 0.0)

    @property
    def spent_seconds(self) -> float:
        """What every save so far cost the training, summed: the stalls and the measured writes."""
        return self.stall_total + self.write_total


class AutoInterval(SaveCostMeter):
    """The interval between saves, from measured costs (fed by the trigger, as a
    :class:`SaveCostMeter`) and the expected uptime. ``uptime_fn`` is asked once, when the interval
    is first needed.
    """

    def __init__(self, uptime_fn: Callable[[], Uptime] = expected_uptime):
        super().__init__()
        self._uptime_fn = uptime_fn
        self._uptime: Optional[Uptime] = None
        self._told: Optional[float] = None

    # ---------------------------------------------------------------------------------- answers
    @property
    def uptime(self) -> Uptime:
        if self._uptime is None:
            self._uptime = self._uptime_fn()
        return self._uptime

    def young_daly_seconds(self) -> Optional[float]:
        cost = self.cost_seconds
        return None if cost is None else young_daly(self.uptime.seconds, cost)

    def limited_by(self) -> str:
        """Which rule sets the interval: ``first save``, ``Young/Daly``, ``1 % budget`` or ``minimum``."""
        if not self.measured:
            return "first save"
        cost = self.cost_seconds or 0.0
        rules = {"Young/Daly": young_daly(self.uptime.seconds, cost), "1 % budget": cost / BUDGET,
                 "minimum": MIN_INTERVAL_SECONDS}
        return max(rules, key=lambda name: rules[name])

    def interval(self) -> float:
        """Seconds between saves now."""
        if not self.measured:
            return FIRST_SAVE_SECONDS
        cost = self.cost_seconds or 0.0
        return max(young_daly(self.uptime.seconds, cost), cost / BUDGET, MIN_INTERVAL_SECONDS)

    def _settled(self) -> bool:
        """Whether the newest save cost about what the average says (not in the middle of a change)."""
        cost = self.cost_seconds or 0.0
        write = self._last_write if self._last_write is not None else self.write_seconds
        newest = (self._last_stall or 0.0) + (write or 0.0)
        return abs(newest - cost) <= SETTLED * cost

    def news(self) -> Optional[str]:
        """The line to say once the interval is known, and again when it changed by
        :data:`RETELL_FACTOR` or more since it was last said (once the change has settled);
        None otherwise."""
        if not self.measured or (self.write_seconds is None and self._stalls < 2):
            return None  # said with the first write's cost, once known (or at the next save)
        interval = self.interval()
        if self._told is not None:
            change = max(interval / self._told, self._told / interval)
            if change < RETELL_FACTOR or (change < RETELL_FACTOR ** 2 and not self._settled()):
                return None
        again = self._told is not None
        self._told = interval
        stall, write = self.stall_seconds or 0.0, self.write_seconds or 0.0
        share = 100.0 * (stall + write) / interval
        percent = f"{share:.2f} %" if share >= 0.01 else "< 0.01 %"
        why = {"Young/Daly": f"Young/Daly for an interruption every ~{format_duration(self.uptime.seconds)}",
               "1 % budget": "the 1 % budget", "minimum": "the minimum interval"}[self.limited_by()]
        return (f"auto: {'now ' if again else ''}every {format_duration(interval)} ({why}); a save stalls "
                f"{_short(stall)} and its background write costs {_short(write)} = {percent} of the training")

    def state(self) -> Dict[str, Any]:
        """JSON-safe figures for ``keepalive status``."""
        interval = self.interval()
        cost = self.cost_seconds
        return {"interval_seconds": interval, "measured": self.measured, "limited_by": self.limited_by(),
                "stall_seconds": self.stall_seconds, "write_seconds": self.write_seconds,
                "cost_seconds": cost, "cost_fraction": None if cost is None else cost / interval,
                "mtbf_seconds": self.uptime.seconds, "mtbf_source": self.uptime.source,
                "young_daly_seconds": self.young_daly_seconds()}

"""When to save: every epoch, every N steps, every T minutes, and before the session's deadline.

The trigger is asked at every step boundary and every epoch end. Besides the schedule the user chose
(``every=``), it predicts from measured step, epoch and save times when the *next chance to save*
comes (the next step boundary when the loop can resume mid-epoch, else the next epoch end); if a save
there would end after the session's deadline minus a safety margin, it answers "save now" (and
"stop" with ``on_deadline="save_and_stop"``). So the last checkpoint is written while the runtime is
still alive, no optimizer step is lost, and no time is wasted stopping earlier than needed.

A cloud's preemption notice (:mod:`keepalive.session.cloud`) is a deadline that arrives now: the next
chance to save saves (and stops with ``on_preempt="save_and_stop"``). A maintenance notice long ahead
is a deadline like the session's; an advisory one (AWS' rebalance recommendation) saves once.

``every="auto"`` picks the interval from what a save is measured to cost the training and from the
platform's expected time between interruptions (:mod:`keepalive.autointerval`); the trigger feeds it
the step times, each save's stall and the moment its write is durable.
"""
from __future__ import annotations

import logging
import numbers
import threading
import time
from typing import Callable, Optional, Protocol, Union

from .autointerval import AutoInterval, Uptime, expected_uptime
from .boundary import Due
from .savecosts import SaveCosts
from .units import format_duration, parse_duration

log = logging.getLogger("keepalive.trigger")

ON_DEADLINE = ("save_and_stop", "save", "ignore")
ON_PREEMPT = ON_DEADLINE

#: seconds a preemption notice leaves when the cloud does not say (GCE's Spot notice is about 30 s)
NOTICE_SECONDS = 30.0


class NoticeLike(Protocol):
    """What the trigger reads of a cloud's notice (:class:`keepalive.session.cloud.Notice`)."""

    @property
    def kind(self) -> str: ...

    @property
    def detail(self) -> str: ...

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]: ...


class Schedule:
    """The parsed ``every=``: ``"epoch"``, an int (optimizer steps), a duration (``"10min"``) or
    ``"auto"`` (the interval chosen from measured save costs: :mod:`keepalive.autointerval`)."""

    def __init__(self, every: Union[str, int, float, None] = "epoch"):
        self.epoch = False
        self.auto = False
        self.steps: Optional[int] = None
        self.seconds: Optional[float] = None
        if isinstance(every, str) and every.strip().isdigit():
            every = int(every.strip())  # "500" is 500 steps, as 500 is (a duration has a unit)
        if every is None or every == "epoch":
            self.epoch = True
        elif isinstance(every, str) and every.strip().lower() == "auto":
            self.auto = True
        elif isinstance(every, bool):
            raise ValueError("every= takes 'epoch', 'auto', an int (steps) or a duration like '10min'")
        elif isinstance(every, numbers.Integral):  # int, numpy and torch integers alike
            if every < 1:
                raise ValueError("every= steps must be >= 1")
            self.steps = int(every)
        elif isinstance(every, str) and every.strip().lower().endswith("steps"):
            self.steps = int(every.strip().lower()[:-5].strip())
        else:
            self.seconds = parse_duration(every)
            if self.seconds <= 0:
                raise ValueError("every= duration must be positive")
        self.text = str(every)


def _ewma(old: Optional[float], new: float, alpha: float = 0.3) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class SaveTrigger:
    """Decides at each boundary whether to save now and whether to stop before the deadline.

    ``remaining_fn`` returns the session's remaining seconds (``None`` without a budget); it defaults
    to :func:`keepalive.session.remaining_seconds`. ``uptime_fn`` (``every="auto"``): the expected time
    between interruptions; default :func:`keepalive.autointerval.expected_uptime` (the platform profile).
    """

    def __init__(self, every: Union[str, int, float, None] = "epoch", *,
                 on_deadline: str = "save_and_stop", margin: Union[str, float, None] = None,
                 remaining_fn: Optional[Callable[[], Optional[float]]] = None,
                 clock: Callable[[], float] = time.monotonic, on_preempt: str = "save_and_stop",
                 notice_fn: Optional[Callable[[], Optional[NoticeLike]]] = None,
                 uptime_fn: Callable[[], Uptime] = expected_uptime):
        if on_deadline not in ON_DEADLINE:
            raise ValueError(f"on_deadline must be one of {ON_DEADLINE}, not {on_deadline!r}")
        if on_preempt not in ON_PREEMPT:
            raise ValueError(f"on_preempt must be one of {ON_PREEMPT}, not {on_preempt!r}")
        self.on_preempt = on_preempt
        #: the cloud's newest notice (None: none, or not a cloud VM); asked at every boundary
        self.notice_fn = notice_fn
        #: the notice already acted on (a notice is acted on once; the VM goes away)
        self.notice_hit: Optional[NoticeLike] = None
        self.schedule = Schedule(every)
        #: every="auto": the interval from measured costs (None for the other schedules)
        self.auto: Optional[AutoInterval] = AutoInterval(uptime_fn) if self.schedule.auto else None
        #: what the saves of any other schedule cost, told once when too much (keepalive.savecosts)
        self.costs = SaveCosts()
        #: when the last save became durable (clock): tells a write that ended before its stall was timed
        self._durable_at: Optional[float] = None
        # the writer's thread reports a durable write while the training's reports the save's stall:
        # without one lock over both, a write that became durable between the stall's check and its
        # record was lost, and every="auto" waited for it for ever (its line never said)
        self._save_lock = threading.Lock()
        self.on_deadline = on_deadline
        self.min_margin = parse_duration(margin) if margin is not None else 30.0
        self._remaining_fn = remaining_fn
        self.clock = clock
        self.step_seconds: Optional[float] = None
        self.epoch_seconds: Optional[float] = None
        self.save_seconds: Optional[float] = None
        #: what one save kept the training waiting (the copy to host memory; an EWMA)
        self.stall_seconds: Optional[float] = None
        self.steps_per_epoch: Optional[int] = None
        self._last_boundary: Optional[float] = None
        #: seconds between boundaries where a save is possible (with gradient accumulation, several
        #: batches apart): the deadline's "next chance to save"
        self.consistent_seconds: Optional[float] = None
        self._last_consistent: Optional[float] = None
        self._epoch_start: Optional[float] = None
        self._last_save_time = clock()
        self._steps_since_save = 0
        self._steps_in_epoch = 0
        self.deadline_hit = False
        #: whether saves are possible at step boundaries (mid-epoch resume available)
        self.mid_epoch = False

    # ----------------------------------------------------------------------------- measurements
    def remaining(self) -> Optional[float]:
        if self._remaining_fn is not None:
            return self._remaining_fn()
        try:
            from . import session
        except ImportError:  # pragma: no cover
            return None
        return session.remaining_seconds()

    def start_epoch(self) -> None:
        now = self.clock()
        self.costs.skip_step()
        if self.auto is not None:
            self.auto.skip_step()  # the first interval holds the loader's start, not a step
        self._epoch_start = now
        self._last_boundary = now
        self._last_consistent = now
        self._steps_in_epoch = 0

    def record_save(self, seconds: float) -> None:
        """The measured wall time of one save until it is durable (used for the margin). Called
        from the writer's thread."""
        with self._save_lock:
            self.save_seconds = max(seconds, _ewma(self.save_seconds, seconds))
            self._durable_at = self.clock()
            self.costs.durable()
            if self.auto is not None:
                self.auto.durable()

    def take_news(self) -> Optional[str]:
        """A line the user should read once (the interval ``every="auto"`` chose), or None."""
        return self.auto.news() if self.auto is not None else None

    def take_costs(self) -> Optional[str]:
        """The line that says the saves cost too much of the training, once (never for
        ``every="auto"``, which limits itself), or None."""
        return self.costs.news(self.schedule.text, self.schedule.steps) if self.auto is None else None

    def auto_state(self) -> Optional[dict]:
        """``every="auto"``'s figures, JSON-safe (for ``keepalive status``); None for other schedules."""
        return self.auto.state() if self.auto is not None else None

    def record_stall(self, seconds: float) -> None:
        """The measured time one save kept the training waiting (the copy to host memory); its
        write goes on in the background."""
        with self._save_lock:
            self.stall_seconds = _ewma(self.stall_seconds, seconds)
            began = self.clock() - seconds
            durable = self._durable_at is not None and self._durable_at >= began
            self.costs.stall(seconds, durable, began)
            if self.auto is not None:
                self.auto.stall(seconds, already_durable=durable)

    def saved(self) -> None:
        self._last_save_time = self.clock()
        self._steps_since_save = 0

    @property
    def margin(self) -> float:
        """Seconds kept free before the deadline: the configured floor or twice a measured save."""
        return max(self.min_margin, 2.0 * (self.save_seconds or 0.0))

    # -------------------------------------------------------------------------------- decisions
    def after_step(self, steps: int = 1, consistent: bool = True) -> Due:
        """After a step boundary; ``steps`` optimizer steps ran since the last one (e.g. Keras'
        ``steps_per_execution``; 0 while gradients are accumulated). ``step_seconds`` stays the time
        between boundaries; ``consistent``: a save would be possible at this one."""
        now = self.clock()
        if self._last_boundary is not None:
            self.step_seconds = _ewma(self.step_seconds, now - self._last_boundary)
            self.costs.step(now - self._last_boundary)
            if self.auto is not None:
                self.auto.step(now - self._last_boundary)
        self._last_boundary = now
        if consistent:
            if self._last_consistent is not None:
                self.consistent_seconds = _ewma(self.consistent_seconds, now - self._last_consistent)
            self._last_consistent = now
        self._steps_since_save += steps
        self._steps_in_epoch += steps
        s = self.schedule
        if s.steps is not None and self._steps_since_save >= s.steps:
            return self._with_deadline(Due(save=f"every {s.steps} steps"), now)
        if s.seconds is not None and now - self._last_save_time >= s.seconds:
            return self._with_deadline(Due(save=f"every {s.text}"), now)
        if self.auto is not None and now - self._last_save_time >= self.auto.interval():
            return self._with_deadline(Due(save=f"every {format_duration(self.auto.interval())} (auto)"), now)
        return self._with_deadline(Due(), now)

    def after_epoch(self) -> Due:
        now = self.clock()
        if self._epoch_start is not None:
            self.epoch_seconds = _ewma(self.epoch_seconds, now - self._epoch_start)
        if self._steps_in_epoch:
            self.steps_per_epoch = self._steps_in_epoch
        self._epoch_start = now
        self._last_boundary = now
        self._steps_in_epoch = 0
        if self.schedule.epoch:
            return self._with_deadline(Due(save="end of epoch"), now, at_epoch_end=True)
        self.costs.skip_step()
        if self.auto is not None:
            self.auto.skip_step()  # the next interval holds the epoch's end (evaluation), not a step
            if not self.auto.measured:  # the first save measures what a save costs
                return self._with_deadline(Due(save="end of the first epoch (auto: measures a save's cost)"),
                                           now, at_epoch_end=True)
        return self._with_deadline(Due(), now, at_epoch_end=True)

    def _horizon(self, at_epoch_end: bool) -> Optional[float]:
        """Seconds until the next boundary at which a save is possible, or None if none is here."""
        if self.mid_epoch:
            return max(self.step_seconds or 0.0, self.consistent_seconds or 0.0)
        if not at_epoch_end:
            return None  # only epoch ends can be saved: decide there
        return self.epoch_seconds or 0.0

    def notice_due(self, horizon: Optional[float]) -> Optional[Due]:
        """What a cloud's notice asks for at a chance to save ``horizon`` seconds before the next one
        (None: not here; between steps, 0): a preemption saves now; a maintenance ahead of time when
        waiting would cross it; an advisory notice saves once and trains on."""
        if self.notice_fn is None or self.on_preempt == "ignore":
            return None
        notice = self.notice_fn()
        if notice is None or notice is self.notice_hit:
            return None
        left = notice.seconds_left()
        if notice.kind == "maintenance" and left is not None and horizon is not None:
            if left > horizon + (self.save_seconds or 0.0) + self.margin:
                return None  # far ahead: like the session's deadline, acted on when waiting would cross it
        elif horizon is None and notice.kind != "rebalance":
            return None  # no chance to save here (only epoch ends can be saved): decide there
        self.notice_hit = notice
        if notice.kind == "rebalance":
            reason = f"{notice.detail}: saving now, training goes on"
            log.warning("%s", reason)
            return Due(save=reason)
        stop = self.on_preempt == "save_and_stop"
        reason = f"{notice.detail}" + (" -> saving now and stopping" if stop else " -> saving now")
        log.warning("%s", reason)
        return Due(save=reason, stop=reason if stop else None)

    def _with_deadline(self, decision: Due, now: float, at_epoch_end: bool = False) -> Due:
        horizon = self._horizon(at_epoch_end)
        notice = self.notice_due(horizon)
        if notice is not None:
            return notice | decision  # the notice's reason is said; the schedule's save is the same save
        if self.on_deadline == "ignore" or self.deadline_hit:
            return decision
        if horizon is None:
            return decision
        remaining = self.remaining()
        if remaining is None:
            return decision
        needed = horizon + (self.save_seconds or 0.0) + self.margin
        if remaining > needed:
            return decision
        self.deadline_hit = True
        stop = self.on_deadline == "save_and_stop"
        ends = ("the session's time is already used up" if remaining <= 0
                else f"the session ends in {format_duration(remaining)}")
        reason = (f"{ends}; the next chance to save is "
                  f"{format_duration(horizon)} away, a save takes {format_duration(self.save_seconds or 0)} "
                  f"and {format_duration(self.margin)} are kept as margin")
        log.warning("deadline: %s -> saving now%s", reason, " and stopping" if stop else "")
        return Due(save=f"deadline: {reason}", stop=f"deadline: {reason}" if stop else None)

    def between_steps_due(self, slack: float = 0.0) -> Due:
        """While the loop is away from its step boundaries (a long evaluation, a data stall): what
        cannot wait for the next one. A notice, or the session's deadline within a save, the margin
        and ``slack`` seconds (how long until this is asked again)."""
        notice = self.notice_due(0.0)
        if notice is not None:
            return notice
        if self.on_deadline == "ignore" or self.deadline_hit:
            return Due()
        remaining = self.remaining()
        if remaining is None or remaining > (self.save_seconds or 0.0) + self.margin + slack:
            return Due()
        self.deadline_hit = True
        ends = ("the session's time is already used up" if remaining <= 0
                else f"the session ends in {format_duration(remaining)}")
        reason = (f"{ends}, during a pause of the training loop (a save takes "
                  f"{format_duration(self.save_seconds or 0)}, {format_duration(self.margin)} are kept as margin)")
        stop = self.on_deadline == "save_and_stop"
        log.warning("deadline: %s -> saving now%s", reason, " and stopping" if stop else "")
        return Due(save=f"deadline: {reason}", stop=f"deadline: {reason}" if stop else None)

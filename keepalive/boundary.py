"""What happens at a boundary of the training: save, stop, re-raise a signal, or nothing.

One pure state machine: a :class:`BoundaryState` (the counters, what is owed, where the last save
was) and the events an adapter's hooks produce (:class:`OptimizerStep`, :class:`BatchEnd`,
:class:`EpochEnd`, :class:`StageEnd`, :class:`Signal`, :class:`Deadline`, :class:`Saved`, ...).
:func:`transition` maps a state and an event to the next state and an immutable :class:`Decision`.
No I/O, no clock, no framework, no threads: the schedule's answer (``every=``, the deadline) comes in
with the event as a :class:`Due`, and :class:`keepalive.core.Checkpointer` carries the decision out.

The rules it encodes:

* **Steps are the optimizer's steps.** Optimizer step hooks feed :class:`OptimizerStep`; a boundary
  counts the steps of the most-stepping optimizer since the previous boundary (two optimizers
  stepping once per batch, as in a GAN, make one step; an iteration that steps 100 times makes 100).
  An adapter whose framework counts steps itself passes ``steps=`` instead.
* **Saves land only where the state is consistent**: at an epoch end, or at a batch end that can be
  resumed (``positionable``) with no gradient pending. What comes due anywhere else (a scheduled
  save, a stop before the deadline, a save asked for by hand, a signal) is owed and done at the next
  consistent boundary, never lost.
* A save is made only when the counters moved since the last one, unless it ends the training or a
  stage (code that ran since may have changed the state). A save that comes due at the training's
  last batch is made by the end of training right after it: the last step is written once.
* A signal (Ctrl-C, SIGTERM) is saved at the next consistent boundary, then re-raised; a second one
  acts at once; in a loop that cannot be saved inside an epoch it acts at the next batch end without
  a save.

>>> from keepalive.boundary import BatchEnd, BoundaryState, Due, EpochEnd, OptimizerStep, transition
>>> s = BoundaryState()
>>> s, d = transition(s, OptimizerStep(0))
>>> s, d = transition(s, BatchEnd(due=Due(save="every 1 steps")))
>>> d.save, d.reason, s.counters.step
(True, 'every 1 steps', 1)
>>> s, d = transition(s, BatchEnd(grads_pending=True, due=Due(save="every 1 steps")))
>>> d.save, s.pending.save                          # owed: gradients are being accumulated
(False, 'every 1 steps')
>>> s, d = transition(s, EpochEnd())
>>> d.save, d.reason, s.counters.epoch
(True, 'every 1 steps', 1)
"""
from __future__ import annotations

import signal as _signal
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, MutableMapping, Optional, Tuple, TypeVar, Union

__all__ = [
    "COUNTER_NAMES", "BatchEnd", "BoundaryState", "CounterView", "Counters", "Deadline", "Decision", "Due",
    "EpochCounted", "EpochEnd", "Event", "Finish", "NewFit", "OptimizerStep", "Pending", "Restored", "Saved",
    "SetCounter", "Signal", "StageEnd", "agreed", "count", "evolve", "signal_name", "transition",
]

#: the counters every adapter shares: epochs completed, optimizer steps, batches done in the running
#: epoch, samples seen
COUNTER_NAMES = ("epoch", "step", "batch", "samples")


@dataclass(frozen=True)
class Counters:
    epoch: int = 0
    step: int = 0
    batch: int = 0
    samples: int = 0

    def as_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "batch": self.batch, "samples": self.samples}

    @classmethod
    def of(cls, values: Mapping[str, object]) -> "Counters":
        return cls(**{k: int(values.get(k, 0) or 0) for k in COUNTER_NAMES})  # type: ignore[call-overload]


@dataclass(frozen=True)
class Pending:
    """What is owed to the next consistent boundary: a save (its reason), a stop, a signal."""

    save: Optional[str] = None
    stop: Optional[str] = None
    signal: Optional[int] = None

    def __bool__(self) -> bool:
        return self.save is not None or self.stop is not None or self.signal is not None


@dataclass(frozen=True)
class Due:
    """The schedule's answer at a boundary (:class:`keepalive.trigger.SaveTrigger`): a save is due
    (its reason), and / or the session's deadline asks to stop (its reason)."""

    save: Optional[str] = None
    stop: Optional[str] = None

    def __or__(self, other: "Due") -> "Due":
        """Both answers at one boundary (the first reason wins)."""
        return Due(save=self.save or other.save, stop=self.stop or other.stop)


@dataclass(frozen=True)
class Decision:
    """What the core does now. ``save``: write the state (``sync``: wait until durable);
    ``flush``: nothing new to write, but wait for the write in flight; ``finished``: the checkpoint
    ends the training; ``stop``: end the training cleanly; ``signal``: re-raise this signal after
    the save (``signal_note`` says how: ``saved``, ``finished``, ``unsaveable``: no save possible
    here, ``insisted``: a second signal, at once, ``received``: just noted)."""

    save: bool = False
    sync: bool = False
    flush: bool = False
    stop: bool = False
    finished: bool = False
    reason: str = ""
    signal: Optional[int] = None
    signal_note: str = ""

    def __bool__(self) -> bool:
        return self.save or self.stop


@dataclass(frozen=True)
class BoundaryState:
    counters: Counters = Counters()
    pending: Pending = Pending()
    #: optimizer steps per optimizer (by index) since the previous boundary
    steps_seen: Tuple[int, ...] = ()
    #: the counters of the newest save (or of the checkpoint resumed from)
    saved_at: Optional[Counters] = None
    finished: bool = False
    stopped: bool = False
    stop_reason: Optional[str] = None

    @property
    def counted_steps(self) -> int:
        """Optimizer steps since the previous boundary, by the most-stepping optimizer."""
        return max(self.steps_seen, default=0)

    @property
    def unsaved(self) -> bool:
        return self.saved_at != self.counters


T = TypeVar("T")


def evolve(obj: T, **changes: object) -> T:
    """A copy of the frozen record ``obj`` with ``changes``: ``dataclasses.replace`` without its cost
    (it re-runs ``__init__``; this runs at every batch). The records here have no ``__post_init__``."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


class CounterView(MutableMapping[str, int]):
    """The counters as a dict (``epoch``, ``step``, ``batch``, ``samples``) for adapters; setting one
    feeds a :class:`SetCounter` event, like every other change of the state."""

    def __init__(self, get: Callable[[], Counters], feed: Callable[["SetCounter"], object]):
        self._get, self._feed = get, feed

    def __getitem__(self, name: str) -> int:
        if name not in COUNTER_NAMES:
            raise KeyError(name)
        return getattr(self._get(), name)

    def __setitem__(self, name: str, value: int) -> None:
        self._feed(SetCounter(name, int(value)))

    def __delitem__(self, name: str) -> None:
        raise TypeError("counters cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(COUNTER_NAMES)

    def __len__(self) -> int:
        return len(COUNTER_NAMES)

    def __repr__(self) -> str:
        return repr(dict(self))


# ------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class OptimizerStep:
    """A registered optimizer stepped (its step hook); ``index`` tells the optimizers apart."""

    index: int = 0


@dataclass(frozen=True)
class BatchEnd:
    """A training batch ended. ``steps``: optimizer steps it made, when the framework counts them
    (else the :class:`OptimizerStep` events since the previous boundary count); ``batch``: the batch
    index reached in the epoch, when known absolutely (else it moves by the batch's steps); ``positionable``: the
    loop can be resumed here; ``grads_pending``: gradients are being accumulated; ``requested``: the
    user asked for a save during the batch; ``last``: the training's last batch, as far as the core
    can tell (its end-of-training save follows)."""

    steps: Optional[int] = None
    batch: Optional[int] = None
    samples: int = 0
    positionable: bool = True
    grads_pending: bool = False
    requested: bool = False
    last: bool = False
    due: Due = Due()


@dataclass(frozen=True)
class EpochEnd:
    """An epoch ended (``epoch``: epochs now complete, when the framework says; ``last``: the
    training's end, always saved; ``count=False``: the end of training where no epoch ended, e.g. a
    fit stopped by another callback). Optimizer steps since the previous boundary count too (a loop
    that draws its own batches has no other boundary)."""

    epoch: Optional[int] = None
    last: bool = False
    count: bool = True
    requested: bool = False
    due: Due = Due()


@dataclass(frozen=True)
class EpochCounted:
    """An epoch ended whose boundary is acted on later (at a :class:`StageEnd`)."""


@dataclass(frozen=True)
class StageEnd:
    """A stage of the training ended (a fit of several): always saved and made durable."""

    reason: str = "end of stage"
    finished: bool = False
    due: Due = Due()


@dataclass(frozen=True)
class Signal:
    """SIGINT / SIGTERM arrived (``signum``)."""

    signum: int


@dataclass(frozen=True)
class Deadline:
    """A stop is owed before something ends (the session's deadline, a preemption notice)."""

    reason: str


@dataclass(frozen=True)
class Saved:
    """The state at the current counters was handed to the writer."""


@dataclass(frozen=True)
class Restored:
    """A checkpoint with these counters was loaded."""

    counters: Counters


@dataclass(frozen=True)
class NewFit:
    """A new training call with the same checkpointer: end states start over; ``keep_counters``: a
    further stage of the same run (only the batch counter resets)."""

    keep_counters: bool = False


@dataclass(frozen=True)
class Finish:
    """The training is (``value``) or is not complete, as the adapter learned it (a resumed fit)."""

    value: bool = True


@dataclass(frozen=True)
class SetCounter:
    """An adapter sets a counter from its framework's own (e.g. Keras' epoch of a resumed fit)."""

    name: str
    value: int


Event = Union[OptimizerStep, BatchEnd, EpochEnd, EpochCounted, StageEnd, Signal, Deadline, Saved, Restored,
              NewFit, Finish, SetCounter]

NOTHING = Decision()


def transition(state: BoundaryState, event: Event) -> Tuple[BoundaryState, Decision]:
    """The next state and what to do now (see the module docstring)."""
    if isinstance(event, OptimizerStep):
        seen = list(state.steps_seen) + [0] * max(0, event.index + 1 - len(state.steps_seen))
        seen[event.index] += 1
        return evolve(state, steps_seen=tuple(seen)), NOTHING
    if isinstance(event, BatchEnd):
        return _batch_end(state, event)
    if isinstance(event, EpochEnd):
        return _epoch_end(state, event)
    if isinstance(event, EpochCounted):
        c = state.counters
        return evolve(state, counters=evolve(c, epoch=c.epoch + 1, batch=0)), NOTHING
    if isinstance(event, StageEnd):
        return _stage_end(state, event)
    if isinstance(event, Signal):
        if state.pending.signal is not None:  # asked twice: the user insists, act now
            return (evolve(state, pending=evolve(state.pending, signal=None)),
                    Decision(signal=event.signum, signal_note="insisted"))
        return (evolve(state, pending=evolve(state.pending, signal=event.signum)),
                Decision(signal_note="received"))
    if isinstance(event, Deadline):
        p = state.pending
        return evolve(state, pending=evolve(p, stop=p.stop or event.reason)), NOTHING
    if isinstance(event, Saved):
        return evolve(state, saved_at=state.counters), NOTHING
    if isinstance(event, Restored):
        return evolve(state, counters=event.counters, saved_at=event.counters, steps_seen=()), NOTHING
    if isinstance(event, NewFit):
        c = evolve(state.counters, batch=0) if event.keep_counters else Counters()
        return evolve(state, counters=c, finished=False, stopped=False, stop_reason=None), NOTHING
    if isinstance(event, Finish):
        return evolve(state, finished=event.value), NOTHING
    if isinstance(event, SetCounter):
        if event.name not in COUNTER_NAMES:
            raise KeyError(event.name)
        return evolve(state, counters=evolve(state.counters, **{event.name: int(event.value)})), NOTHING
    raise TypeError(f"not a boundary event: {event!r}")


def count(state: BoundaryState, event: Union[BatchEnd, EpochEnd]) -> Tuple[BoundaryState, Union[BatchEnd, EpochEnd]]:
    """The counting half of a batch or epoch end, alone: the state with its counters moved, and the
    event that acts at that boundary without counting again. (The schedule is asked between the two,
    so that what it reads, e.g. a deadline that depends on the step, sees the new counters.)"""
    counted = evolve(state, counters=_counted(state, event), steps_seen=())
    if isinstance(event, BatchEnd):
        return counted, evolve(event, steps=0, batch=counted.counters.batch, samples=0)
    return counted, evolve(event, count=False, epoch=None)


def _counted(state: BoundaryState, ev: Union[BatchEnd, EpochEnd]) -> Counters:
    """The counters after a batch or epoch end: the steps counted since the previous boundary (or
    the batch's own), its batch and samples; an epoch end's epoch."""
    c = state.counters
    if isinstance(ev, BatchEnd):
        steps = state.counted_steps if ev.steps is None else int(ev.steps)
        return Counters(c.epoch, c.step + steps, c.batch + steps if ev.batch is None else int(ev.batch),
                        c.samples + int(ev.samples))
    if not ev.count:
        return Counters(c.epoch, c.step + state.counted_steps, c.batch, c.samples)
    return Counters(c.epoch + 1 if ev.epoch is None else int(ev.epoch), c.step + state.counted_steps, 0, c.samples)


def _owe(pending: Pending, due: Due, requested: bool) -> Pending:
    if not requested and due.save is None and due.stop is None:
        return pending
    save = pending.save
    if requested:
        save = "by hand"
    if due.save is not None:
        save = due.save if save is None or requested else save
    return Pending(save=save, stop=due.stop or pending.stop, signal=pending.signal)


def _batch_end(state: BoundaryState, ev: BatchEnd) -> Tuple[BoundaryState, Decision]:
    pending = _owe(state.pending, ev.due, ev.requested)
    state = evolve(state, counters=_counted(state, ev), pending=pending, steps_seen=())
    if ev.last and pending.stop is None and pending.signal is None:
        # the training's last batch: the save of its end follows at once and pays what is owed here
        # (the same step written once, not twice); were this not the last batch after all, the next
        # boundary pays it
        return state, NOTHING
    if ev.positionable and not ev.grads_pending:
        return _act(state)
    if not ev.positionable and pending.signal is not None:
        # the loop cannot be saved inside an epoch: the signal acts now, without a save
        return (evolve(state, pending=evolve(pending, signal=None)),
                Decision(signal=pending.signal, signal_note="unsaveable"))
    return state, NOTHING


def _epoch_end(state: BoundaryState, ev: EpochEnd) -> Tuple[BoundaryState, Decision]:
    pending = _owe(state.pending, ev.due, ev.requested)
    state = evolve(state, counters=_counted(state, ev), pending=pending, steps_seen=())
    if not ev.last:
        return _act(state)
    # the training's end: always saved, durably; a signal that came during its last epoch's
    # validation takes effect after that save
    return (evolve(state, pending=Pending(), finished=True),
            Decision(save=True, sync=True, finished=True, reason="end of training", signal=pending.signal,
                     signal_note="finished" if pending.signal is not None else ""))


def _stage_end(state: BoundaryState, ev: StageEnd) -> Tuple[BoundaryState, Decision]:
    p = state.pending
    stop = ev.due.stop or p.stop
    c = state.counters
    state = evolve(state, pending=Pending(), steps_seen=(), counters=evolve(c, step=c.step + state.counted_steps),
                    finished=state.finished or ev.finished,
                    stopped=state.stopped or stop is not None,
                    stop_reason=stop if stop is not None else state.stop_reason)
    return state, Decision(save=True, sync=True, finished=ev.finished, stop=stop is not None,
                           reason=stop if stop is not None and p.signal is None else ev.reason,
                           signal=p.signal, signal_note="saved" if p.signal is not None else "")


def _act(state: BoundaryState) -> Tuple[BoundaryState, Decision]:
    """A consistent boundary: pay what is owed."""
    p = state.pending
    if not p:
        return state, NOTHING
    new = state.unsaved
    cleared = evolve(state, pending=Pending())
    if p.signal is not None:
        return cleared, Decision(save=new, sync=True, flush=not new, reason=f"{signal_name(p.signal)} received",
                                 signal=p.signal, signal_note="saved")
    if p.stop is not None:
        return (evolve(cleared, stopped=True, stop_reason=p.stop),
                Decision(save=new, sync=True, flush=not new, stop=True, reason=p.stop))
    return cleared, Decision(save=new, reason=p.save or "a save came due")


def agreed(state: BoundaryState, decision: Decision, *, save: bool, stop: bool,
           signal: Optional[int]) -> Tuple[BoundaryState, Decision]:
    """A consistent boundary of several processes: ``decision`` (this rank's) after every rank's
    save / stop / signal were combined, so that all save and stop at the same boundary and a signal
    that reached one rank acts on all."""
    new = state.unsaved
    if signal is not None and decision.signal is None:
        return state, Decision(save=new, sync=True, flush=not new, finished=decision.finished,
                               reason=f"{signal_name(signal)} received", signal=signal, signal_note="saved")
    if stop and not decision.stop:
        why = "another rank stops before the session ends"
        return (evolve(state, stopped=True, stop_reason=why),
                Decision(save=new or decision.save, sync=True, flush=not new, stop=True, reason=why,
                         finished=decision.finished, signal=decision.signal, signal_note=decision.signal_note))
    if save and not decision.save and new:
        return state, evolve(decision, save=True, reason=decision.reason or "a save came due on another rank")
    return state, decision


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

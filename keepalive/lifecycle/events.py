"""The run's events, told to whoever listens: started or resumed, a step, a save, its end.

The core emits; listeners act (notifications, the run's heartbeat and history). Each checkpointer has
one :class:`RunEvents`; a listener subclasses :class:`RunListener` and overrides what it needs:

>>> class Printer(RunListener):
...     def ended(self, ckpt, outcome, reason):
...         print(outcome, reason)
>>> events = RunEvents(ckpt=None)
>>> events.subscribe(Printer())
>>> events.ended("stopped", "deadline: 5 min left"); events.ended("finished", "")  # only the first end counts
stopped deadline: 5 min left

An end is one of :data:`OUTCOMES`: ``finished`` (the training ran to its end), ``stopped`` (a deadline,
a cloud's notice, a signal: resumable), ``crashed`` (an exception ended the script: its one line),
``closed`` (the checkpointer was closed without either). It is told once per training;
:meth:`RunEvents.started` begins the next one (Keras' second ``fit``). A close is told only when
nothing follows it: adapters close their checkpointer between two fits of one training (fastai's
``fine_tune``), and the next fit's first step takes the close back; a crash told later replaces it;
otherwise it is told when the process exits.

A listener must be cheap (``stepped`` runs after every batch: throttle there) and must not raise: a
listener that raises is logged and never called again, so that no listener slows or breaks a
training. A script's uncaught exception is told as ``crashed`` by :func:`install_crash_hook` (a
notebook's cell errors are told by the IPython extension, which sees them).
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, List, Optional, Type

from ..endrecord import record_at_exit
from ..errors import first_line

if TYPE_CHECKING:
    from ..store import CheckpointInfo, WriteResult

log = logging.getLogger("keepalive")

__all__ = ["RunListener", "RunEvents", "OUTCOMES", "install_crash_hook", "tell_crash"]

OUTCOMES = ("finished", "stopped", "crashed", "closed")


class RunListener:
    """What a listener may be told; every method does nothing unless overridden."""

    def started(self, ckpt: Any, resumed_from: "Optional[CheckpointInfo]") -> None:
        """The training starts: from ``resumed_from`` (None: a new run)."""

    def stepped(self, ckpt: Any) -> None:
        """A training batch was counted (``ckpt.state.counters``): called after every batch."""

    def saved(self, ckpt: Any, result: "WriteResult") -> None:
        """A checkpoint was committed."""

    def ended(self, ckpt: Any, outcome: str, reason: str) -> None:
        """The training ended: ``outcome`` one of :data:`OUTCOMES`, ``reason`` in words."""


class RunEvents:
    """One checkpointer's listeners and the state of its training (started, ended)."""

    def __init__(self, ckpt: Any):
        self._ckpt = weakref.ref(ckpt) if ckpt is not None else (lambda: None)
        self._listeners: List[RunListener] = []
        self._lock = threading.Lock()
        #: the training started and has not ended yet
        self.running = False
        #: how the last training ended (one of OUTCOMES), None before its end
        self.outcome: Optional[str] = None
        #: the checkpointer was closed with the training not at its end: why, told at exit unless a
        #: step (the next fit) or another end comes first
        self.closing: Optional[str] = None
        _ALL.add(self)

    def subscribe(self, listener: RunListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: RunListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    @property
    def listeners(self) -> List[RunListener]:
        with self._lock:
            return list(self._listeners)

    def _tell(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(self._ckpt(), *args)
            except Exception:  # noqa: BLE001 - a listener never breaks the training
                log.warning("keepalive: %s.%s failed; it is not called again", type(listener).__name__,
                            method, exc_info=True)
                self.unsubscribe(listener)

    def started(self, resumed_from: "Optional[CheckpointInfo]") -> None:
        self.running, self.outcome, self.closing = True, None, None
        self._tell("started", resumed_from)

    def stepped(self) -> None:
        if self.closing is not None:  # the next fit of the same training: the close was no end
            self.closing, self.running = None, True
        if self._listeners:  # the common case, no listener: one attribute read per batch
            self._tell("stepped")

    def saved(self, result: "WriteResult") -> None:
        self._tell("saved", result)

    def ended(self, outcome: str, reason: str = "") -> None:
        """The training ended (told once: a later end of the same training is not news)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r}: one of {OUTCOMES}")
        with self._lock:
            if self.outcome is not None:
                return
            if outcome == "closed" and self.closing is None:
                self.closing = reason  # told at exit, unless a next fit or another end comes first
                return
            self.outcome, self.running, self.closing = outcome, False, None
        self._tell("ended", outcome, reason)

    def tell_close(self) -> None:
        """At the process' exit: a close nothing followed is the training's end."""
        if self.closing is not None and self.outcome is None:
            self.ended("closed", self.closing)


_ALL: "weakref.WeakSet[RunEvents]" = weakref.WeakSet()
_HOOK_INSTALLED = False


def _tell_crash(exc: BaseException) -> None:
    outcome = "stopped" if isinstance(exc, KeyboardInterrupt) else "crashed"
    for events in list(_ALL):
        if events.running or events.closing is not None:  # an adapter may close before the error is seen
            events.ended(outcome, first_line(exc))


@atexit.register
def _tell_closes_at_exit() -> None:
    # registered before the core's own exit handler (this module is imported first), so it runs after
    # it: the checkpointers are closed by then
    for events in list(_ALL):
        events.tell_close()


def install_crash_hook() -> None:
    """Tell a script's uncaught exception to the running trainings as ``crashed`` (Ctrl-C as
    ``stopped``) before Python prints it; the previous ``sys.excepthook`` still runs. Installed
    once, by the first checkpointer."""
    global _HOOK_INSTALLED
    record_at_exit()  # and, under `keepalive run`, how the process ended (keepalive.endrecord)
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(kind: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            _tell_crash(exc)
        finally:
            previous(kind, exc, tb)

    sys.excepthook = hook


def tell_crash(exc: BaseException) -> None:
    """Tell ``exc`` (an error that ended a notebook cell's training) to the running trainings."""
    _tell_crash(exc)

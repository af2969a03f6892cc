"""Ctrl-C / "Interrupt kernel" and SIGTERM, deferred to the next point where the state can be saved.

While a training loop runs, :class:`DeferredSignals` replaces the SIGINT and SIGTERM handlers by one
that only notes the signal (and says so at once); the core saves at the next consistent boundary and
then re-raises it (:func:`raise_for`). A second signal acts at once. The handler queues into a deque
(an append is atomic): it may run between any two bytecodes of the training thread, even in the
middle of a state transition, which it must not race.

>>> import signal
>>> d = DeferredSignals(lambda: None)
>>> d.install(); signal.raise_signal(signal.SIGINT)   # noted, not raised
>>> d.take(), d.take()
(2, None)
>>> d.uninstall()
"""
from __future__ import annotations

import collections
import os
import signal
import threading
import weakref
from typing import Any, Callable, Deque, Dict, Optional

from . import report
from .boundary import signal_name
from .errors import EXIT_STOPPED

__all__ = ["DeferredSignals", "noted_signal", "raise_for", "signal_name"]

#: the handlers installed now (one per training loop running in this process)
_INSTALLED: "weakref.WeakSet[DeferredSignals]" = weakref.WeakSet()


def raise_for(signum: int) -> None:
    """Act on a signal as Python would have: ``KeyboardInterrupt`` for SIGINT, else exit with
    :data:`~keepalive.errors.EXIT_STOPPED` (128 + SIGTERM: "stopped, run me again to continue")."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(EXIT_STOPPED if signum == signal.SIGTERM else 128 + signum)


def noted_signal() -> Optional[int]:
    """A signal some installed :class:`DeferredSignals` noted and no boundary took yet (None: none).
    A wait that cannot end by itself while a peer is gone (the check-in of a save under a process
    group) asks this, so that torchrun's SIGTERM to the survivors of a failed rank ends it now."""
    for deferred in list(_INSTALLED):
        signum = deferred.peek()
        if signum is not None:
            return signum
    return None


class DeferredSignals:
    """SIGINT / SIGTERM noted while installed; ``pending()`` says whether one is noted elsewhere too
    (the core's state machine holds a signal it has taken), so a second one raises at once."""

    def __init__(self, noted_elsewhere: Callable[[], Optional[int]],
                 forget_elsewhere: Callable[[], None] = lambda: None,
                 announce: Callable[[], bool] = lambda: True, noted: Callable[[], None] = lambda: None):
        self._noted_elsewhere, self._forget_elsewhere = noted_elsewhere, forget_elsewhere
        #: told when a signal is noted (the core's pause guard looks at once)
        self._noted = noted
        #: whether "saving at the end of this step" may be said when a signal comes: not where the save
        #: needs other processes that may be gone (torchrun's agent stops the survivors of a failed
        #: rank with SIGTERM: no save follows); the saved line says it there
        self._announce = announce
        self._queue: Deque[int] = collections.deque()
        self._old: Dict[int, Any] = {}
        self._pid = os.getpid()

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._old:
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - not allowed here
                pass
        _INSTALLED.add(self)

    def uninstall(self) -> None:
        _INSTALLED.discard(self)
        for sig, handler in self._old.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
        self._old = {}

    def take(self) -> Optional[int]:
        """The oldest signal noted and not taken yet."""
        return self._queue.popleft() if self._queue else None

    def peek(self) -> Optional[int]:
        return self._queue[0] if self._queue else None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            # a forked DataLoader worker inherited this handler: behave as it would without us
            # (torch's worker loop ends quietly on KeyboardInterrupt), and print nothing
            raise_for(signum)
        if self._queue or self._noted_elsewhere() is not None:  # asked twice: the user insists
            self._queue.clear()
            self._forget_elsewhere()  # raising aborts what the training thread was doing, a transition too
            self.uninstall()
            raise_for(signum)
        self._queue.append(signum)
        self._noted()
        if not self._announce():
            return
        # shown even with quiet=True: the user pressed a key and must learn what happens now
        report.say(f"{signal_name(signum)} received; saving at the end of this step, or now if the loop "
                   "pauses between steps (send it again to stop at once)", stream="stderr")

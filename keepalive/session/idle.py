"""How long the notebook has been idle, and a warning before the platform's idle timeout ends it.

Notebook platforms (Colab, Kaggle) end a session that runs no cell for a while. :class:`IdleTracker`
hooks IPython's ``pre_run_cell`` / ``post_run_cell`` events (the magics register the process's
tracker, :func:`tracker`), trainers call :func:`note_activity` each step, and a watch thread warns the
user once per idle period when the timeout nears (:func:`keepalive.report.warn`, plus the
:data:`idle_warning_callbacks`, where the notebook panel subscribes).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .. import report
from ..units import format_duration
from .frontend import ipython_shell
from .platforms import SessionInfo, detect

__all__ = ["IdleTracker", "IdleCallback", "idle_warning_callbacks", "tracker", "note_activity",
           "idle_seconds", "track_ipython", "check_idle_warning"]

log = logging.getLogger("keepalive.session")

IdleCallback = Callable[[Dict[str, Any]], None]

#: Called (in the watching thread) with the warning event dict each time an idle warning fires;
#: the notebook widget subscribes here.
idle_warning_callbacks: List[IdleCallback] = []


class IdleTracker:
    """Idle time as a notebook platform sees it: no cell running since the last one ended.

    ``idle_seconds()`` is 0 while a cell runs (between ``pre_run_cell`` and ``post_run_cell``), and
    otherwise the time since the last cell ended or the last :meth:`note_activity` (a training step
    in a background thread counts as activity: keepalive cannot know whether the platform counts
    it). Before anything was recorded, and outside IPython, the process is taken to be running code:
    idle is 0 (a plain script is never idle while it runs; ``keepalive status`` in a subprocess
    therefore reports 0).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 callbacks: Optional[List[IdleCallback]] = None):
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._last_activity: Optional[float] = None
        self._shells: List[Any] = []
        self._warned_for: Optional[float] = None
        self.callbacks: List[IdleCallback] = idle_warning_callbacks if callbacks is None else callbacks
        self.warn_before: Optional[float] = None   # seconds of margin that trigger the warning
        self._watch: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- events
    def pre_run_cell(self, info: Any = None) -> None:
        with self._lock:
            self._running += 1
            self._last_activity = self._clock()

    def post_run_cell(self, result: Any = None) -> None:
        with self._lock:
            self._running = max(0, self._running - 1)
            self._last_activity = self._clock()

    def note_activity(self) -> None:
        """Something (a training step) is running now."""
        self._last_activity = self._clock()

    # -- state
    @property
    def busy(self) -> bool:
        return self._running > 0

    @property
    def registered(self) -> bool:
        return bool(self._shells)

    def idle_seconds(self, now: Optional[float] = None) -> float:
        if self._running > 0:
            return 0.0
        last = self._last_activity
        if last is None:
            return 0.0
        return max(0.0, (self._clock() if now is None else now) - last)

    # -- IPython
    def register(self, ipython: Any = None, watch: bool = True) -> "IdleTracker":
        """Hook ``pre_run_cell`` / ``post_run_cell`` of ``ipython`` (default: the running shell) and,
        with ``watch``, start the idle-warning thread when an idle timeout is known."""
        if ipython is None:
            ipython = ipython_shell()
            if ipython is None:
                raise RuntimeError("IdleTracker.register: no IPython shell is running")
        if any(s is ipython for s in self._shells):
            return self
        ipython.events.register("pre_run_cell", self.pre_run_cell)
        ipython.events.register("post_run_cell", self.post_run_cell)
        self._shells.append(ipython)
        self.note_activity()   # registering happens in a cell: that is activity
        if watch and detect().idle_timeout_seconds is not None:
            self.start_watch()
        return self

    def unregister(self, ipython: Any = None) -> None:
        shells = [s for s in self._shells if ipython is None or s is ipython]
        for shell in shells:
            for name, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
                try:
                    shell.events.unregister(name, fn)
                except ValueError:
                    pass
            self._shells = [s for s in self._shells if s is not shell]
        if not self._shells:
            self.stop_watch()

    # -- warning
    def warn_margin(self, timeout: float) -> float:
        """Idle margin (seconds left) under which the warning fires: ``warn_before`` when set, else
        5 min or a quarter of the timeout, whichever is smaller."""
        if self.warn_before is not None:
            return self.warn_before
        return min(300.0, 0.25 * timeout)

    def check_idle(self, now: Optional[float] = None, info: Optional[SessionInfo] = None
                   ) -> Optional[Dict[str, Any]]:
        """Warn the user (:func:`keepalive.report.warn`, then the callbacks) once per idle period
        when the idle timeout is near. Returns the event dict when it fired, else None."""
        info = info or detect()
        timeout = info.idle_timeout_seconds
        if timeout is None or self._running > 0 or self._last_activity is None:
            return None
        period = self._last_activity
        idle = self.idle_seconds(now)
        margin = timeout - idle
        if margin > self.warn_margin(timeout) or self._warned_for == period:
            return None
        self._warned_for = period
        message = (f"idle for {format_duration(idle)}: the {info.platform} idle timeout of "
                   f"{format_duration(timeout)} may end this session in about "
                   f"{format_duration(max(0.0, margin))} ({info.idle_source}). Run a cell or "
                   "interact with the notebook to keep it; committed checkpoints are safe.")
        event = {"idle_seconds": idle, "idle_timeout_seconds": timeout, "margin_seconds": margin,
                 "platform": info.platform, "message": message}
        report.warn(message)  # once per idle period: the check above, not a report key
        for cb in list(self.callbacks):
            try:
                cb(event)
            except Exception:  # noqa: BLE001 - a widget must never break the watcher (the user
                log.debug("idle warning callback %r failed", cb, exc_info=True)  # was warned above)
        return event

    def start_watch(self, interval: Optional[float] = None) -> None:
        """Check for the idle warning every ``interval`` seconds (default: a tenth of the warning
        margin, 1..30 s) in a daemon thread."""
        if self._watch is not None and self._watch.is_alive():
            return
        if interval is None:
            timeout = detect().idle_timeout_seconds or 300.0
            interval = min(30.0, max(1.0, self.warn_margin(timeout) / 10.0))
        self._stop.clear()
        wait = float(interval)

        def loop() -> None:
            while not self._stop.wait(wait):
                try:
                    self.check_idle()
                except Exception:  # noqa: BLE001
                    log.debug("idle check failed", exc_info=True)

        self._watch = threading.Thread(target=loop, name="keepalive-idle-watch", daemon=True)
        self._watch.start()

    def stop_watch(self) -> None:
        self._stop.set()
        thread, self._watch = self._watch, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


_TRACKER = IdleTracker()


def tracker() -> IdleTracker:
    """The process's idle tracker (the one the magics register and :func:`note_activity` feeds)."""
    return _TRACKER


def note_activity() -> None:
    """Mark "a cell / training step is running now" (trainers call this each step)."""
    _TRACKER.note_activity()


def idle_seconds() -> float:
    """Seconds the process's tracker has seen no cell and no training step (0 while one runs)."""
    return _TRACKER.idle_seconds()


def track_ipython(ipython: Any = None, watch: bool = True) -> IdleTracker:
    """Register the process's tracker with ``ipython`` (default: the running shell)."""
    return _TRACKER.register(ipython, watch=watch)


def check_idle_warning() -> Optional[Dict[str, Any]]:
    """Warn now if the process's tracker is near the idle timeout (see :meth:`IdleTracker.check_idle`)."""
    return _TRACKER.check_idle()

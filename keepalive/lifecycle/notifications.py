"""The run's events sent as notifications (``notify=`` / ``KEEPALIVE_NOTIFY``): what is told, and when.

A checkpointer with a notification URL gets a :class:`Notifications` listener on its events
(:mod:`keepalive.lifecycle.events`); messages leave through :class:`keepalive.notify.Notifier` (Apprise,
a background thread). Each message names the run (its name and folder or URL), where the training is
(epoch, step) and why:

* **started** / **resumed**: from which checkpoint, and how much work is redone (the steps the last
  session got to after that checkpoint, when its lease noted them).
* **stopped**: the session's deadline, a cloud's notice or a signal, and how to continue.
* **crashed**: the exception's one line and the newest checkpoint to resume from.
* **stalled**: no training step for a while although the process lives (a hung data loader, a
  collective waiting for a rank that is gone): told once per stall by a watchdog thread, after
  ``KEEPALIVE_NOTIFY_STALL`` (default max(10 min, 20 x the median step time)).
* **finished**: the final step, the time it took, the last logged metrics (``ckpt.last_metrics``).
* **closed**: the checkpointer was closed before the training's end (a loop left early).

Only the process that writes checkpoints (rank 0) notifies. The end of a training waits for its
message (bounded by :data:`keepalive.notify.SEND_TIMEOUT`; not when the notifier's last message failed,
a dead receiver): a script that ends or crashes right after would otherwise lose it.
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Optional, Sequence, Tuple, Union

from .. import distributed as _distributed
from .. import report, settings
from ..runs import position
from ..units import format_duration
from .events import RunListener

if TYPE_CHECKING:
    from ..notify import Notifier
    from ..store import CheckpointInfo, WriteResult

log = logging.getLogger("keepalive")

__all__ = ["Notifications", "StallWatch", "notify_events", "stall_limit"]

#: the shortest time without a step that counts as a stall by default, and how many median steps
STALL_FLOOR = 600.0
STALL_STEPS = 20

#: one notifier per set of URLs in a process (its thread, its "said once"), shared by its checkpointers
_SHARED: Dict[Tuple[str, ...], Optional["Notifier"]] = {}
_SHARED_LOCK = threading.Lock()


def notify_events(ckpt: Any) -> Optional["Notifications"]:
    """Subscribe notifications to ``ckpt``'s events when a URL is configured (``notify=``, else
    ``KEEPALIVE_NOTIFY``) and this process may write checkpoints; None otherwise. Never raises: a
    problem is said once and the training goes on without notifications."""
    if not _distributed.GROUP.is_main:
        return None  # rank 0 alone tells (it alone writes checkpoints)
    try:
        notifier = shared_notifier(ckpt.config.notify)
    except Exception as exc:  # noqa: BLE001 - notifications never stop a training
        report.warn(f"notifications are off: {type(exc).__name__}: {exc}", key="notify-failed")
        return None
    if notifier is None or not notifier.services:
        return None
    listener = Notifications(notifier)
    ckpt.events.subscribe(listener)
    return listener


def shared_notifier(urls: Union[str, Sequence[str], None]) -> Optional["Notifier"]:
    """The process's notifier for ``urls`` (default ``KEEPALIVE_NOTIFY``), made on first use."""
    from ..notify import notifier_from, split_urls

    if urls is None:
        configured = settings.get("KEEPALIVE_NOTIFY")
        urls = getattr(configured, "text", configured)
    key = tuple(split_urls(urls))
    if not key:
        return None
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = notifier_from(list(key))
        return _SHARED[key]


def stall_limit(median_step: Optional[float], configured: Optional[float]) -> float:
    """Seconds without a step told as a stall: ``configured`` when set (0: never), else
    max(:data:`STALL_FLOOR`, :data:`STALL_STEPS` x the median step time).

    >>> stall_limit(None, None), stall_limit(60.0, None), stall_limit(60.0, 5.0)
    (600.0, 1200.0, 5.0)
    """
    if configured is not None:
        return configured
    return max(STALL_FLOOR, STALL_STEPS * median_step) if median_step else STALL_FLOOR


class StallWatch:
    """A daemon thread that calls ``on_stall(idle_seconds, median_step)`` once when no
    :meth:`step` came for the stall limit (:func:`stall_limit`); a later step re-arms it."""

    def __init__(self, on_stall: Callable[[float, Optional[float]], None], configured: Optional[float] = None):
        self.on_stall = on_stall
        self.configured = configured
        self._lock = threading.Lock()
        self._steps: Deque[float] = deque(maxlen=64)  # the recent intervals between steps
        self.last_step = time.monotonic()
        self._told = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.configured == 0:
            return  # KEEPALIVE_NOTIFY_STALL=off
        with self._lock:
            self.last_step, self._told = time.monotonic(), False
            self._steps.clear()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="keepalive-stall",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread = None

    def step(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._steps.append(now - self.last_step)
            self.last_step, self._told = now, False

    def median_step(self) -> Optional[float]:
        with self._lock:
            steps = list(self._steps)
        return statistics.median(steps) if steps else None

    def _watch(self, stop: threading.Event) -> None:
        while True:
            median = self.median_step()
            limit = stall_limit(median, self.configured)
            if stop.wait(min(30.0, max(0.05, limit / 4))):
                return
            with self._lock:
                idle = time.monotonic() - self.last_step
                due = idle >= limit and not self._told
                self._told = self._told or due
            if due:
                try:
                    self.on_stall(idle, median)
                except Exception:  # noqa: BLE001 - the watchdog never dies of a message
                    log.warning("keepalive: the stall notification failed", exc_info=True)


class Notifications(RunListener):
    """The messages for one checkpointer's events (module docstring), sent through ``notifier``."""

    def __init__(self, notifier: "Notifier"):
        self.notifier = notifier
        self.writes = True  # this process writes checkpoints (asked when the training starts)
        self.newest: Optional["CheckpointInfo"] = None  # the newest committed checkpoint
        self.began = time.monotonic()
        self.ckpt: Any = None  # the checkpointer told of last (the watchdog's message names its run)
        self.stalls = StallWatch(self._stalled, settings.get("KEEPALIVE_NOTIFY_STALL"))

    # ------------------------------------------------------------------------------- events
    def started(self, ckpt: Any, resumed_from: "Optional[CheckpointInfo]") -> None:
        self.writes = bool(ckpt.path.writes)
        if not self.writes:
            return
        self.ckpt, self.newest, self.began = ckpt, resumed_from, time.monotonic()
        self.stalls.configured = settings.get("KEEPALIVE_NOTIFY_STALL")  # as the environment says now
        if resumed_from is None:
            self._send(ckpt, "started", f"a new run on {_host()}", "info")
        else:
            self._send(ckpt, f"resumed at step {_step(ckpt)}",
                       f"resumed from {resumed_from.name} ({_saved_ago(resumed_from)}) on {_host()}; "
                       f"{redone_words(ckpt, resumed_from)}", "info")
        self.stalls.start()

    def stepped(self, ckpt: Any) -> None:
        self.stalls.step()

    def saved(self, ckpt: Any, result: "WriteResult") -> None:
        self.newest = result.info

    def ended(self, ckpt: Any, outcome: str, reason: str) -> None:
        self.stalls.stop()
        if not self.writes:
            return
        words = ended_words(ckpt, outcome, reason, self.newest, time.monotonic() - self.began)
        if words is not None:
            self._send(ckpt, *words)
            if not self.notifier.failing:  # a dead receiver is not waited for
                self.notifier.flush()  # bounded: the process may end right after (a crash, a stop)

    def _stalled(self, idle: float, median: Optional[float]) -> None:
        ckpt = self.ckpt
        if ckpt is None:
            return
        typical = f"; a step takes {format_duration(median)} (median)" if median else ""
        self._send(ckpt, f"stalled: no step for {format_duration(idle)}",
                   f"no training step for {format_duration(idle)}{typical}, yet the process ({_host()}) "
                   "lives: a hung data loader, a collective waiting for a lost rank, stuck I/O? Nothing is "
                   "stopped; this is told once per stall", "failure")

    def _send(self, ckpt: Any, what: str, detail: str, kind: str) -> None:
        title = f"keepalive: run '{ckpt.store.run}' {what}"
        body = f"{ckpt.url}: {detail}. Now {position(ckpt.state.counters.as_dict(), ckpt.epoch_batches)}."
        self.notifier.send(title, body, kind)


# ------------------------------------------------------------------------------------- words
def ended_words(ckpt: Any, outcome: str, reason: str, newest: "Optional[CheckpointInfo]",
                seconds: float) -> Optional[Tuple[str, str, str]]:
    """``(what, detail, kind)`` of the message for a training's end (None: nothing to tell)."""
    step = _step(ckpt)
    resume = (f"run the same code again (in a notebook also %resume_training): it resumes from "
              f"{_checkpoint(newest)}")
    if outcome == "finished":
        metrics = metrics_words(getattr(ckpt, "last_metrics", None))
        done = "already complete: nothing was trained" if reason == "already complete" else (
            f"final step {step} after {format_duration(seconds)} of training in this session")
        return f"finished at step {step}", f"{done}{'; last metrics: ' + metrics if metrics else ''}", "success"
    if outcome == "stopped":
        return (f"stopped at step {step}: {_short(stop_cause(ckpt, reason))}",
                f"stopped ({reason or 'no reason given'}); to continue, {resume}", "warning")
    if outcome == "crashed":
        return (f"crashed at step {step}: {_short(reason)}",
                f"crashed: {reason}; the newest checkpoint is {_checkpoint(newest)}; fix the cause and "
                f"{resume}", "failure")
    return (f"ended at step {step} before its end",
            f"the checkpointer was closed before the training's end (a loop left early?); to continue, {resume}",
            "warning")


def stop_cause(ckpt: Any, reason: str) -> str:
    """What stopped the training, in a few words: the session's deadline, a cloud's notice, a signal."""
    notice = ckpt.stops.notice_in(reason) if reason else None
    if notice is not None:
        return f"a cloud's notice ({notice.detail})"
    if reason.startswith("deadline"):
        return "the session's deadline"
    if reason.startswith("KeyboardInterrupt"):
        return "Ctrl-C (KeyboardInterrupt)"
    if reason.startswith("SIG"):
        return f"a signal ({reason.split()[0].rstrip(':')})"
    return reason or "stopped"


def redone_words(ckpt: Any, info: "CheckpointInfo") -> str:
    """How much work a resume does again: the steps the last session made after ``info`` (its
    lease noted how far it got), when known."""
    step = info.step if info.step is not None else _step(ckpt)
    previous = getattr(ckpt, "last_writer_progress", None) or {}
    got = previous.get("step")
    if isinstance(got, int) and got > step:
        return f"the last session got to step {got} or further: {got - step} step(s) or more are redone"
    return f"work the last session did after step {step} (if any) is redone"


def metrics_words(metrics: Any, most: int = 8) -> str:
    """``loss=0.1234, acc=0.91`` from the last logged metrics (a mapping), or ``""``.

    >>> metrics_words({"loss": 0.123456, "acc": 0.9, "note": "x"})
    'loss=0.1235, acc=0.9, note=x'
    """
    if not isinstance(metrics, dict) or not metrics:
        return ""
    shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:most]]
    return ", ".join(shown) + (", ..." if len(metrics) > most else "")


def _step(ckpt: Any) -> int:
    return int(ckpt.state.counters.step)


def _checkpoint(info: "Optional[CheckpointInfo]") -> str:
    if info is None:
        return "the start (no checkpoint was saved)"
    return f"{info.name} (step {info.step})"


def _saved_ago(info: "CheckpointInfo") -> str:
    if not info.created:
        return f"step {info.step}"
    return f"step {info.step}, saved {format_duration(max(0.0, time.time() - info.created))} ago"


def _short(text: str, width: int = 90) -> str:
    first = (text or "").split(";")[0].strip()
    return first if len(first) <= width else first[:width - 3] + "..."


def _host() -> str:
    return f"{socket.gethostname()} (pid {os.getpid()})"

"""The run's heartbeat: this session's record in the run folder, kept by a listener on the run's events.

:class:`Heartbeat` listens to the checkpointer's events (:mod:`keepalive.lifecycle.events`) and keeps
the session's :class:`~keepalive.runlog.SessionRecord`: from which checkpoint it started, its counters
and recent throughput, its saves and their cost, the metrics the training logged, and at the end its
state and why. A :class:`~keepalive.runlog.RecordWriter` thread rewrites the record every
``KEEPALIVE_HEARTBEAT`` seconds (default 60), soon after each save, and once more at the end (the end
waits for that write at most :data:`END_WAIT` seconds). Nothing here runs on the training thread but
counting: a batch costs a clock read and, once a second, a sample of the step count.

Only the process that writes checkpoints (rank 0 under a process group) keeps a record. A process
killed outright (SIGKILL, a VM gone) leaves its record saying ``running`` with a heartbeat that grows
stale: readers call that run DIED (:func:`keepalive.runlog.run_state`).

:meth:`Heartbeat.log` takes logged metrics (``ckpt.log(loss=...)`` of the torch loop, what the other
adapters already see: Keras' epoch logs, the HF Trainer's ``log_history``, Lightning's logged metrics,
fastai's recorder): the newest go to ``ckpt.last_metrics``, each call to the record's ``metrics``.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Mapping, Optional, Tuple

from .. import session as _session
from .. import settings
from ..runlog import MAX_METRICS, RecordWriter, SessionRecord, new_session_id, process_identity
from .events import RunListener

if TYPE_CHECKING:
    from ..core import Checkpointer
    from ..store import CheckpointInfo, WriteResult

log = logging.getLogger("keepalive")

__all__ = ["Heartbeat", "END_WAIT", "numeric_metrics"]

#: the most seconds the end of a training waits for the last record to be written
END_WAIT = 5.0
#: the throughput is measured over the steps of the last this many seconds
WINDOW_S = 300.0


def numeric_metrics(values: Mapping[str, Any]) -> Dict[str, float]:
    """The entries of ``values`` that are finite numbers (a 0-d tensor, a NumPy scalar), as floats."""
    out: Dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, (str, bytes, bool)) or value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[str(name)] = number
    return out


class Throughput:
    """Training steps per second over the recent window: the step count sampled once a second (the
    window's start) and at the latest batch."""

    def __init__(self, window: float = WINDOW_S):
        self.window = window
        self.samples: Deque[Tuple[float, int]] = collections.deque()
        self.latest: Optional[Tuple[float, int]] = None

    def note(self, step: int, now: float) -> None:
        self.latest = (now, step)
        if self.samples and now - self.samples[-1][0] < 1.0:
            return
        self.samples.append((now, step))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window:
            self.samples.popleft()

    def rate(self) -> Optional[float]:
        if not self.samples or self.latest is None:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.latest
        return round((s1 - s0) / (t1 - t0), 4) if t1 > t0 and s1 >= s0 else None


class Heartbeat(RunListener):
    """The session record of one checkpointer's training (see the module docstring)."""

    def __init__(self, ckpt: "Checkpointer"):
        # weakly: the writer's thread must not keep a checkpointer nobody uses alive
        self._ckpt = weakref.ref(ckpt)
        self.record: Optional[SessionRecord] = None
        self.writer: Optional[RecordWriter] = None
        self.throughput = Throughput()
        self._lock = threading.Lock()
        self._metrics: List[Dict[str, Any]] = []

    @classmethod
    def subscribed(cls, ckpt: "Checkpointer") -> "Heartbeat":
        """A heartbeat listening to ``ckpt``'s events."""
        beat = cls(ckpt)
        ckpt.events.subscribe(beat)
        return beat

    # ------------------------------------------------------------------------------- events
    def started(self, ckpt: Any, resumed_from: "Optional[CheckpointInfo]") -> None:
        if not ckpt.path.writes:
            return  # under a process group rank 0 alone keeps the record
        if self.record is not None:  # a further fit of the same checkpointer: the session goes on
            self.record.state, self.record.reason = "running", ""
            self._start_writer()
            return
        now = time.time()
        info = _session.detect()
        c = ckpt.state.counters
        resumed = None if resumed_from is None else {
            "name": resumed_from.name, "step": resumed_from.step, "epoch": resumed_from.epoch}
        self.record = SessionRecord(
            session=new_session_id(now), **process_identity(), platform=info.platform,
            budget_s=info.budget_seconds, framework=ckpt.framework, started=now, updated=now,
            heartbeat_s=float(settings.get("KEEPALIVE_HEARTBEAT")), resumed_from=resumed,
            first_step=c.step, step=c.step, epoch=c.epoch, batch=c.batch,
            last_saved_step=None if resumed_from is None else resumed_from.step)
        self._start_writer()

    def stepped(self, ckpt: Any) -> None:
        record = self.record
        if record is not None:
            self.throughput.note(ckpt.state.counters.step, time.monotonic())
            if record.state == "closed":
                # the checkpointer was closed between two fits of one training (fastai's fine_tune
                # closes it after each fit) and trains on: the session is running again
                record.state, record.reason = "running", ""
                self._start_writer()

    def saved(self, ckpt: Any, result: "WriteResult") -> None:
        record = self.record
        if record is None:
            return
        with self._lock:
            record.saves += 1
            record.save_seconds = round(record.save_seconds + float(result.seconds or 0.0), 3)
            record.last_saved_step = result.info.step
        writer = self.writer
        if writer is None:
            return
        if ((result.info.manifest or {}).get("metadata") or {}).get("finished"):
            # the training's end is saved: its record says so even where no end is told after it
            # (a further fit of a closed checkpointer ends without one); the end's rewrite follows
            record.state, record.reason = "finished", record.reason or "end of training"
            self.writer = None
            writer.stop()
        else:
            writer.wake()

    def ended(self, ckpt: Any, outcome: str, reason: str) -> None:
        record = self.record
        if record is None:
            return
        record.state, record.reason = outcome, reason
        writer, self.writer = self.writer, None
        if writer is None:  # stopped at the final save: one more rewrite, with the end's words
            writer = RecordWriter(ckpt.store, record.session, self.snapshot, record.heartbeat_s)
            writer.start()
        if not writer.close(END_WAIT):
            log.info("keepalive: the session record of %s was not written at the end within %.0f s",
                     ckpt.url, END_WAIT)

    # ------------------------------------------------------------------------------ metrics
    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> Dict[str, float]:
        """Logged values: the numbers among them become ``ckpt.last_metrics`` (updated, not replaced)
        and one point of the record's ``metrics`` (at ``step``, default the optimizer steps made so
        far, those of the running batch included)."""
        values = numeric_metrics(metrics)
        ckpt = self._ckpt()
        if not values or ckpt is None:
            return values
        ckpt.last_metrics.update(values)
        c = ckpt.state.counters
        if step is None:  # a value logged inside a batch belongs to the step the batch just made
            step = c.step + max(ckpt.state.steps_seen, default=0)
        # a logged "epoch" (the HF Trainer's fraction) or "step" does not replace the point's own
        point: Dict[str, Any] = {**values, "step": int(step), "epoch": c.epoch, "time": round(time.time(), 3)}
        with self._lock:
            self._metrics.append(point)
            if len(self._metrics) > MAX_METRICS:  # thin the older half: the curve's shape stays
                half = len(self._metrics) // 2
                self._metrics[:half] = self._metrics[:half:2]
        return values

    # ------------------------------------------------------------------------------ writing
    def _start_writer(self) -> None:
        record = self.record
        if record is None or self.writer is not None:
            return
        ckpt = self._ckpt()
        if ckpt is None:
            return
        self.writer = RecordWriter(ckpt.store, record.session, self.snapshot, record.heartbeat_s)
        self.writer.wake()  # the session is seen at once, not a heartbeat later
        self.writer.start()

    def snapshot(self) -> Optional[Dict[str, Any]]:
        """The record as of now (called by the writer's thread); None once the checkpointer is gone."""
        record, ckpt = self.record, self._ckpt()
        if record is None or ckpt is None:
            return None
        c = ckpt.state.counters
        with self._lock:
            record.step, record.epoch, record.batch = c.step, c.epoch, c.batch
            record.total_epochs = ckpt.total_epochs
            record.total_steps = _planned_steps(ckpt, c.step, c.epoch, c.batch)
            record.steps_per_s = self.throughput.rate()
            record.updated = time.time()
            record.metrics = list(self._metrics)
            return record.to_json()


def _planned_steps(ckpt: Any, step: int, epoch: int, batch: int) -> Optional[int]:
    """The optimizer steps the whole training will have made, when the adapter knows its epochs and
    their length: the planned batches at the run's steps per batch so far."""
    total, per_epoch = ckpt.total_epochs, ckpt.epoch_batches
    if not total or not per_epoch:
        return None
    batches = epoch * per_epoch + batch
    ratio = step / batches if batches and step else 1.0
    return int(round(total * per_epoch * ratio))

"""A run across its sessions: where each one started and ended, what was redone, and when it ends.

The heartbeat writes one record per session into the run folder (:mod:`keepalive.runlog`); this
module reads them as plain mappings and answers what ``keepalive report`` shows:

* the run's state (RUNNING, STOPPED, DIED, FINISHED: :func:`keepalive.runlog.run_state`);
* the sessions as segments along the step axis, each with how it ended and the steps it had to do
  again (those between the previous session's last step and the checkpoint it resumed from);
* the ETA from the measured throughput, in steps, in time and in sessions of this platform's budget
  ("about 2 more Kaggle sessions"); the training's epoch bar uses the same estimate
  (:func:`estimate_eta`);
* :meth:`RunSummary.to_json` for machines, :meth:`RunSummary.lines` for a terminal; the picture is
  drawn by :mod:`keepalive.runchart` (matplotlib).

>>> records = [
...     {"session": "s1", "started": 0, "updated": 100, "state": "stopped", "reason": "deadline",
...      "first_step": 0, "step": 100, "last_saved_step": 100, "total_steps": 400, "steps_per_s": 1.0},
...     {"session": "s2", "started": 200, "updated": 290, "state": "crashed", "reason": "SIGKILL",
...      "first_step": 100, "step": 190, "last_saved_step": 180, "total_steps": 400, "steps_per_s": 1.0},
...     {"session": "s3", "started": 300, "updated": 330, "state": "running", "heartbeat_s": 60,
...      "first_step": 180, "step": 210, "total_steps": 400, "steps_per_s": 1.0}]
>>> s = summarize("runs/x", records, now=331)
>>> [(g.start_step, g.end_step, g.redone) for g in s.segments]
[(0, 100, 0), (100, 190, 0), (180, 210, 10)]
>>> s.state, s.redone_steps, s.eta.steps_left, round(s.eta.seconds)
('RUNNING', 10, 190, 190)
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .runlog import SessionRecord, run_state
from .units import format_duration

__all__ = ["Segment", "Eta", "RunSummary", "summarize", "estimate_eta", "record_dict"]

@dataclass
class Segment:
    """One session of the run along the step axis."""

    session: str
    start_step: int
    end_step: int
    started: float
    ended: float
    state: str          # the record's: running, stopped, finished, crashed, closed; died: killed outright
    reason: str
    redone: int         # steps done again: the previous session had gone past this one's checkpoint
    steps_per_s: Optional[float]
    saves: int = 0
    save_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return max(0.0, self.ended - self.started)


@dataclass
class Eta:
    """When the run ends at the measured throughput."""

    steps_left: int
    seconds: float
    steps_per_s: float
    #: sessions of the platform's budget still needed after this one (None: no budget known)
    sessions: Optional[int] = None
    platform: str = ""
    budget_s: Optional[float] = None

    def words(self) -> str:
        text = (f"{self.steps_left} steps left, about {format_duration(self.seconds)} at "
                f"{self.steps_per_s:.3g} steps/s")
        if self.sessions is not None:
            name = f"{self.platform.capitalize()} " if self.platform else ""
            text += ("; it ends in this session" if self.sessions == 0 else
                     f"; about {self.sessions} more {name}session{'s' if self.sessions != 1 else ''}")
        return text


@dataclass
class RunSummary:
    """What ``keepalive report`` shows of one run."""

    run: str
    state: str                       # RUNNING, STOPPED, DIED, FINISHED, NEW
    detail: str
    step: int
    total_steps: Optional[int]
    redone_steps: int
    segments: List[Segment] = field(default_factory=list)
    metrics: List[Dict[str, Any]] = field(default_factory=list)
    eta: Optional[Eta] = None

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["eta"] = None if self.eta is None else {**asdict(self.eta), "words": self.eta.words()}
        return data

    def lines(self) -> List[str]:
        """The summary for a terminal: the state, one line per session, the ETA."""
        of = f" of {self.total_steps}" if self.total_steps else ""
        out = [f"run {self.run}: {self.state} at step {self.step}{of}"
               + (f" ({self.detail})" if self.detail else "")]
        for i, seg in enumerate(self.segments, 1):
            redone = f", {seg.redone} steps redone" if seg.redone else ""
            why = f": {seg.reason}" if seg.reason else ""
            out.append(f"  session {i}: steps {seg.start_step}-{seg.end_step} in "
                       f"{format_duration(seg.seconds)}{redone}; {seg.state}{why}")
        if self.redone_steps:
            out.append(f"  {self.redone_steps} steps were done twice across {len(self.segments)} sessions")
        if self.eta is not None:
            out.append(f"  ETA: {self.eta.words()}")
        return out


def record_dict(record: Any) -> Dict[str, Any]:
    """A session record as the mapping this module reads (a :class:`keepalive.runlog.SessionRecord`
    or a mapping already)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return asdict(record)
    return dict(record)


def _num(record: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _segments(records: Sequence[Mapping[str, Any]], now: float) -> List[Segment]:
    segments: List[Segment] = []
    previous_end: Optional[int] = None
    for record in records:
        start = int(_num(record, "first_step"))
        end = max(start, int(_num(record, "step", start)))
        state = str(record.get("state") or "running")
        if state == "running" and run_state([SessionRecord.from_json(record)], now)[0] == "DIED":
            state = "died"  # killed outright: a stale heartbeat, or its process gone
        rate = record.get("steps_per_s")
        segments.append(Segment(
            session=str(record.get("session") or len(segments)), start_step=start, end_step=end,
            started=_num(record, "started"), ended=_num(record, "updated", _num(record, "started")),
            state=state, reason=str(record.get("reason") or ""),
            redone=max(0, previous_end - start) if previous_end is not None else 0,
            steps_per_s=float(rate) if isinstance(rate, (int, float)) and rate > 0 else None,
            saves=int(_num(record, "saves")), save_seconds=_num(record, "save_seconds")))
        previous_end = end
    return segments


def _throughput(segments: Sequence[Segment]) -> Optional[float]:
    """Steps per second: the newest session's measured rate, else its average, else the run's."""
    for seg in reversed(segments):
        if seg.steps_per_s:
            return seg.steps_per_s
        if seg.end_step > seg.start_step and seg.seconds > 0:
            return (seg.end_step - seg.start_step) / seg.seconds
    return None


def estimate_eta(steps_left: int, steps_per_s: Optional[float], *, budget_s: Optional[float] = None,
                 session_left_s: Optional[float] = None, platform: str = "") -> Optional[Eta]:
    """The time the steps left need at ``steps_per_s``, and the sessions of ``budget_s`` they take
    after the time this session has left (``session_left_s``; None: none, the run is not running).

    >>> estimate_eta(7200, 1.0, budget_s=3600, session_left_s=1800).words()
    '7200 steps left, about 2 h 00 min at 1 steps/s; about 2 more sessions'
    """
    if steps_per_s is None or steps_per_s <= 0 or steps_left < 0:
        return None
    seconds = steps_left / steps_per_s
    sessions = None
    if budget_s:
        after = seconds - max(0.0, session_left_s or 0.0)
        sessions = 0 if after <= 0 else int(math.ceil(after / budget_s - 1e-9))
    return Eta(steps_left=steps_left, seconds=seconds, steps_per_s=steps_per_s, sessions=sessions,
               platform=platform, budget_s=budget_s)


def _metrics(records: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    points: List[Dict[str, Any]] = []
    for i, record in enumerate(records):
        for point in record.get("metrics") or ():
            if isinstance(point, Mapping):
                points.append({**point, "session": i})
    return points


def summarize(run: str, records: Sequence[Mapping[str, Any]], now: Optional[float] = None) -> RunSummary:
    """The summary of a run from its session records (oldest first)."""
    now = time.time() if now is None else now
    records = sorted(records, key=lambda r: (_num(r, "started"), str(r.get("session") or "")))
    if not records:
        return RunSummary(run=run, state="NEW", detail="no session recorded", step=0, total_steps=None,
                          redone_steps=0)
    newest = records[-1]
    state, detail = run_state([SessionRecord.from_json(r) for r in records], now)
    segments = _segments(records, now)
    total = newest.get("total_steps")
    total_steps = int(total) if isinstance(total, (int, float)) and total > 0 else None
    step = segments[-1].end_step
    eta = None
    if total_steps is not None and state != "FINISHED":
        budget = newest.get("budget_s")
        budget_s = float(budget) if isinstance(budget, (int, float)) and budget > 0 else None
        left = (budget_s - (now - _num(newest, "started", now))) if budget_s and state == "RUNNING" else None
        eta = estimate_eta(max(0, total_steps - step), _throughput(segments), budget_s=budget_s,
                           session_left_s=left, platform=str(newest.get("platform") or ""))
    return RunSummary(run=run, state=state, detail=detail, step=step, total_steps=total_steps,
                      redone_steps=sum(seg.redone for seg in segments), segments=segments,
                      metrics=_metrics(records), eta=eta)

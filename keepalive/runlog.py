"""The run across sessions: one small record per session in the run folder, and the run's state.

Each process that trains a run (the one that writes its checkpoints) keeps a record of its session
in ``<run>/sessions/<session id>.json``: when it started and from which checkpoint, its counters and
throughput, its saves, what the training logged, and how it ended. The record is rewritten whole at
each heartbeat (:mod:`keepalive.lifecycle.heartbeat` decides when), so that any machine that can read
the run folder (a laptop looking at Drive or ``gs://``) sees whether the run is alive:

* ``RUNNING``: the newest session's record says ``running`` and its heartbeat is fresh;
* ``STOPPED``: it stopped cleanly (the session's deadline, a cloud's notice, a signal, the loop left):
  resumable;
* ``DIED``: it says ``running`` but its heartbeat is stale (older than ``3 * heartbeat_s + 30`` s),
  or its process is gone from this very machine, or it ended by an exception (``crashed``);
* ``FINISHED``: the training ran to its end.

>>> rec = SessionRecord(session="20261129T003000Z-1a2b3c4d", started=100.0, updated=160.0,
...                     heartbeat_s=60, state="running", step=40, host="elsewhere")
>>> run_state([rec], now=200.0)[0], run_state([rec], now=400.0)[0]
('RUNNING', 'DIED')

The folder ``sessions`` is no checkpoint folder (those are named ``ckpt-...``): listing, verifying,
retention and the cleanup of unfinished writes never see it. The format is the contract between
this writer and ``keepalive report``; a record never holds a secret.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from .backends import LocalBackend, maps_safely
from .store import SESSIONS, CheckpointStore
from .units import format_duration

log = logging.getLogger("keepalive")

__all__ = ["SESSIONS", "FORMAT", "STATES", "SessionRecord", "new_session_id", "read_sessions", "run_state",
           "run_summary", "RecordWriter", "process_identity", "MAX_METRICS"]

FORMAT = 1
#: what a record's ``state`` may say
STATES = ("running", "stopped", "finished", "crashed", "closed")
#: a reader's slack beyond the promised heartbeats (clocks of two machines differ, a store is slow)
STALE_SLACK_S = 30.0
#: logged points kept per session; older ones are thinned (every other one) beyond it
MAX_METRICS = 2000


@dataclass
class SessionRecord:
    """One session of a run, as its JSON file holds it (see the module docstring)."""

    session: str = ""
    format: int = FORMAT
    host: str = ""
    pid: int = 0
    #: the process's start (clock ticks since boot) and the machine's boot id: a reader on the same
    #: machine tells a dead process from a live one (a pid is reused) without waiting for staleness
    pid_start: Optional[int] = None
    boot_id: Optional[str] = None
    platform: str = ""
    budget_s: Optional[float] = None
    framework: str = ""
    started: float = 0.0
    updated: float = 0.0
    heartbeat_s: float = 60.0
    state: str = "running"
    reason: str = ""
    resumed_from: Optional[Dict[str, Any]] = None
    first_step: int = 0
    step: int = 0
    epoch: int = 0
    batch: int = 0
    last_saved_step: Optional[int] = None
    total_steps: Optional[int] = None
    total_epochs: Optional[int] = None
    steps_per_s: Optional[float] = None
    saves: int = 0
    save_seconds: float = 0.0
    metrics: List[Dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SessionRecord":
        """A record from its JSON (fields this version does not know are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def age(self, now: Optional[float] = None) -> float:
        """Seconds since the heartbeat (the record's last rewrite)."""
        return (time.time() if now is None else now) - float(self.updated or self.started)

    def stale(self, now: Optional[float] = None) -> bool:
        """Whether the heartbeat is older than the writer promised (three beats and a slack)."""
        return self.age(now) > 3 * float(self.heartbeat_s or 60.0) + STALE_SLACK_S


def new_session_id(now: Optional[float] = None) -> str:
    """``<UTC start yyyymmddTHHMMSSZ>-<8 hex>``: unique, and sorting by name sorts by start."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ this process
def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None
    where unreadable; raises FileNotFoundError when the process does not exist."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        fields = f.read().rsplit(")", 1)[-1].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie (killed, not reaped yet) runs no code
        raise FileNotFoundError(pid)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_identity() -> Dict[str, Any]:
    """This process as a record names it: host, pid, its start ticks and the machine's boot id."""
    pid = os.getpid()
    try:
        start = _start_ticks(pid)
    except OSError:
        start = None
    return {"host": socket.gethostname(), "pid": pid, "pid_start": start, "boot_id": _boot_id()}


def _process_gone(record: SessionRecord) -> bool:
    """Whether the record's process is known gone: only on the machine that ran it (same host name
    and boot id), where ``/proc`` can tell; elsewhere only staleness can."""
    if not record.pid or record.host != socket.gethostname() or not record.boot_id \
            or record.boot_id != _boot_id() or not os.path.isdir("/proc/self"):
        return False
    try:
        start = _start_ticks(int(record.pid))
    except OSError:
        return True
    return record.pid_start is not None and start is not None and start != record.pid_start


# ----------------------------------------------------------------------------------- reading
def _store(store_or_url: Union[CheckpointStore, str, "os.PathLike[str]"],
           storage_options: Optional[dict]) -> CheckpointStore:
    if isinstance(store_or_url, CheckpointStore):
        return store_or_url
    return CheckpointStore(os.fspath(store_or_url), keep=None, storage_options=storage_options)


def read_sessions(store_or_url: Union[CheckpointStore, str, "os.PathLike[str]"],
                  storage_options: Optional[dict] = None) -> List[SessionRecord]:
    """The run's session records, oldest start first. A record that cannot be parsed (torn by a
    crash where the store cannot replace a file atomically) is skipped; no folder: none."""
    store = _store(store_or_url, storage_options)
    folder = store.backend.join(store.path, SESSIONS)
    try:
        entries = store.backend.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    records = []
    for entry in entries:
        if entry.is_dir or entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        try:
            data = json.loads(store.backend.read_bytes(store.backend.join(folder, entry.name)))
            if isinstance(data, dict):
                records.append(SessionRecord.from_json(data))
        except (OSError, ValueError, TypeError) as exc:
            log.debug("session record %s unreadable: %s", entry.name, exc)
    records.sort(key=lambda r: (r.started, r.session))
    return records


def run_state(records: List[SessionRecord], now: Optional[float] = None) -> Tuple[str, str]:
    """The run's state from its records (the newest session's) and a line saying why:
    ``RUNNING`` / ``STOPPED`` / ``DIED`` / ``FINISHED``, or ``NEW`` when no session is recorded."""
    if not records:
        return "NEW", "no session recorded"
    rec = records[-1]
    now = time.time() if now is None else now
    beat = f"heartbeat {format_duration(max(0.0, rec.age(now)))} ago"
    if rec.state == "finished":
        return "FINISHED", f"step {rec.step}" + (f": {rec.reason}" if rec.reason else "")
    if rec.state in ("stopped", "closed"):
        return "STOPPED", f"step {rec.step}: {rec.reason or rec.state} (resumable)"
    if rec.state == "crashed":
        return "DIED", f"step {rec.step}: {rec.reason or 'an exception ended it'}"
    where = f"host {rec.host} pid {rec.pid}"
    if _process_gone(rec):
        return "DIED", f"step {rec.step}: its process ({where}) is gone without a clean stop; {beat}"
    if rec.stale(now):
        return "DIED", (f"step {rec.step}: no heartbeat for {format_duration(rec.age(now))} (promised every "
                        f"{format_duration(rec.heartbeat_s)}) and no clean stop ({where})")
    speed = f", {rec.steps_per_s:.3g} steps/s" if rec.steps_per_s else ""
    return "RUNNING", f"step {rec.step}, {beat}{speed} ({where})"


def run_summary(store_or_url: Union[CheckpointStore, str, "os.PathLike[str]"],
                storage_options: Optional[dict] = None, now: Optional[float] = None) -> Dict[str, Any]:
    """JSON-safe state of a run for ``keepalive status`` / ``ls`` and the widget: ``state``,
    ``state_detail``, ``sessions`` (how many), and of the newest session ``session``, ``step``,
    ``heartbeat_age_s``, ``steps_per_s``, ``reason``."""
    now = time.time() if now is None else now
    records = read_sessions(store_or_url, storage_options)
    state, detail = run_state(records, now)
    out: Dict[str, Any] = {"state": state, "state_detail": detail, "sessions": len(records)}
    if records:
        rec = records[-1]
        out.update(session=rec.session, step=rec.step, heartbeat_age_s=round(rec.age(now), 1),
                   steps_per_s=rec.steps_per_s, reason=rec.reason)
    return out


# ----------------------------------------------------------------------------------- writing
class RecordWriter:
    """Writes one session's record to the run folder from a thread of its own, never from the
    training's: every ``interval`` seconds, when woken (a save: at most every ``min_gap`` s), and a
    last time at :meth:`close`. ``snapshot()`` gives the record's JSON at the moment of writing (None:
    its session is gone, the thread ends).

    The record goes straight to the destination, not through the spool: it is small, and a stale
    copy on a dead VM's disk tells nobody anything. One attempt per beat, no retries: a failing
    destination is skipped silently (logged) and tried again at the next beat. Locally the file is
    replaced atomically (a temporary file renamed); on object stores a whole-object PUT is atomic;
    on Drive's FUSE mount, where rename is unsafe, the file is written in place (a reader skips a
    torn one).
    """

    def __init__(self, store: CheckpointStore, session: str, snapshot: Callable[[], Optional[Dict[str, Any]]],
                 interval: float, min_gap: float = 2.0):
        self.store = store
        self.session = session
        self.snapshot = snapshot
        self.interval = max(0.05, float(interval))
        self.min_gap = min(min_gap, self.interval)
        self.writes = 0
        self.failures = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._last = 0.0
        self._thread: Optional[threading.Thread] = None
        self._gone = False
        #: whether the file can be replaced atomically (a local disk), known at the first write
        self._replace: Optional[bool] = None

    @property
    def path(self) -> str:
        return self.store.backend.join(self.store.path, SESSIONS, f"{self.session}.json")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="keepalive-heartbeat", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Write soon (never blocks)."""
        self._wake.set()

    def stop(self) -> None:
        """Write the last record and stop, without waiting for it."""
        self._closing.set()
        self._wake.set()

    def close(self, timeout: float = 5.0) -> bool:
        """Write the last record and stop, waiting at most ``timeout`` seconds; whether it was written."""
        before = self.writes
        self._closing.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return False
        if thread is not threading.current_thread():
            thread.join(timeout)
        return self.writes > before

    def _beat(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            closing = self._closing.is_set()
            gap = self.min_gap - (time.monotonic() - self._last)
            if not closing and gap > 0:  # saves in quick succession: one record for them
                self._closing.wait(gap)
                closing = self._closing.is_set()
            self.write_now()
            if closing or self._gone:
                return

    def write_now(self) -> bool:
        """One attempt to write the record; False (logged, not raised) when the destination fails."""
        self._last = time.monotonic()
        try:
            body = self.snapshot()
            if body is None:
                self._gone = True
                return False
            self._put(json.dumps(body, default=_plain).encode())
        except Exception as exc:  # noqa: BLE001 - a heartbeat never breaks or slows a training
            self.failures += 1
            self._replace = None  # the folder may be gone (a run folder deleted, a remount): made again next time
            log.debug("session record not written to %s (tried again at the next beat): %s", self.path, exc)
            return False
        self.writes += 1
        return True

    def _put(self, data: bytes) -> None:
        backend = self.store.backend
        path = self.path
        if self._replace is None:
            backend.makedirs(backend.join(self.store.path, SESSIONS))
            self._replace = isinstance(backend, LocalBackend) and maps_safely(os.path.dirname(path))
        if self._replace:
            # a name of this thread's own: the last rewrites of a session may come from two threads
            tmp = os.path.join(os.path.dirname(path), f".{self.session}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            backend.write_bytes(path, data)


def _plain(value: Any) -> Any:
    """JSON for what ``json`` does not know (a NumPy scalar): its number, else its text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)

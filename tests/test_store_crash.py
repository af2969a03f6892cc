"""Crash safety: a writer process (tests/crash_writer.py) is SIGKILLed at random moments, many times,
many of them in the middle of writing a checkpoint. After every kill:

* every checkpoint the store calls valid verifies and loads, and its content checks out;
* the newest valid checkpoint is never older than the last one whose ``commit()`` had returned
  (as the child printed it before it died);
* the next writer process takes the run's lease (same host, dead pid) and continues from there.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from crash_writer import check_state
from keepalive.state import from_files
from keepalive.store import CheckpointStore

SCRIPT = os.path.join(os.path.dirname(__file__), "crash_writer.py")
TRIALS = 30
TIME_BUDGET = 50.0  # seconds: at least MIN_TRIALS run even if the machine is slow
MIN_TRIALS = 25


class Writer:
    """The child process, with its stdout lines collected by a thread as they come."""

    def __init__(self, run: str, seed: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, SCRIPT, run, str(seed)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.split())
            if line.startswith("READY"):
                self.ready.set()
        self.ready.set()  # EOF: the child died before it was ready

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)  # reap it
        self._reader.join(10)
        self.stderr = self.proc.stderr.read()
        self.proc.stderr.close()
        self.proc.stdout.close()

    def steps(self, tag: str):
        return [int(parts[1]) for parts in self.lines if parts and parts[0] == tag]


def check_run(run: str, last_committed: int) -> dict:
    store = CheckpointStore(run)
    counts = {"valid": 0, "unfinished": 0, "torn_manifest": 0}
    for info in store.list(include_uncommitted=True):
        if not info.committed:
            counts["unfinished"] += 1
            continue
        if info.error is not None:  # a manifest torn by the kill: not a checkpoint either
            counts["torn_manifest"] += 1
            continue
        # a manifest that parses means the write had finished: it must verify and load
        assert store.verify(info).valid, (info.name, info.error)
        check_state(from_files(store.read_files(info)), info.step)
        counts["valid"] += 1
    newest = store.newest_valid()
    if last_committed >= 0:
        assert newest is not None, "no valid checkpoint although a commit had returned"
        assert newest.step >= last_committed, (newest.step, last_committed)
        check_state(from_files(store.read_files(newest)), newest.step)
    return counts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_while_writing(tmp_path):
    run = str(tmp_path / "run")
    rnd = random.Random(20240611)
    last_committed = -1
    trials = mid_write = killed_before_first_commit = 0
    started = time.monotonic()
    stats = {"valid": 0, "unfinished": 0, "torn_manifest": 0}
    while trials < TRIALS and (trials < MIN_TRIALS or time.monotonic() - started < TIME_BUDGET):
        writer = Writer(run, seed=trials)
        try:
            assert writer.ready.wait(30), "writer never became ready"
            if not writer.steps("READY"):
                writer.kill()
                pytest.fail(f"writer {trials} could not take the run over:\n{writer.stderr}")
            resumed_at = writer.steps("READY")[0]
            assert resumed_at >= last_committed + 1 if last_committed >= 0 else resumed_at >= 0
            time.sleep(rnd.uniform(0.0, 0.6))
        finally:
            writer.kill()
        assert writer.proc.returncode == -signal.SIGKILL, (writer.proc.returncode, writer.stderr)
        assert "Traceback" not in writer.stderr, writer.stderr
        begun, committed = writer.steps("BEGIN"), writer.steps("COMMITTED")
        if committed:
            last_committed = max(last_committed, committed[-1])
        else:
            killed_before_first_commit += 1
        if begun and (not committed or begun[-1] > committed[-1]):
            mid_write += 1
        counts = check_run(run, last_committed)
        for k in stats:
            stats[k] += counts[k]
        trials += 1

    elapsed = time.monotonic() - started
    print(f"\n{trials} SIGKILL trials in {elapsed:.1f} s: {mid_write} killed inside commit(), "
          f"{killed_before_first_commit} before their first commit returned, "
          f"last committed step {last_committed}; unfinished folders seen {stats['unfinished']}, "
          f"torn manifests seen {stats['torn_manifest']}")
    assert trials >= MIN_TRIALS
    assert last_committed > 0
    assert mid_write >= 5, f"only {mid_write} kills landed mid-write"
    assert stats["unfinished"] >= 3, "too few kills left a half-written checkpoint folder behind"

    # a final writer cleans the leftovers and trims to `keep`
    store = CheckpointStore(run, keep=3)
    store.open_for_writing()
    assert all(c.committed for c in store.list(include_uncommitted=True))  # unfinished ones removed
    newest = store.newest_valid()
    store.commit(store.read_files(newest), step=newest.step + 1)
    assert len([c for c in store.list() if c.error is None]) == 3  # retention trimmed to keep
    store.close()

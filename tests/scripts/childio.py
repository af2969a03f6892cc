"""Output for the crash-test children: one whole line per write.

A training child prints ``STEP n`` from the main thread and ``COMMITTED n`` from the background
writer thread; ``print`` writes the text and the newline separately, so two threads can interleave
into ``52STEP``. One ``write`` of the whole line cannot be split that way.

Also what the distributed children share: waiting for a commit before a planned kill, and slowed
checkpoint writes (so random kills land inside saves).
"""
import os
import sys
import time

#: set by tests/crashkit.py for a child it plans to kill: the main thread stops at the first
#: ``STEP n`` with n >= this (after printing it), so the child can never run past the planned kill
#: to the end of the training however slow the parent is to read its output under load
HOLD_FROM = int(os.environ.get("CRASHKIT_HOLD_FROM", "0") or 0)


def hold_if_planned(line: str) -> None:
    """Block the calling (main) thread for good if ``line`` is a ``STEP n`` at or past the hold point."""
    if HOLD_FROM and line.startswith("STEP "):
        try:
            step = int(line.split()[1])
        except (IndexError, ValueError):
            return
        if step >= HOLD_FROM:
            while True:  # the parent's SIGKILL ends this
                time.sleep(3600)


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    hold_if_planned(line)


def wait_committed(run_dir: str, step: int, timeout: float = 120.0) -> None:
    """Until the checkpoint of ``step`` in ``run_dir`` is committed and valid (a planned kill after it)."""
    from keepalive.store import CheckpointStore

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        store = CheckpointStore(run_dir)
        if any(info.step == step and store.verify(info).valid for info in store.list()):
            return
        time.sleep(0.05)
    raise SystemExit(f"the checkpoint of step {step} was not committed in {timeout} s")


def slow_writes(seconds: float) -> None:
    """Every file of a checkpoint written ``seconds`` later: a random kill then often lands in a save."""
    from keepalive.store import CheckpointStore

    original = CheckpointStore._write_one

    def slow_write(self, path, chunks, hasher=None, progress=None):
        time.sleep(seconds)
        return original(self, path, chunks, hasher, progress)

    CheckpointStore._write_one = slow_write


def exit_after_group() -> None:
    """End a distributed rank whose group is destroyed and whose results are on disk and said, as a
    fork server's child leaves (tests/forkserver.py's ``leave_quickly``): what a program sees of the
    interpreter's exit (``atexit`` handlers, keepalive's among them, run; streams flushed), without its
    teardown. torch's gloo teardown at interpreter exit aborts a rank now and then ("terminate called
    without an active exception", SIGABRT), also in the runs without keepalive: torch's race, not what
    these tests check."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    from forkserver import leave_quickly

    leave_quickly(0)

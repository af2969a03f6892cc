"""Run a training subprocess, SIGKILL it at random moments, restart it until it finishes.

Shared by the crash tests of every adapter. The child prints `STEP n` after each optimizer step and
`COMMITTED n` after each checkpoint commit; the parent kills it after a randomly chosen step (plus a
random sub-step delay, so kills land inside steps and inside background writes too).
"""
from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

RESUME_RE = re.compile(r"resuming run .*?epoch (\d+)\b.*?, step (\d+)")
STEP_RE = re.compile(r"^STEP (\d+)\b")
COMMITTED_RE = re.compile(r"^COMMITTED (\d+)\s*$")


@dataclass
class Trial:
    killed_after_step: Optional[int]
    resumed_step: Optional[int]
    last_committed: Optional[int]
    torn_folders_after_kill: int = 0


@dataclass
class CrashReport:
    trials: List[Trial] = field(default_factory=list)
    final_output: str = ""

    @property
    def kills(self) -> int:
        return sum(1 for t in self.trials if t.killed_after_step is not None)


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def _held(kill_at: int, total_steps: int, kills_after: int) -> Tuple[int, str]:
    """A planned kill the child cannot outrun: the kill step leaves room for the kills still to come
    (each needs a step to run), and the child (tests/scripts/childio.py ``hold_if_planned``) stops
    its main thread at the step after it. Without that, under load the parent could read the
    ``STEP`` line late enough that the child had saved its last step and the run was finished,
    so later children had nothing left to kill. Returns the kill step and the child's hold point."""
    kill_at = max(1, min(kill_at, total_steps - 2 - kills_after))
    return kill_at, str(kill_at + 1)


def run_to_completion(cmd: List[str], *, total_steps: int, kills: int, rng: random.Random,
                      run_dir: Optional[str] = None, env: Optional[dict] = None,
                      max_substep_delay: float = 0.03, timeout: float = 120.0,
                      kill_after_commit: Optional[int] = None,
                      mid_epoch_of: Optional[int] = None) -> CrashReport:
    """``kill_after_commit``: the first kill also waits until that step's checkpoint is committed
    (writes are asynchronous: without it, how far back a kill sends the run depends on the load).
    ``mid_epoch_of``: the epoch's length in steps; the first kill also waits until the last commit
    printed is inside an epoch and is sent at once, so a test of a resume inside an epoch gets one
    whatever the load (a random kill after an epoch-end save resumes at the boundary)."""
    report = CrashReport()
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    resumed_prev: Optional[int] = None
    for attempt in range(kills + 1):
        kill_at = None
        child_env = dict(env)
        if attempt < kills:
            low = (resumed_prev or 0) + 1
            kill_at = rng.randint(min(low, total_steps), total_steps)
            if attempt == 0 and mid_epoch_of:  # an epoch with saves inside it must be left to run
                kill_at = min(kill_at, max(1, total_steps - mid_epoch_of))
            waits = (kill_after_commit if attempt == 0 else None) or (mid_epoch_of if attempt == 0 else None)
            if not waits:
                kill_at, child_env["CRASHKIT_HOLD_FROM"] = _held(kill_at, total_steps, kills - attempt - 1)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env)
        q: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        lines: List[str] = []
        last_step = resumed = committed = None
        deadline = time.monotonic() + timeout
        killed = False
        try:
            while True:
                try:
                    line = q.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"child timed out; output:\n{''.join(lines[-40:])}") from None
                if line is None:
                    break
                lines.append(line)
                m = RESUME_RE.search(line)
                if m:
                    resumed = int(m.group(2))
                # Lines from the writer thread and the main thread may interleave in a child that
                # prints without care: only whole, well-formed lines count.
                m = COMMITTED_RE.match(line)
                if m:
                    committed = int(m.group(1))
                m = STEP_RE.match(line)
                if m:
                    last_step = int(m.group(1))
                wait_for = kill_after_commit if attempt == 0 else None
                mid_epoch = mid_epoch_of if attempt == 0 else None
                if (kill_at is not None and last_step is not None and last_step >= kill_at
                        and (wait_for is None or (committed is not None and committed >= wait_for))
                        and (mid_epoch is None or (committed is not None and committed % mid_epoch
                                                   and COMMITTED_RE.match(line)))):
                    if mid_epoch is None:
                        time.sleep(rng.uniform(0, max_substep_delay))
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        torn = 0
        if killed and run_dir and os.path.isdir(run_dir):
            torn = sum(1 for d in os.listdir(run_dir) if d.startswith("ckpt-")
                       and not os.path.exists(os.path.join(run_dir, d, "MANIFEST.json")))
        report.trials.append(Trial(last_step if killed else None, resumed, committed, torn))
        if resumed is not None and report.trials[:-1]:
            prev = report.trials[-2]
            # The newest valid checkpoint is never older than the last commit that returned.
            if prev.last_committed is not None:
                assert resumed >= prev.last_committed, (resumed, prev)
        resumed_prev = resumed
        if not killed:
            report.final_output = "".join(lines)
            assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{''.join(lines[-60:])}"
            return report
    raise AssertionError("unreachable")


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bit-identical: tensors by torch.equal (dtype and shape too), everything else by ==."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs: max |diff| {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_differs(a: Any, b: Any) -> None:
    """The negative controls' check: the two states are not bit-identical."""
    try:
        assert_same(a, b)
    except AssertionError:
        return
    raise AssertionError("the two states are bit-identical: the control did not change the result")

"""Keras: a SIGTERM or the session's deadline that comes while ``fit`` validates is saved during the
validation (within 5 s), not at the epoch end; the resume runs that epoch's validation and its end
once and is bit-identical to a run never interrupted, without keepalive.

The child (tests/scripts/preempt_keras.py, TensorFlow backend as the other Keras crash tests) trains 3
epochs of ResumableData; epoch 1's validation lasts ~8 s (a callback after DriveCheckpoint sleeps in
the validation batch hook). Keras' optimizers are no torch optimizers: no step gate, so the guard thread
never saves here; keepalive's own validation hooks save from the training thread at the next batch.

Every scenario runs as a chain (interrupted run, then the same script to completion) in a thread of its
own, all at once (TensorFlow's start dominates; each child is single-threaded)."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

from forkserver import Forked, ForkServer

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "preempt_keras.py")
ENV = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
           KEEPALIVE_PROGRESS="0", PYTHONUNBUFFERED="1",
           PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.path.join(HERE, "scripts"),
                                       os.environ.get("PYTHONPATH", "")]))
TIMEOUT = 600.0  # per child: 7 TensorFlow children start at once, on a loaded machine too
EVAL_SECONDS = 8.0
#: the children's fork server while the module fixture runs: importing TensorFlow and Keras is most of a
#: child's CPU time (12 children per run). Only imported there: TensorFlow's runtime (its thread pools,
#: set to one thread by each child) starts in the child.
FORKS: List[ForkServer] = []
PRELOAD = ["numpy", "tensorflow", "keras"]
BOUND = 5.0  # saved and durable within this many seconds of the signal


@dataclass
class Child:
    """One run of the child: its lines with the (monotonic) time each was read, its exit code."""

    lines: List[Tuple[float, str]] = field(default_factory=list)
    rc: Optional[int] = None
    signal_at: Optional[float] = None

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, prefix: str, after: float = 0.0) -> Optional[float]:
        return next((t for t, line in self.lines if line.startswith(prefix) and t >= after), None)


def _run(run_dir: str, out: str, env: Dict[str, str], term: Optional[Tuple[str, float]] = None) -> Child:
    """Run the child to its exit; with ``term`` = (prefix, seconds), SIGTERM it that long after it
    prints a line that starts with prefix."""
    child = Child()
    proc: "subprocess.Popen[str] | Forked"
    if FORKS:  # the module fixture's: a fork of a process that has imported TensorFlow and Keras
        proc = FORKS[0].spawn([SCRIPT, run_dir, out], dict(ENV, **env))
    else:
        proc = subprocess.Popen([sys.executable, SCRIPT, run_dir, out], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(ENV, **env))
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                break
            child.lines.append((time.monotonic(), line))
            if term is not None and line.startswith(term[0]) and child.signal_at is None:
                time.sleep(term[1])  # the signal comes inside the slow part, as specified
                child.signal_at = time.monotonic()
                proc.send_signal(signal.SIGTERM)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        child.rc = proc.wait()
    return child


def _chain(tmp: str, name: str, env: Dict[str, str], term: Optional[Tuple[str, float]]) -> Tuple[Child, Child]:
    """The interrupted run and the resumed run to completion (the same command, the same folder)."""
    run_dir, out = os.path.join(tmp, name), os.path.join(tmp, f"{name}.npz")
    first = _run(run_dir, out, env, term=term)
    clean = {k: v for k, v in env.items() if k not in ("KE_DEADLINE", "KE_NO_PAUSE_SAVE")}
    second = _run(run_dir, out, clean) if first.rc in (0, 143) and "DONE" not in first.text else Child()
    return first, second


SCENARIOS = {
    # name: (environment, a SIGTERM that long after that line, or None; resumed?)
    "reference": ({"KE_PLAIN": "1", "KE_EVAL_SECONDS": "0"}, None, False),
    "reference_ema": ({"KE_PLAIN": "1", "KE_EVAL_SECONDS": "0", "KE_EMA_SWAP": "1"}, None, False),
    "sigterm": ({}, ("EVAL START", 1.0), True),
    "sigterm_last_batch": ({"KE_SLOW_LAST_BATCH": "4"}, ("LAST BATCH", 1.0), True),
    "deadline": ({"KE_DEADLINE": "5"}, None, True),
    "ema_swap": ({"KE_EMA_SWAP": "1"}, ("EVAL START", 1.0), True),
    "no_pause_save": ({"KE_NO_PAUSE_SAVE": "1"}, ("EVAL START", 1.0), False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("preempt_keras"))
    results: Dict[str, Tuple[Child, Child]] = {}

    def one(name: str) -> None:
        env, term, resumed = SCENARIOS[name]
        env = dict(env, KE_EVAL_SECONDS=env.get("KE_EVAL_SECONDS", str(EVAL_SECONDS)))
        if resumed:
            results[name] = _chain(tmp, name, env, term)
        else:
            results[name] = (_run(os.path.join(tmp, name), os.path.join(tmp, f"{name}.npz"), env, term), Child())

    threads = [threading.Thread(target=one, args=(name,)) for name in SCENARIOS]
    FORKS.append(ForkServer(PRELOAD, ENV, quick_exit=True))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        FORKS.pop().close()
    results["_dir"] = tmp  # type: ignore[assignment]
    return results


def _final(runs, name: str) -> Dict[str, np.ndarray]:
    with np.load(os.path.join(runs["_dir"], f"{name}.npz")) as f:
        return {k: f[k] for k in f.files}


def _trace(*children: Child) -> Dict[Tuple[str, ...], str]:
    """Per-batch losses and per-epoch (loss, val_loss, learning rate), later runs overwriting: what the
    training computed, batch by batch."""
    found: Dict[Tuple[str, ...], str] = {}
    for child in children:
        for _, line in child.lines:
            parts = line.split()
            if parts and parts[0] == "LOSS":
                found[("LOSS", parts[1], parts[2])] = parts[3]
            elif parts and parts[0] == "EPOCH":
                found[("EPOCH", parts[1])] = " ".join(parts[2:])
    return found


def _assert_exact(runs, name: str, reference: str) -> None:
    first, second = runs[name]
    assert second.rc == 0 and "DONE" in second.text, second.text[-3000:]
    ours, ref = _final(runs, name), _final(runs, reference)
    assert ours.keys() == ref.keys()
    differ = [k for k in ref if not np.array_equal(ours[k], ref[k])]
    assert not differ, f"{len(differ)} arrays differ from the run without keepalive (e.g. {differ[:3]})"
    assert _trace(first, second) == _trace(runs[reference][0])


def test_sigterm_during_validation_is_saved_then_and_resumes_exactly(runs):
    first, second = runs["sigterm"]
    assert first.rc == 143, first.text[-3000:]
    assert first.signal_at is not None
    committed = first.first("COMMITTED 16", after=first.signal_at)
    assert committed is not None and committed - first.signal_at < BOUND, first.text[-3000:]
    assert "during a pause of the training loop; exiting with code 143" in first.text
    assert first.first("EVAL END") is None  # exited inside the validation, before it would have ended
    assert first.first("EPOCH 1") is None
    # the resume: epoch 1 with no batch left (its validation and its end run once), then epoch 2
    assert "in epoch 1 after 8 batches" in second.text and "EVAL START 1" in second.text
    assert "LOSS 1 " not in second.text
    _assert_exact(runs, "sigterm", "reference")


def test_sigterm_during_an_epochs_last_batch_is_saved_there(runs):
    """The epoch's last batch, before its validation, is a position a resume can start from (an epoch
    with no batch left): a SIGTERM during it is saved at its end, not dropped for want of a position."""
    first, second = runs["sigterm_last_batch"]
    assert first.rc == 143, first.text[-3000:]
    assert first.signal_at is not None
    committed = first.first("COMMITTED 16", after=first.signal_at)
    assert committed is not None and committed - first.signal_at < BOUND, first.text[-3000:]
    assert "SIGTERM: saved in epoch 1 after 8 batches, step 16" in first.text
    assert "cannot be saved inside an epoch" not in first.text
    assert first.first("EVAL START 1") is None
    assert "in epoch 1 after 8 batches" in second.text and "LOSS 1 " not in second.text
    _assert_exact(runs, "sigterm_last_batch", "reference")


def test_deadline_during_validation_is_saved_then_and_stops(runs):
    first, _ = runs["deadline"]
    assert first.rc == 143, first.text[-3000:]  # stopped, not finished (EXIT_STOPPED)
    start, end = first.first("EVAL START 1"), first.first("EVAL END 1")
    assert start is not None and end is not None
    committed = first.first("COMMITTED 16", after=start)
    assert committed is not None and committed < end, first.text[-3000:]
    assert ("during a pause of the training loop; the training stops at its next step. Why: the session ends"
            in first.text), first.text[-3000:]
    assert "stopping before the session ends: saved" in first.text and "STOPPED" in first.text
    assert "LOSS 2 " not in first.text  # stopped cleanly at the epoch end: no batch of epoch 2
    _assert_exact(runs, "deadline", "reference")


def test_weights_swapped_for_validation_are_told_and_saved_at_epoch_end(runs):
    """Control: Keras' SwapEMAWeights puts the EMA weights into the model when the validation begins (on
    TensorFlow no version counter shows it; the weights' sums do): the state is no longer the last
    step's, so the save waits for the epoch end (said once), and the resume is still exact. Saved
    during the validation, the EMA weights would have been resumed as the training's weights."""
    first, _ = runs["ema_swap"]
    assert first.rc == 143, first.text[-3000:]
    assert ("SIGTERM received while the training loop paused between steps (an evaluation?), but its state "
            "is no longer that of its last step (the loop changed state beside the tensors since its last "
            "step (e.g. a scheduler stepped)): the save waits for the next step boundary" in first.text)
    assert first.text.count("the save waits for the next step boundary") == 1
    end = first.first("EVAL END 1")
    assert end is not None and first.first("COMMITTED 16", after=end) is not None
    assert "during a pause of the training loop" not in first.text
    _assert_exact(runs, "ema_swap", "reference_ema")


def test_without_saves_between_steps_the_bound_is_missed(runs):
    """Control: with saves between steps switched off, the SIGTERM is saved at the epoch end, after the
    validation: the 5 s bound the first test asserts fails."""
    first, _ = runs["no_pause_save"]
    assert first.rc == 143, first.text[-3000:]
    assert first.signal_at is not None
    committed = first.first("COMMITTED 16", after=first.signal_at)
    assert committed is not None and committed - first.signal_at > BOUND
    assert first.first("EVAL END 1") is not None

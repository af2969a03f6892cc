"""fastai: a SIGTERM or the session's deadline that comes during a long validation is saved then (the
state after the epoch's last training step), not after the validation (tests/scripts/preempt_fastai.py
sleeps after each validation batch of its first epoch, after keepalive's hooks). Each interrupted run
is resumed to its end and compared bit for bit with the same training without keepalive: weights,
optimizer state, every step's loss, the Recorder history and one draw of each global generator. Two
negative controls: a weight changed in place before the validation (the save is refused, said, and
made at the epoch end), and the saves between steps switched off (the save then lands after the
validation: more than 5 s after the signal); and, in this process, a learning rate set before the
validation (refused and said, saved at the epoch end).

The children's scenarios are independent and mostly sleep (slow validations): a module fixture runs them
side by side, each in a thread of its own that waits only for its own child's lines; each test reports
its scenario's outcome."""
import concurrent.futures
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
from safetensors.torch import load_file

from forkserver import Forked, ForkServer

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "preempt_fastai.py")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
    [os.path.join(HERE, "shims"), os.path.join(HERE, "scripts"), os.path.dirname(HERE)]))
#: the children's fork server while the module fixture runs: importing torch and fastai is most of a
#: child's CPU time
FORKS: List[ForkServer] = []
PRELOAD = ["torch", "torch._dynamo", "numpy", "safetensors.torch", "fastai_setup", "fastai.callback.core",
           "fastai.callback.schedule"]
N_ITER = 4  # training batches per epoch (64 samples, batch size 16); 8 validation batches
COMMON = ["--epochs", "2", "--n-train", "64", "--n-valid", "128"]
#: how long after the validation starts the signal is sent (inside the slow validation whatever the load)
SIGNAL_AFTER = 1.0
BOUND = 5.0  # saved and durable within this many seconds of the signal

# keepalive's progress bar shares stdout: a line may begin after the bar's carriage return
COMMITTED = re.compile(r"COMMITTED (\d+) ([\d.]+)\s*$")
LOSS = re.compile(r"LOSS (\d+) (\S+)\s*$")
EVAL = re.compile(r"(?:EVAL|PROLOGUE) (START|END) ([\d.]+)\s*$")  # the slow part: validation or prologue


@dataclass
class Outcome:
    rc: int
    lines: List[str]
    signal_at: Optional[float] = None
    exited_at: float = 0.0
    eval_start: Optional[float] = None
    eval_end: Optional[float] = None
    commits: List[Tuple[int, float]] = field(default_factory=list)
    losses: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _run(run, out, *extra: str, sigterm_in_eval: bool = False, timeout: float = 240.0) -> Outcome:
    """Run the child to its exit; with ``sigterm_in_eval`` send SIGTERM SIGNAL_AFTER seconds after it
    says its slow validation started."""
    argv = [SCRIPT, str(run), "--out", str(out), *COMMON, *extra]
    proc: "subprocess.Popen[str] | Forked"
    if FORKS:  # the module fixture's: a fork of a process that has imported torch and fastai
        proc = FORKS[0].spawn(argv, ENV)
    else:
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=ENV)
    q: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            q.put(line)
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    got = Outcome(rc=0, lines=[])
    deadline = time.monotonic() + timeout
    try:
        while True:
            wait = max(0.01, deadline - time.monotonic())
            if sigterm_in_eval and got.eval_start is not None and got.signal_at is None:
                wait = min(wait, max(0.0, got.eval_start + SIGNAL_AFTER - time.time()))
            try:
                line = q.get(timeout=wait)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise AssertionError("child timed out; output:\n" + "".join(got.lines[-40:])) from None
                got.signal_at = time.time()
                proc.send_signal(signal.SIGTERM)
                continue
            if line is None:
                break
            got.lines.append(line)
            m = EVAL.search(line)
            if m:
                setattr(got, "eval_start" if m.group(1) == "START" else "eval_end", float(m.group(2)))
            m = COMMITTED.search(line)
            if m:
                got.commits.append((int(m.group(1)), float(m.group(2))))
            m = LOSS.search(line)
            if m:
                got.losses[int(m.group(1))] = m.group(2)
        got.rc = proc.wait(timeout=60)
        got.exited_at = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return got


def _reference(d) -> Tuple[object, Dict[int, str]]:
    """The same training without keepalive (no slow validation: a sleep changes no number)."""
    got = _run(d / "run", d / "w.st", "--no-keepalive")
    assert got.rc == 0 and "DONE" in got.text, got.text[-3000:]
    assert sorted(got.losses) == list(range(1, 2 * N_ITER + 1))
    return d / "w.st", got.losses


Scenario = Callable[..., None]
SCENARIOS: Dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    """Registers ``fn(tmp_path, reference)`` (assertions inside) with the module fixture."""
    SCENARIOS[fn.__name__] = fn
    return fn


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Dict[str, "concurrent.futures.Future[None]"]:
    """Every child scenario run side by side; a test calls ``.result()`` of its own (its assertion error)."""
    FORKS.append(ForkServer(PRELOAD, ENV, quick_exit=True))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ref_pool, \
                concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
            # made once beside the scenarios: a scenario that compares with it waits for it
            reference = ref_pool.submit(_reference, tmp_path_factory.mktemp("ref"))
            found = {name: pool.submit(fn, tmp_path_factory.mktemp(name), reference)
                     for name, fn in SCENARIOS.items()}
            concurrent.futures.wait(list(found.values()))
    finally:
        FORKS.pop().close()
    return found


def _assert_same(reference: "concurrent.futures.Future[Tuple[object, Dict[int, str]]]", out, *runs: Outcome) -> None:
    ref, ref_losses = reference.result()
    wa, wb = load_file(str(ref)), load_file(str(out))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"
    ha, hb = (json.load(open(f"{p}.json")) for p in (ref, out))
    assert ha == hb, "Recorder history or the final random draws differ"
    seen = {}
    for r in runs:
        seen.update(r.losses)
    assert sorted(seen) == sorted(ref_losses)
    assert seen == ref_losses, "a step's loss differs"


def _resume(tmp_path, reference, first: Outcome, resumed_step: int) -> None:
    again = _run(tmp_path / "run", tmp_path / "w.st")
    assert again.rc == 0 and "DONE" in again.text, again.text[-3000:]
    assert re.search(rf"resuming run .*step {resumed_step}\b", again.text), again.text[-3000:]
    _assert_same(reference, tmp_path / "w.st", first, again)


@scenario
def sigterm_during_validation_saved_at_once(tmp_path, reference) -> None:
    """SIGTERM 1 s into a 9 s validation (8 batches of 1.1 s: the guard's thread saves, then the
    signal ends the process): committed within 5 s, exit 143 before the validation would have ended;
    the resume re-runs the validation and the epoch end once, and ends bit-identical."""
    got = _run(tmp_path / "run", tmp_path / "w.st", "--slow-epoch", "0", "--eval-seconds", "9",
               sigterm_in_eval=True)
    assert got.rc == 143, got.text[-3000:]
    assert got.signal_at is not None and got.eval_start is not None and got.eval_end is None
    assert re.search(r"SIGTERM: saved in epoch 0 after 4 batches, step 4 to .* during a pause of the "
                     r"training loop; exiting with code 143", got.text), got.text[-3000:]
    step, at = got.commits[-1]
    assert step == N_ITER
    latency = at - got.signal_at
    assert 0 < latency < BOUND, f"saved {latency:.2f} s after the signal"
    # the training call ended inside the validation (the child's own clock: the interpreter's exit after
    # it, not keepalive's work, takes what it takes on a loaded machine, and is not timed)
    ended = float(re.search(r"EXIT 143 ([\d.]+)", got.text).group(1))
    assert ended < got.eval_start + 9.0, "the training call ended only after the validation would have"
    assert ended - got.signal_at < BOUND
    print(f"\nSIGTERM during validation: committed {latency:.2f} s after the signal, the training call "
          f"ended {ended - got.signal_at:.2f} s after it, the process {got.exited_at - got.signal_at:.2f} s")
    _resume(tmp_path, reference, got, N_ITER)


@scenario
def sigterm_in_next_epoch_prologue(tmp_path, reference) -> None:
    """SIGTERM 1 s into a 6 s prologue of the second epoch (before its first batch), no checkpoint at
    the first epoch's end (every=1000 steps): the state of that epoch end is saved at once, with its
    position and loaders' random states; the resume ends bit-identical."""
    got = _run(tmp_path / "run", tmp_path / "w.st", "--slow-epoch", "1", "--eval-seconds", "0",
               "--slow-prologue", "6", "--every", "1000", sigterm_in_eval=True)
    assert got.rc == 143, got.text[-3000:]
    assert re.search(r"SIGTERM: saved at the end of epoch 0, step 4 to .* during a pause of the training loop",
                     got.text), got.text[-3000:]
    step, at = got.commits[-1]
    assert step == N_ITER and 0 < at - got.signal_at < BOUND
    assert got.eval_end is None, "exited only after the prologue"
    _resume(tmp_path, reference, got, N_ITER)


@scenario
def deadline_during_validation_saved_and_stopped(tmp_path, reference) -> None:
    """The session's deadline falls 4.5 s after a 4 s validation (8 batches of 0.5 s) starts: with its
    2 s margin it comes due during the validation, and keepalive's batch hook saves there, before the
    deadline minus the margin; the training stops at the epoch end (said), and the resume ends
    bit-identical."""
    got = _run(tmp_path / "run", tmp_path / "w.st", "--slow-epoch", "0", "--eval-seconds", "4",
               "--deadline-in", "4.5")
    assert got.rc == 143 and "STOPPED" in got.text, got.text[-3000:]  # stopped, not finished (EXIT_STOPPED)
    assert got.eval_start is not None and got.eval_end is not None
    during = [(s, t) for s, t in got.commits if got.eval_start < t < got.eval_end]
    assert during and during[0][0] == N_ITER, (got.commits, got.eval_start, got.eval_end)
    assert during[0][1] < got.eval_start + 4.5 - 2.0, "saved later than the deadline's margin"
    assert "during a pause of the training loop; the training stops at its next step" in got.text, got.text[-3000:]
    assert "stopping before the session ends" in got.text
    print(f"\ndeadline during validation: committed {during[0][1] - got.eval_start:.2f} s into it")
    _resume(tmp_path, reference, got, N_ITER)


@scenario
def control_state_changed_before_validation(tmp_path, reference) -> None:
    """Negative control: a callback changes a weight in place (x1.0: the same values) after the
    training batches, before the validation: the save between steps is refused with the warning, the
    SIGTERM is saved at the epoch end (after the validation), and the resume is still bit-identical."""
    got = _run(tmp_path / "run", tmp_path / "w.st", "--slow-epoch", "0", "--eval-seconds", "4", "--touch",
               sigterm_in_eval=True)
    assert got.rc == 143, got.text[-3000:]
    assert ("SIGTERM received while the training loop paused between steps (an evaluation?), but its state is "
            "no longer that of its last step (a tensor of the state was changed in place since the last step"
            in got.text), got.text[-3000:]
    assert "the save waits for the next step boundary. To have it saved at once during the validation, change " \
        "the state (a learning rate, a weight, an EMA, the freeze state) in a callback's after_epoch or " \
        "before_train, not in after_train or before_validate" in got.text, got.text[-3000:]
    assert got.eval_end is not None and got.commits and got.commits[-1][1] > got.eval_end
    assert re.search(r"SIGTERM: saved at the end of epoch 0, step 4 to \S+; exiting with code 143", got.text), \
        got.text[-3000:]
    _resume(tmp_path, reference, got, N_ITER)


@scenario
def control_without_saves_between_steps(tmp_path, reference) -> None:
    """Negative control: with the saves between steps switched off in the child, the SIGTERM is saved
    only at the epoch end, after the validation: the 5 s bound fails."""
    got = _run(tmp_path / "run", tmp_path / "w.st", "--slow-epoch", "0", "--eval-seconds", "9",
               "--no-pause-save", sigterm_in_eval=True)
    assert got.rc == 143, got.text[-3000:]
    assert got.eval_end is not None and got.signal_at is not None
    step, at = got.commits[-1]
    assert at - got.signal_at > BOUND, f"saved {at - got.signal_at:.2f} s after the signal"


def test_control_hyperparameter_changed_before_validation(tmp_path, capsys):
    """Negative control of the fingerprint's objects part, in this process: a callback sets another
    learning rate after the training batches (no tensor changes): a SIGTERM during the validation is
    refused with the warning that names it, and saved at the epoch end."""
    sys.path.insert(0, os.path.join(HERE, "scripts"))
    from fastai.callback.core import Callback
    from fastai_setup import make_learner

    from keepalive.callbacks.fastai import DriveCheckpoint

    class ChangeLrThenSignal(Callback):
        order = 200

        def after_train(self):
            self.learn.opt.set_hyper("lr", 1e-4)

        def before_validate(self):
            os.kill(os.getpid(), signal.SIGTERM)  # queued by keepalive's handler

    learn = make_learner(n_train=64, n_valid=32, path=str(tmp_path))
    if hasattr(learn, "progress"):
        learn.remove_cb(learn.progress)
    ckpt = DriveCheckpoint(str(tmp_path / "run"))
    with pytest.raises(SystemExit) as exited:
        learn.fit(2, 1e-3, cbs=[ckpt, ChangeLrThenSignal()])
    assert exited.value.code == 143
    err = capsys.readouterr()
    text = err.out + err.err
    assert ("SIGTERM received while the training loop paused between steps (an evaluation?), but its state is no "
            "longer that of its last step (the loop changed state beside the tensors since its last step (e.g. a "
            "scheduler stepped)): the save waits for the next step boundary") in text, text[-3000:]
    assert re.search(r"SIGTERM: saved at the end of epoch 0, step 4 to \S+; exiting with code 143", text), text[-3000:]


# ------------------------------------------------------------------------------------------ the tests
def test_sigterm_during_validation_saved_at_once(outcomes):
    outcomes["sigterm_during_validation_saved_at_once"].result()


def test_sigterm_in_next_epoch_prologue(outcomes):
    outcomes["sigterm_in_next_epoch_prologue"].result()


def test_deadline_during_validation_saved_and_stopped(outcomes):
    outcomes["deadline_during_validation_saved_and_stopped"].result()


def test_control_state_changed_before_validation(outcomes):
    outcomes["control_state_changed_before_validation"].result()


def test_control_without_saves_between_steps(outcomes):
    outcomes["control_without_saves_between_steps"].result()

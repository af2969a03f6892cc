"""Lightning: a SIGTERM or the session's deadline that comes during the fit's validation is saved then,
not at the next training step, and the run resumed from that save ends bit-identical to an
uninterrupted fit without keepalive (weights, AdamW state, every step's loss, a final RNG draw).

The child (tests/scripts/preempt_lightning.py) validates inside each epoch and at its end; in epoch 1
one validation sleeps 2.5 s per batch (4 batches: ~10 s). The SIGTERM comes ~1 s after it starts
(its epoch-end validation, after the epoch's last batch): committed within 5 s, exit 143 long before
the validation would have ended; the resume runs the validation again, then the epoch's end. The
deadline falls 5 s into the validation inside the epoch: saved during it, the fit stops cleanly.
Negative controls: (0) the save during the validation holds Lightning's live loop progress instead
of that of a validation to run again: the resume differs (the comparison sees a wrong resume);
(a) the module's ``on_validation_start`` changes a weight in place (the state is no longer the last
step's): the refusal is said, the save waits for the epoch's end (after the validation), the resume
is still exact; (b) saves between steps switched off: the commit comes only after the validation,
more than 5 s after the signal (so the 5 s assertion can fail).
The scenarios run side by side (independent children; every wait is for a printed line)."""
import concurrent.futures
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "shims")
SCRIPT = os.path.join(HERE, "scripts", "preempt_lightning.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIMS, os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           KEEPALIVE_PROGRESS="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
VAL_SECONDS = 4 * 2.5  # the slow validation: 4 batches of 2.5 s
BOUND = 5.0            # saved and durable within this many seconds of the signal
TIMEOUT = 300.0        # a child's whole run (a loaded machine)
#: the children's fork server while the module fixture runs: importing torch and Lightning is most of a
#: child's CPU time
FORKS: list = []
PRELOAD = ["torch", "torch._dynamo", "safetensors.torch", "lightning.pytorch"]

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
if importlib.util.find_spec("lightning") is None:  # the children import it (not this process)
    pytest.skip("lightning is not installed", allow_module_level=True)
from safetensors.torch import load_file  # noqa: E402

from forkserver import ForkServer  # noqa: E402

REFUSAL = ("keepalive: warning: SIGTERM received while the training loop paused between steps (an evaluation?), "
           "but its state is no longer that of its last step (a tensor of the state was changed in place since the "
           "last step (a forward pass in training mode, an EMA update)): the save waits for the next step boundary")


class Child:
    """A child run whose lines are read as they come, with the time each arrived."""

    def __init__(self, run, out, *extra, term_after_val_start=None):
        self.lines = []  # (time.time(), line)
        self.term_sent = None
        argv = [SCRIPT, str(run), "--out", str(out), *extra]
        if FORKS:  # the module fixture's: a fork of a process that has imported torch and Lightning
            self.proc = FORKS[0].spawn(argv, ENV)
        else:
            self.proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=ENV)
        q = queue.Queue()
        threading.Thread(target=self._read, args=(q,), daemon=True).start()
        deadline = time.monotonic() + TIMEOUT
        try:
            while True:
                line = q.get(timeout=max(0.01, deadline - time.monotonic()))
                if line is None:
                    break
                if line.startswith("VAL_START") and term_after_val_start is not None and self.term_sent is None:
                    time.sleep(term_after_val_start)  # inside the 10 s validation: no race with its end
                    self.term_sent = time.time()
                    self.proc.send_signal(signal.SIGTERM)
            self.rc = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def _read(self, q):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            q.put(line)
        q.put(None)

    @property
    def text(self):
        return "\n".join(line for _, line in self.lines)

    def at(self, prefix):
        """When the first line starting with ``prefix`` came (None: never)."""
        return next((t for t, line in self.lines if line.startswith(prefix)), None)

    def commits_after(self, t0, newer_than=8):
        """(child's commit time, step) of each commit printed after ``t0`` of a step after
        ``newer_than``: the background write of epoch 0's save (step 8) may commit seconds later on a
        loaded machine, and it is not the save a test times."""
        out = []
        for _, line in self.lines:
            if line.startswith("COMMITTED "):
                _, step, when = line.split()
                if float(when) >= t0 and int(step) > newer_than:
                    out.append((float(when), int(step)))
        return out


def _result(out):
    tensors = load_file(os.path.join(str(out), "final.safetensors"))
    with open(os.path.join(str(out), "losses.json")) as f:
        return tensors, json.load(f)


def differences(a, b):
    (ta, la), (tb, lb) = _result(a), _result(b)
    diff = [k for k in ta if k not in tb or not torch.equal(ta[k], tb[k])]
    if la != lb:
        diff.append("losses")
    return diff


def _finish(run, out, *extra):
    child = Child(run, out, "--keepalive", *extra)
    assert child.rc == 0 and "DONE" in child.text, child.text[-3000:]
    return child


def _sigterm(tmp, name, *extra, resume=True):
    run, out = tmp / name, tmp / f"{name}_out"
    killed = Child(run, out, "--keepalive", "--val-sleep", "2.5", *extra, term_after_val_start=1.0)
    resumed = _finish(run, out, *extra) if resume else None
    return killed, resumed, out


def _deadline(tmp):
    run, out = tmp / "deadline", tmp / "deadline_out"
    stopped = Child(run, out, "--keepalive", "--val-sleep", "2.5", "--slow-batch", "4", "--sleep-in", "step",
                    "--deadline-in-val", "5")
    resumed = _finish(run, out)
    return stopped, resumed, out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt_lightning")
    FORKS.append(ForkServer(PRELOAD, ENV, quick_exit=True))
    try:
        found = _all_scenarios(tmp)
    finally:
        FORKS.pop().close()
    ref_child, _ = found["reference"]
    assert ref_child.rc == 0 and "DONE" in ref_child.text, ref_child.text[-3000:]
    return found


def _all_scenarios(tmp):
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        jobs = {
            "reference": pool.submit(lambda: (Child(tmp / "ref", tmp / "ref_out"), tmp / "ref_out")),
            "sigterm": pool.submit(_sigterm, tmp, "sigterm"),
            "deadline": pool.submit(_deadline, tmp),
            "touched": pool.submit(_sigterm, tmp, "touched", "--touch-before-val"),
            "no_pause": pool.submit(_sigterm, tmp, "no_pause", "--no-pause-save", resume=False),
            "live_progress": pool.submit(_sigterm, tmp, "live_progress", "--control-live-progress"),
        }
        return {name: job.result() for name, job in jobs.items()}


def test_sigterm_during_validation_saved_at_once_and_resumed_exactly(scenarios):
    killed, resumed, out = scenarios["sigterm"]
    _, ref_out = scenarios["reference"]
    assert killed.term_sent is not None, killed.text[-3000:]
    assert killed.rc == 143, killed.text[-3000:]
    commits = killed.commits_after(killed.term_sent)
    assert commits, killed.text[-3000:]
    latency = commits[0][0] - killed.term_sent
    assert latency < BOUND, f"saved {latency:.1f} s after the SIGTERM"
    assert commits[0][1] == 16  # epoch 1's last step: its epoch-end validation was running
    assert "during a pause of the training loop; exiting with code 143" in killed.text
    # it stopped long before the validation would have ended (the interpreter's exit after that line
    # is not timed: on a loaded machine it takes what it takes)
    assert killed.at("keepalive: SIGTERM: saved") < killed.at("VAL_START") + VAL_SECONDS - 1.0, killed.text[-3000:]
    assert "VAL_END" not in killed.text
    # the resume runs the interrupted validation again, then the epoch's end and the last epoch
    assert "in epoch 1 after 8 batches" in resumed.text, re.findall(r"resuming run.*", resumed.text)
    assert differences(ref_out, out) == []


def test_deadline_during_validation_saved_then_and_stopped(scenarios):
    stopped, resumed, out = scenarios["deadline"]
    _, ref_out = scenarios["reference"]
    assert stopped.rc == 143 and "STOPPED" in stopped.text, stopped.text[-3000:]  # EXIT_STOPPED
    val_start, val_end = stopped.at("VAL_START"), stopped.at("VAL_END")
    assert val_start is not None and val_end is not None, stopped.text[-3000:]
    during = [c for c in stopped.commits_after(val_start) if c[0] < val_end]
    assert during and during[0][1] == 12, stopped.text[-3000:]  # after batch 4 of epoch 1, in its validation
    assert "during a pause of the training loop; the training stops at its next step" in stopped.text
    assert differences(ref_out, out) == []


def test_control_state_changed_before_validation_is_said_and_saved_at_the_next_boundary(scenarios):
    killed, resumed, out = scenarios["touched"]
    _, ref_out = scenarios["reference"]
    assert killed.rc == 143, killed.text[-3000:]
    assert REFUSAL in killed.text, killed.text[-3000:]
    assert killed.text.count("while the training loop paused between steps") == 1
    commits = killed.commits_after(killed.term_sent)
    assert commits and commits[0][0] > killed.at("VAL_END"), killed.text[-3000:]  # at the epoch's end
    assert "during a pause" not in killed.text.split(REFUSAL)[1]
    assert differences(ref_out, out) == []


def test_control_without_saves_between_steps_the_bound_fails(scenarios):
    killed, _, _ = scenarios["no_pause"]
    assert killed.rc == 143, killed.text[-3000:]
    commits = killed.commits_after(killed.term_sent)
    assert commits, killed.text[-3000:]
    latency = commits[0][0] - killed.term_sent
    assert latency > BOUND, f"saved {latency:.1f} s after the SIGTERM even without saves between steps"
    assert "during a pause" not in killed.text


def test_control_live_loop_progress_resumes_wrong(scenarios):
    killed, resumed, out = scenarios["live_progress"]
    _, ref_out = scenarios["reference"]
    assert killed.rc == 143 and "during a pause of the training loop" in killed.text, killed.text[-3000:]
    assert differences(ref_out, out) != []

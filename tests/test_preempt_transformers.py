"""Hugging Face ``Trainer``: a SIGTERM or the session's deadline that comes during the evaluation at an epoch's
end is saved then (durable within 5 s), not after the evaluation, and the resume is bit-identical to a run
without keepalive.

The child (``scripts/preempt_transformers.py``) trains a tiny GPT-2 for 2 epochs of 4 optimizer steps with
``eval_strategy="epoch"``; in the first run each of the 8 evaluation batches takes 1 s more, so an evaluation
lasts at least 8 s. The test acts 1 s after the child prints ``EVAL START`` (the first evaluation, after step
4). Compared with the uninterrupted run without keepalive: every weight, the optimizer state, the log history
(losses, grad norms, learning rates, evaluation losses), a final draw of python's, numpy's and torch's
generators. Controls: a stateful callback that changes its state at the epoch end, after keepalive's last
boundary and before the evaluation (keepalive must refuse the save during the evaluation, say so, and save at
the next boundary); the same with keepalive's fingerprint blind to the objects' state (saved during the
evaluation, and the resume differs: the epoch-end work runs twice); the saves between steps switched off
(saved only after the evaluation: the 5 s bound fails).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from forkserver import Forked, ForkServer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "preempt_transformers.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
#: the children's fork server while the module fixture runs: importing torch and transformers is most of
#: a child's CPU time (about 15 children per run on a 2-core machine)
FORKS: List[ForkServer] = []
PRELOAD = ["torch", "torch._dynamo", "numpy", "safetensors.torch", "transformers", "transformers.trainer",
           "transformers.trainer_callback", "transformers.models.gpt2.modeling_gpt2"]
# what the child script does before it imports transformers (the CUDA torchvision next to this CPU torch)
SETUP = """
import torch
for name in ("torchvision::nms", "torchvision::qnms"):
    torch.library.define(name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""
SLOW_BATCH = 1.0   # seconds added to each evaluation batch in the interrupted run
EVAL_BATCHES = 8   # the evaluation lasts at least EVAL_BATCHES * SLOW_BATCH
BOUND = 5.0        # saved and durable within this many seconds of the signal
REFUSED = ("keepalive: warning: SIGTERM received while the training loop paused between steps (an evaluation?), "
           "but its state is no longer that of its last step (the loop changed state beside the tensors since "
           "its last step (e.g. a scheduler stepped)): the save waits for the next step boundary.")
EVAL_STEPS = ("keepalive: warning: SIGTERM came during the evaluation the Trainer runs for step 3 "
              "(eval_strategy=\"steps\"), before keepalive's boundary of that step: the save waits for the "
              "evaluation's end. During an evaluation at an epoch's end (eval_strategy=\"epoch\") keepalive saves "
              "at once")


class Child:
    """A child run: its lines (with the parent's time of reading each), its exit code."""

    def __init__(self, run: str, out: str, *extra: str):
        self.proc: "subprocess.Popen[str] | Forked"
        if FORKS:  # the module fixture's: a fork of a process that has imported torch and transformers
            self.proc = FORKS[0].spawn([SCRIPT, run, "--out", out, *extra], ENV)
        else:
            self.proc = subprocess.Popen([sys.executable, SCRIPT, run, "--out", out, *extra], env=ENV, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: List[str] = []
        self._q: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, prefix: str, timeout: float = 300.0) -> str:
        end = time.monotonic() + timeout
        while True:
            line = self._q.get(timeout=max(0.01, end - time.monotonic()))
            if line is None:
                raise AssertionError(f"the child ended before '{prefix}':\n" + "\n".join(self.lines))
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = 300.0) -> int:
        end = time.monotonic() + timeout
        while True:
            line = self._q.get(timeout=max(0.01, end - time.monotonic()))
            if line is None:
                return self.proc.wait(timeout=max(1.0, end - time.monotonic()))
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def times(self, prefix: str) -> List[float]:
        """The child's wall-clock times printed on its lines that start with ``prefix``."""
        return [float(line.split()[-1]) for line in self.lines if line.startswith(prefix)]


def _result(out: str) -> Tuple[Dict[str, torch.Tensor], dict]:
    with open(out + ".json") as f:
        return load_file(out), json.load(f)


def _differences(ref, got) -> List[str]:
    (rw, rj), (gw, gj) = ref, got
    found = [k for k in rw if k not in gw or not torch.equal(rw[k], gw[k])]
    found += [k for k in ("log_history", "global_step", "draw") if rj[k] != gj[k]]
    return found


class Scenario:
    """One interrupted run (slow evaluation batches; a SIGTERM 1 s after the first evaluation starts, or
    the deadline inside it) and, unless ``resume=False``, the same script run again to its end."""

    def __init__(self, folder: str, *extra: str, sigterm: bool = True, resume: bool = True):
        self.run, self.out = os.path.join(folder, "run"), os.path.join(folder, "w.st")
        self.extra, self.sigterm, self.resume = extra, sigterm, resume
        self.sent = 0.0        # when the SIGTERM was sent (time.time())
        self.code: Optional[int] = None
        self.child: Optional[Child] = None
        self.resumed: Optional[Child] = None
        self.resumed_code: Optional[int] = None
        self.error: Optional[BaseException] = None

    def interrupt(self) -> None:
        """The interrupted run, then (unless ``resume=False``) the resume to the end, one after the other."""
        try:
            self.child = Child(self.run, self.out, "--slow-eval", str(SLOW_BATCH), *self.extra)
            if self.sigterm:
                self.child.wait_for("EVAL START")
                time.sleep(1.0)  # inside the evaluation: its batches take EVAL_BATCHES * SLOW_BATCH s at least
                self.sent = time.time()
                self.child.proc.send_signal(signal.SIGTERM)
            self.code = self.child.finish()
            if self.resume:
                counter = ("--counter",) if "--counter" in self.extra else ()
                self.resumed = Child(self.run, self.out, *counter)
                self.resumed_code = self.resumed.finish()
        except BaseException as exc:  # noqa: BLE001 - reported by the test that reads this scenario
            self.error = exc

    @property
    def text(self) -> str:
        assert self.child is not None
        return self.child.text

    def times(self, prefix: str) -> List[float]:
        assert self.child is not None
        return self.child.times(prefix)

    def result(self) -> Tuple[Dict[str, torch.Tensor], dict]:
        assert self.resumed is not None and self.resumed_code == 0, self.resumed and self.resumed.text
        return _result(self.out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Scenario]:
    """Every scenario at once, each in a thread of its own: its interrupted run (waiting on its own child's
    lines: no timing between them), then its resume, which overlaps the others' slow evaluations; the
    reference without keepalive beside them."""
    def folder(name: str) -> str:
        return str(tmp_path_factory.mktemp(name))

    scenarios = {
        "sigterm": Scenario(folder("sigterm")),
        # the deadline: 5 s after the evaluation starts (none before); margin 2 s: due about 1.75 s in
        "deadline": Scenario(folder("deadline"), "--deadline-in-eval", "5", sigterm=False),
        # one evaluation batch of 8 s: no hook is called while it runs, the core's guard thread saves
        "guard": Scenario(folder("guard"), "--slow-eval", str(EVAL_BATCHES * SLOW_BATCH), "--eval-samples", "1"),
        "guard-ungated": Scenario(folder("ungated"), "--slow-eval", str(EVAL_BATCHES * SLOW_BATCH), "--eval-samples",
                                  "1", "--no-gate", resume=False),
        "refused": Scenario(folder("refused"), "--counter"),
        "blind": Scenario(folder("blind"), "--counter", "--broken-fingerprint"),
        "no-pause-save": Scenario(folder("nopause"), "--no-pause-save", resume=False),
        "eval-steps": Scenario(folder("evalsteps"), "--eval-steps", "3", resume=False),
    }
    threads = [threading.Thread(target=s.interrupt) for s in scenarios.values()]
    ref_dir = folder("reference")
    FORKS.append(ForkServer(PRELOAD, ENV, setup=SETUP, quick_exit=True))
    try:
        reference = Child(os.path.join(ref_dir, "run"), os.path.join(ref_dir, "w.st"), "--mode", "plain")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert reference.finish() == 0, reference.text
    finally:
        FORKS.pop().close()
    scenarios["reference"] = Scenario(ref_dir)
    scenarios["reference"].child = reference
    return scenarios


def _interrupted(runs: Dict[str, Scenario], name: str, code: int = 128 + signal.SIGTERM) -> Scenario:
    s = runs[name]
    if s.error is not None:
        raise s.error
    assert s.code == code, s.text
    return s


def _reference(runs: Dict[str, Scenario]) -> Tuple[Dict[str, torch.Tensor], dict]:
    return _result(runs["reference"].out)


def test_sigterm_during_evaluation_is_saved_then_and_resumes_exactly(runs):
    s = _interrupted(runs, "sigterm")
    committed = s.times("COMMITTED 4 ")
    assert committed and committed[0] - s.sent < BOUND, s.text
    assert (f"keepalive: SIGTERM: saved in epoch 0 after 8 batches, step 4 to {s.run} during a pause of "
            "the training loop; exiting with code 143") in s.text
    # it exited during the evaluation (its end line is printed as the exit passes through it)
    (start,), (end,) = s.times("EVAL START"), s.times("EVAL END")
    assert end - start < EVAL_BATCHES * SLOW_BATCH, s.text
    assert not _differences(_reference(runs), s.result())


def test_sigterm_during_one_long_evaluation_batch_is_saved_by_the_guard_thread(runs):
    """No hook runs during the one 8 s evaluation batch: the core's guard thread saves (the Trainer's
    optimizer steps are gated), and the signal sent again to the main thread ends the batch's wait."""
    s = _interrupted(runs, "guard")
    committed = s.times("COMMITTED 4 ")
    assert committed and committed[0] - s.sent < BOUND, s.text
    assert "during a pause of the training loop; exiting with code 143" in s.text
    (start,), (end,) = s.times("EVAL START"), s.times("EVAL END")
    assert end - start < EVAL_BATCHES * SLOW_BATCH, s.text
    assert not _differences(_reference(runs), s.result())


def test_control_c_without_the_step_gate_the_guard_does_not_save(runs):
    """Control: the Trainer's optimizer not gated, the guard thread may not copy the state; the save waits
    for the long batch's end (the next evaluation hook) and misses the 5 s bound."""
    s = _interrupted(runs, "guard-ungated")
    committed = s.times("COMMITTED 4 ")
    assert committed and committed[0] - s.sent > BOUND, s.text


def test_deadline_during_evaluation_is_saved_then_stops_and_resumes_exactly(runs):
    s = _interrupted(runs, "deadline", code=143)  # stopped, not finished (EXIT_STOPPED)
    assert s.text.splitlines()[-1] == "STOPPED"
    (start,), (end,) = s.times("EVAL START"), s.times("EVAL END")
    committed = s.times("COMMITTED 4 ")
    # durable before the deadline (5 s after the evaluation's start) and before the evaluation ended
    assert committed and start < committed[0] < min(start + 5.0, end), s.text
    assert (f"keepalive: saved in epoch 0 after 8 batches, step 4 to {s.run} during a pause of the "
            "training loop; the training stops at its next step. Why: the session ends in ") in s.text
    assert "STEP 5" not in s.text  # stopped before the next step
    assert not _differences(_reference(runs), s.result())


def test_state_changed_before_evaluation_is_told_and_saved_at_the_next_boundary(runs):
    """A stateful callback counts epochs at the epoch end, after keepalive's boundary of the last step: the
    state during the evaluation is no longer the boundary's. keepalive says so once and saves at the next
    boundary (after the evaluation), exactly."""
    s = _interrupted(runs, "refused")
    assert s.text.count(REFUSED) == 1, s.text
    committed = s.times("COMMITTED ")
    (end,) = s.times("EVAL END")
    assert committed and committed[0] >= end and committed[0] - s.sent > BOUND, s.text
    got = s.result()
    assert not _differences(_reference(runs), got)
    assert got[1]["epochs_counted"] == 2


def test_control_a_fingerprint_blind_to_the_objects_saves_a_state_that_resumes_wrong(runs):
    """Control: with keepalive's fingerprint blind to the objects' state the save lands during the
    evaluation with the count already moved, and the resumed run, which runs the epoch end again, counts
    that epoch twice."""
    s = _interrupted(runs, "blind")
    assert "keepalive: warning" not in s.text
    committed = s.times("COMMITTED 4 ")
    assert committed and committed[0] - s.sent < BOUND, s.text
    got = s.result()
    assert not _differences(_reference(runs), got)  # the weights, logs and draws do not show it ...
    assert got[1]["epochs_counted"] == 3             # ... the callback's state does


def test_control_b_without_saves_between_steps_the_save_waits_for_the_evaluation(runs):
    """Control: keepalive's saves between steps switched off in the child (the guard never acts, the
    training thread's check does nothing): the SIGTERM is saved at the next boundary, after the
    evaluation, and the 5 s bound does not hold."""
    s = _interrupted(runs, "no-pause-save")
    committed = s.times("COMMITTED 4 ")
    (end,) = s.times("EVAL END")
    assert committed and committed[0] >= end, s.text
    assert committed[0] - s.sent > BOUND, s.text
    assert "during a pause of the training loop" not in s.text


def test_evaluation_for_a_step_is_told_and_saved_after_it(runs):
    """eval_strategy="steps": the Trainer evaluates for a step before keepalive's boundary of that step (a
    checkpoint holds the Trainer's work for its step): the save waits for the evaluation's end, said once."""
    s = _interrupted(runs, "eval-steps")
    assert s.text.count(EVAL_STEPS) == 1, s.text
    committed = s.times("COMMITTED 3 ")
    (end,) = s.times("EVAL END")
    assert committed and committed[0] >= end, s.text

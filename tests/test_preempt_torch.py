"""Saves between steps and the clouds' preemption notices, with the torch adapter.

A SIGTERM, the session's deadline or a cloud's notice that comes while the loop is outside a training
step (an 8 s evaluation, a data loader stall) is saved within 5 s, and the run resumed from that
checkpoint is bit-identical (weights, optimizer state, EMA, every batch's loss, every evaluation, a
last random draw) to an uninterrupted run without keepalive. The child is tests/scripts/preempt_torch.py.

The clouds' metadata services cannot run here: tests/metaserver.py stands in for them on 127.0.0.1
(same paths and headers), and keepalive is pointed at it with KEEPALIVE_CLOUD / KEEPALIVE_METADATA_URL.

The scenarios are independent children that mostly sleep (evaluations, stalls, notices): a module fixture
runs them side by side, each in a thread of its own that waits only for its own child's lines, and each
test reports its scenario's outcome.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch")

from crashkit import assert_differs, assert_same  # noqa: E402
from forkserver import Forked, ForkServer  # noqa: E402
from metaserver import MetadataServer  # noqa: E402
from test_distributed import Job  # noqa: E402  (torchrun jobs of tests/scripts/ddp_train.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "preempt_torch.py")
BOUND = 5.0  # seconds from the signal / the deadline / the notice to the committed checkpoint
PAUSED = "during a pause of the training loop"
REFUSED = ("SIGTERM received while the training loop paused between steps (an evaluation?), but its state is no "
           "longer that of its last step (a tensor of the state was changed in place since the last step (a "
           "forward pass in training mode, an EMA update)): the save waits for the next step boundary.")
NOT_A_CLOUD = {"KEEPALIVE_CLOUD": "none"}
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0", **NOT_A_CLOUD,
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
#: the children's fork server while the module fixture runs (importing torch is most of a child's CPU
#: time, and this file starts some 30 children on a 2-core machine)
FORKS: List[ForkServer] = []
PRELOAD = ["torch", "torch._dynamo", "torch.utils.data"]  # the optimizer's construction imports torch._dynamo


class Child:
    """The training script in a process of its own; its lines read by a thread, each with the
    monotonic time it was read at (what the latency assertions measure)."""

    def __init__(self, run_dir: str, out_file: str, env: Dict[str, str]):
        full = dict(BASE_ENV, **env)
        self.proc: "subprocess.Popen[str] | Forked"
        if FORKS:  # the module fixture's: a fork of a process that has imported torch already
            self.proc = FORKS[0].spawn([SCRIPT, run_dir, out_file], full)
        else:
            self.proc = subprocess.Popen([sys.executable, SCRIPT, run_dir, out_file], env=full, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: List[Tuple[float, str]] = []
        self._queue: "queue.Queue[Optional[Tuple[float, str]]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self._queue.put((time.monotonic(), line.rstrip("\n")))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = 120.0) -> Tuple[float, "re.Match[str]"]:
        """The first line (from here on) that matches ``pattern``: its time and match."""
        end = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {pattern!r} in {timeout} s:\n{self.text}") from None
            if item is None:
                self._queue.put(None)
                raise AssertionError(f"the child ended without a line {pattern!r}:\n{self.text}")
            self.lines.append(item)
            m = regex.search(item[1])
            if m:
                return item[0], m

    def finish(self, timeout: float = 120.0) -> int:
        """Its exit code, once all its output is read."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        while True:
            item = self._queue.get(timeout=30)
            if item is None:
                return code
            self.lines.append(item)

    def kill(self) -> None:
        self.proc.kill()
        self.finish()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def results(children: List[Child], out_file: str) -> Dict[str, object]:
    """What a training produced over its processes (each later process's line replaces an earlier one
    of the same batch: a resume runs again what came after its checkpoint)."""
    losses: Dict[Tuple[str, str], str] = {}
    evals: Dict[str, str] = {}
    for child in children:
        for _, line in child.lines:
            parts = line.split()
            if parts[:1] == ["LOSS"]:
                losses[(parts[1], parts[2])] = parts[3]
            elif parts[:1] == ["EVAL"] and len(parts) == 3 and parts[1] not in ("START", "END"):
                evals[parts[1]] = parts[2]
    return {"final": torch.load(out_file), "losses": losses, "evals": evals}


class References:
    """The uninterrupted runs without keepalive, per variant of the training: each made once, in a pool of
    its own (a scenario that needs one waits for it; no scenario's thread ever makes one)."""

    VARIANTS = ({}, {"PT_EMA": "1"}, {"PT_ACCUM": "2"}, {"PT_SCHED_BEFORE_EVAL": "1"})

    def __init__(self, folder, pool: concurrent.futures.ThreadPoolExecutor):
        self.folder, self.pool = folder, pool
        self.made: Dict[str, "concurrent.futures.Future[Dict[str, object]]"] = {}
        self.lock = threading.Lock()
        for env in self.VARIANTS:
            self.start(env)

    def start(self, env: Dict[str, str]) -> "concurrent.futures.Future[Dict[str, object]]":
        key = repr(sorted(env.items()))
        with self.lock:
            if key not in self.made:
                self.made[key] = self.pool.submit(self.make, env, str(self.folder / f"ref{len(self.made)}.pt"))
            return self.made[key]

    def make(self, env: Dict[str, str], out: str) -> Dict[str, object]:
        child = Child(str(self.folder / "unused"), out, dict(env, PT_PLAIN="1", PT_EVAL_SECONDS="0"))
        assert child.finish() == 0, child.text
        return results([child], out)

    def __call__(self, **env: str) -> Dict[str, object]:
        return self.start(env).result()


Scenario = Callable[..., None]
SCENARIOS: Dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    """Registers ``fn(tmp_path, reference)`` (assertions inside) with the module fixture."""
    SCENARIOS[fn.__name__] = fn
    return fn


def scenario_per_eval_kind(fn: Scenario) -> Scenario:
    """Registers ``fn(tmp_path, reference, eval_kind)`` once per kind of evaluation loop, as
    ``name[ka]`` and ``name[plain]``."""
    for kind in ("ka", "plain"):
        SCENARIOS[f"{fn.__name__}[{kind}]"] = functools.partial(fn, eval_kind=kind)
    return fn


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Dict[str, "concurrent.futures.Future[None]"]:
    """Every scenario run side by side (all at once: forked children that mostly sleep); a test calls
    ``.result()`` of its own (its assertion error, if any)."""
    FORKS.append(ForkServer(PRELOAD, BASE_ENV, quick_exit=True))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(References.VARIANTS)) as refs_pool, \
                concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
            reference = References(tmp_path_factory.mktemp("plain"), refs_pool)
            found = {name: pool.submit(fn, tmp_path_factory.mktemp(name), reference)
                     for name, fn in SCENARIOS.items()}
            concurrent.futures.wait(list(found.values()))
    finally:
        FORKS.pop().close()
    return found


def resume(run_dir: str, out_file: str, env: Dict[str, str]) -> Child:
    """The same script run again (no signal, no deadline, no notice) until it completes."""
    child = Child(run_dir, out_file, dict(env, PT_EVAL_SECONDS="0"))
    assert child.finish() == 0, child.text
    assert "resuming run" in child.text, child.text
    return child


def latency(child: Child, since: float, step: int) -> float:
    """Seconds from ``since`` to the line that says ``step``'s checkpoint was committed."""
    at, _ = child.wait_line(rf"^COMMITTED {step}$", timeout=60)
    return at - since


# ---------------------------------------------------------------------- SIGTERM during an evaluation
@scenario_per_eval_kind
def sigterm_during_evaluation_is_saved_within_5s_and_resumes_bit_identically(tmp_path, reference, eval_kind):
    """The evaluation after epoch 1 lasts 8 s; SIGTERM 1 s into it. Through ``ckpt.batches(val_loader)``
    the training thread saves at the evaluation's next batch; through a plain ``for x in val_loader``
    keepalive's guard thread saves. Either way: committed within 5 s, exit 143 before the evaluation's
    end, and the resume (which runs the evaluation and the epoch's end again, once) is bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL": eval_kind}
    first = Child(run, out, dict(env, PT_EVAL_SECONDS="8"))
    started, _ = first.wait_line(r"^EVAL START 1$")
    time.sleep(1.0)
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    assert latency(first, sent, 20) < BOUND, first.text
    assert first.finish() == 143, first.text
    assert "EVAL END 1" not in first.text, first.text
    assert (f"SIGTERM: saved in epoch 1 after 10 batches, step 20 to {run} {PAUSED}; exiting with code 143"
            in first.text), first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference())


@scenario
def negative_control_without_saves_between_steps_the_save_waits_for_the_evaluation(tmp_path, reference) -> None:
    """The same SIGTERM with the saves between steps switched off: the checkpoint comes only at the
    epoch's end, after the evaluation: later than the bound, so the test above can fail."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    first = Child(run, out, {"PT_EVAL": "ka", "PT_EVAL_SECONDS": "8", "PT_NO_PAUSE_SAVE": "1"})
    first.wait_line(r"^EVAL START 1$")
    time.sleep(1.0)
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    first.wait_line(r"^EVAL END 1$")
    assert latency(first, sent, 20) > BOUND, first.text
    assert first.finish() == 143, first.text
    assert f"{run} {PAUSED}" not in first.text, first.text


@scenario
def negative_control_the_random_state_of_the_save_s_moment_is_not_the_resume_of_the_step(tmp_path, reference) -> None:
    """A save during the evaluation that keeps the random state of its moment (after some of the
    evaluation's draws) instead of the last step's: the resumed run differs, so the comparison above
    can fail."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL": "ka", "PT_BROKEN_RNG": "1"}
    first = Child(run, out, dict(env, PT_EVAL_SECONDS="4"))
    first.wait_line(r"^EVAL START 1$")
    time.sleep(1.5)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 143 and f"{run} {PAUSED}" in first.text, first.text
    second = resume(run, out, env)
    assert_differs(results([first, second], out), reference())


@scenario
def ema_changed_in_place_during_evaluation_refuses_then_saves_at_the_epoch_end(tmp_path, reference) -> None:
    """An EMA updated in place at the evaluation's start: the state is no longer the last step's. The
    SIGTERM is said to wait (once, with what to change), saved at the epoch's end, and the resume is
    still bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL": "ka", "PT_EMA": "1"}
    first = Child(run, out, dict(env, PT_EVAL_SECONDS="4"))
    first.wait_line(r"^EVAL START 1$")
    time.sleep(1.0)
    first.proc.send_signal(signal.SIGTERM)
    first.wait_line(r"^EVAL END 1$")
    assert first.finish() == 143, first.text
    assert REFUSED in first.text and first.text.count("paused between steps") == 1, first.text
    assert f"{run} {PAUSED}" not in first.text, first.text
    assert f"SIGTERM: saved at the end of epoch 1, step 20 to {run}; exiting with code 143" in first.text, first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference(PT_EMA="1"))


@scenario
def sigterm_during_a_data_stall_is_saved_within_5s(tmp_path, reference) -> None:
    """The training loader (num_workers=0) takes 8 s for one item of epoch 1: a SIGTERM 1 s into the
    stall is saved by the guard thread within 5 s, and the resume is bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    first = Child(run, out, {"PT_EVAL_SECONDS": "0", "PT_STALL": str(40 + 4 * 4 + 1)})  # step 15's
    first.wait_line(r"^STALL$")
    time.sleep(1.0)
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    assert latency(first, sent, 14) < BOUND, first.text
    assert first.finish() == 143, first.text
    assert f"SIGTERM: saved in epoch 1 after 4 batches, step 14 to {run} {PAUSED}" in first.text, first.text
    second = resume(run, out, {})
    assert_same(results([first, second], out), reference())


@scenario
def sigterm_with_gradients_pending_waits_for_the_step(tmp_path, reference) -> None:
    """Two micro-batches per step; a 3 s pause in the loop body with the first one's gradients pending:
    no consistent state, so no save during the pause; the SIGTERM is saved at the step's boundary."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_ACCUM": "2", "PT_EVAL_SECONDS": "0"}
    first = Child(run, out, dict(env, PT_ACCUM_PAUSE="3", PT_ACCUM_STEP="7"))
    first.wait_line(r"^PAUSE$")
    time.sleep(0.5)
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    at, _ = first.wait_line(r"^STEP 7$")
    assert at - sent > 1.5  # the pause went on: nothing raised into it
    assert first.finish() == 143, first.text
    assert f"SIGTERM: saved in epoch 1 after 4 batches, step 7 to {run}; exiting" in first.text, first.text
    assert f"{run} {PAUSED}" not in first.text, first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference(PT_ACCUM="2"))


# ----------------------------------------------------------------------- the deadline in an evaluation
@scenario_per_eval_kind
def deadline_inside_evaluation_saves_during_it_and_stops(tmp_path, reference, eval_kind: str) -> None:
    """The session's deadline falls 4 s into the 8 s evaluation: saved during it (within 5 s of the
    moment the deadline was within a save and the margin), the training stops at its next boundary
    (the epoch's end) and the script exits 143 (EXIT_STOPPED), and the resume is bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL": eval_kind}
    first = Child(run, out, dict(env, PT_EVAL_SECONDS="8", PT_DEADLINE="4.5"))
    started, _ = first.wait_line(r"^EVAL START 1$")
    assert latency(first, started, 20) < BOUND, first.text
    end, _ = first.wait_line(r"^EVAL END 1$")
    assert first.finish() == 143, first.text
    assert f"saved in epoch 1 after 10 batches, step 20 to {run} {PAUSED}; the training stops" in first.text
    assert "STOPPED 20" in first.text, first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference())


@scenario
def a_scheduler_stepped_before_the_evaluation_is_saved_during_it(tmp_path, reference) -> None:
    """The scheduler steps between the epoch's last batch and the evaluation: the deadline's save during
    the evaluation is made all the same (with the scheduler's state as the last step boundary left it:
    tests/test_eval_pause.py), the training stops at the epoch's end, and the resume, which steps the
    scheduler again, is bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL": "ka", "PT_SCHED_BEFORE_EVAL": "1"}
    first = Child(run, out, dict(env, PT_EVAL_SECONDS="4", PT_DEADLINE="3"))
    first.wait_line(r"^EVAL END 1$")
    assert first.finish() == 143, first.text
    assert "paused between steps" not in first.text, first.text
    assert f"saved in epoch 1 after 10 batches, step 20 to {run} {PAUSED}; the training stops" in first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference(PT_SCHED_BEFORE_EVAL="1"))


# ------------------------------------------------------------------------------ preemption notices
def noticed(srv: MetadataServer, cloud: str, **env: str) -> Dict[str, str]:
    """The child's environment: watch ``cloud``'s notices at the stand-in server (AWS and Azure
    polled every 0.5 s instead of the documented 5 s, to keep the test short; GCE long-polls)."""
    return dict(env, KEEPALIVE_CLOUD=cloud, KEEPALIVE_METADATA_URL=srv.url,
                **({"PT_NOTICE_POLL": "0.5"} if cloud != "gce" else {}))


def inside(step: int) -> str:
    """How keepalive names the position of ``step`` (inside an epoch: 10 steps each)."""
    epoch, batch = divmod(step, 10)
    assert batch, "a step inside an epoch"
    return f"in epoch {epoch} after {batch} batches, step {step}"


def stopped_by_notice(child: Child, run: str) -> int:
    """The step the notice's save and stop left the run at, after the stop's exit (143, EXIT_STOPPED)."""
    assert child.finish() == 143, child.text
    m = re.search(r"^STOPPED (\d+)$", child.text, re.M)
    assert m and "DONE" not in child.text, child.text
    return int(m.group(1))


@scenario
def notice_before_the_first_checkpoint_saves_and_stops(tmp_path, reference) -> None:
    """AWS: the Spot notice comes at the training's first step, long before its first scheduled save
    (every 100 steps): saved within 5 s, stopped cleanly, resumed bit-identically."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL_SECONDS": "0", "PT_EVERY": "100"}
    with MetadataServer(cloud="aws") as srv:
        first = Child(run, out, noticed(srv, "aws", PT_STEP_SLEEP="0.2", **env))
        first.wait_line(r"^STEP 1$")
        sent = time.monotonic()
        srv.preempt()
        at, m = first.wait_line(r"^COMMITTED (\d+)$")
        assert at - sent < BOUND, first.text
        step = stopped_by_notice(first, run)
    assert int(m.group(1)) == step < 30, first.text
    assert f"stopping before the VM is reclaimed: saved {inside(step)} to {run}. Why: AWS" in first.text, first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference())


@scenario
def notice_mid_epoch_saves_acknowledges_and_stops(tmp_path, reference) -> None:
    """Azure: a Preempt event in the middle of epoch 2: saved at the next step (inside the epoch)
    within 5 s, the event acknowledged, stopped cleanly, resumed bit-identically."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    env = {"PT_EVAL_SECONDS": "0", "PT_EVERY": "100"}
    with MetadataServer(cloud="azure") as srv:
        first = Child(run, out, noticed(srv, "azure", PT_STEP_SLEEP="0.2", **env))
        first.wait_line(r"^STEP 13$")
        sent = time.monotonic()
        srv.preempt()
        at, m = first.wait_line(r"^COMMITTED (\d+)$")
        assert at - sent < BOUND, first.text
        step = stopped_by_notice(first, run)
        assert srv.acknowledged == ["EV-PREEMPT-1"], srv.acknowledged
    assert int(m.group(1)) == step and 13 <= step < 20, first.text  # inside epoch 2
    assert f"stopping before the VM is reclaimed: saved {inside(step)} to {run}. Why: Azure" in first.text, first.text
    second = resume(run, out, env)
    assert_same(results([first, second], out), reference())


@scenario
def notice_with_on_preempt_save_saves_once_and_trains_on(tmp_path, reference) -> None:
    """GCE with ``on_preempt="save"``: one save within 5 s of the notice, then the training goes on to
    its end, unchanged by the save."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    with MetadataServer(cloud="gce") as srv:
        first = Child(run, out, noticed(srv, "gce", PT_STEP_SLEEP="0.1", PT_EVAL_SECONDS="0", PT_EVERY="100",
                                        PT_ON_PREEMPT="save"))
        first.wait_line(r"^STEP 13$")
        sent = time.monotonic()
        srv.preempt()
        at, m = first.wait_line(r"^COMMITTED (\d+)$")
        step = int(m.group(1))
        assert at - sent < BOUND and 13 <= step < 30, first.text
        assert first.finish() == 0, first.text
    assert "DONE" in first.text and "STOPPED" not in first.text, first.text
    assert ("GCE: instance/preempted is TRUE (the VM stops in about 30 s): saved "
            f"{inside(step)} to {run}; the training goes on") in first.text, first.text
    assert_same(results([first], out), reference())


@scenario
def notice_during_a_30s_evaluation_is_saved_within_5s(tmp_path, reference) -> None:
    """GCE: the notice comes 1 s into a 30 s evaluation: saved within 5 s (the state of the epoch's
    last step, its evaluation to run again), said, the stop owed to the next boundary. The test does
    not wait the 30 s out: it kills the child once the save landed (the VM would be gone), and the
    resume is bit-identical."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    with MetadataServer(cloud="gce") as srv:
        first = Child(run, out, noticed(srv, "gce", PT_EVAL="ka", PT_EVAL_SECONDS="30"))
        first.wait_line(r"^EVAL START 1$")
        time.sleep(1.0)
        sent = time.monotonic()
        srv.preempt()
        assert latency(first, sent, 20) < BOUND, first.text
        first.wait_line(f"saved in epoch 1 after 10 batches, step 20 to {re.escape(run)} {PAUSED}; "
                        "the training stops at its next step", timeout=30)
        first.kill()
    assert "EVAL END 1" not in first.text, first.text
    second = resume(run, out, {"PT_EVAL": "ka"})
    assert_same(results([first, second], out), reference())


class DDPJob(Job):
    """test_distributed's torchrun job of tests/scripts/ddp_train.py, which can wait for a line."""

    def wait_output(self, text: str, timeout: float = 150.0) -> None:
        end = time.monotonic() + timeout
        while text not in self.text():
            assert time.monotonic() < end and self.proc.poll() is None, self.text()
            time.sleep(0.05)


def finished(job: DDPJob) -> int:
    try:
        return job.wait()
    finally:
        job.stop()


@scenario
def notice_under_two_rank_ddp_is_agreed_saved_once_and_both_stop(tmp_path, reference) -> None:
    """GCE, torchrun with 2 ranks (gloo): the notice is agreed at the next step boundary by both ranks,
    saved once, both ranks stop with exit 143; the resume is bit-identical to the run without keepalive."""
    plain = DDPJob(tmp_path, "plain", env={"DDP_PLAIN": "1", **NOT_A_CLOUD})  # runs beside the notice's job
    try:
        with MetadataServer(cloud="gce") as srv:
            job = DDPJob(tmp_path, "notice", env={"KEEPALIVE_CLOUD": "gce", "KEEPALIVE_METADATA_URL": srv.url,
                                                  "DDP_STEP_SLEEP": "0.2", "DDP_EVERY": "100"})
            job.wait_output("STEP 10 attempt 0")
            sent = time.monotonic()
            srv.preempt()
            job.wait_output("COMMITTED")
            took = time.monotonic() - sent
            assert finished(job) != 0, job.text()  # stopped, not finished: the ranks exit 143 (EXIT_STOPPED)
    finally:
        plain_code = finished(plain)
    assert plain_code == 0, plain.text()
    text = job.text()
    steps = {int(s) for s in re.findall(r"STOPPED rank \d step (\d+) exit 143", text)}
    assert len(steps) == 1 and len(re.findall(r"STOPPED rank", text)) == 2, text
    assert "exitcode  : 143" in text and "DONE" not in text, text
    step = steps.pop()
    assert took < BOUND and 10 <= step < 36, text
    assert "stopping before the VM is reclaimed: saved in epoch " in text and "Why: GCE: instance/preempted is TRUE" \
        in text, text
    assert text.count("COMMITTED") == 1, text
    again = DDPJob(tmp_path, "resume", run_dir=job.run_dir, env=NOT_A_CLOUD)
    assert finished(again) == 0, again.text()
    assert "resuming run" in again.text(), again.text()
    for rank, (mine, theirs) in enumerate(zip(again.finals(), plain.finals())):
        assert_same(mine, theirs, f"rank {rank}")


# ------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("eval_kind", ["ka", "plain"])
def test_sigterm_during_evaluation_is_saved_within_5s_and_resumes_bit_identically(outcomes, eval_kind):
    outcomes[f"sigterm_during_evaluation_is_saved_within_5s_and_resumes_bit_identically[{eval_kind}]"].result()


def test_negative_control_without_saves_between_steps_the_save_waits_for_the_evaluation(outcomes):
    outcomes["negative_control_without_saves_between_steps_the_save_waits_for_the_evaluation"].result()


def test_negative_control_the_random_state_of_the_save_s_moment_is_not_the_resume_of_the_step(outcomes):
    outcomes["negative_control_the_random_state_of_the_save_s_moment_is_not_the_resume_of_the_step"].result()


def test_ema_changed_in_place_during_evaluation_refuses_then_saves_at_the_epoch_end(outcomes):
    outcomes["ema_changed_in_place_during_evaluation_refuses_then_saves_at_the_epoch_end"].result()


def test_sigterm_during_a_data_stall_is_saved_within_5s(outcomes):
    outcomes["sigterm_during_a_data_stall_is_saved_within_5s"].result()


def test_sigterm_with_gradients_pending_waits_for_the_step(outcomes):
    outcomes["sigterm_with_gradients_pending_waits_for_the_step"].result()


@pytest.mark.parametrize("eval_kind", ["ka", "plain"])
def test_deadline_inside_evaluation_saves_during_it_and_stops(outcomes, eval_kind):
    outcomes[f"deadline_inside_evaluation_saves_during_it_and_stops[{eval_kind}]"].result()


def test_a_scheduler_stepped_before_the_evaluation_is_saved_during_it(outcomes):
    outcomes["a_scheduler_stepped_before_the_evaluation_is_saved_during_it"].result()


def test_notice_before_the_first_checkpoint_saves_and_stops(outcomes):
    outcomes["notice_before_the_first_checkpoint_saves_and_stops"].result()


def test_notice_mid_epoch_saves_acknowledges_and_stops(outcomes):
    outcomes["notice_mid_epoch_saves_acknowledges_and_stops"].result()


def test_notice_with_on_preempt_save_saves_once_and_trains_on(outcomes):
    outcomes["notice_with_on_preempt_save_saves_once_and_trains_on"].result()


def test_notice_during_a_30s_evaluation_is_saved_within_5s(outcomes):
    outcomes["notice_during_a_30s_evaluation_is_saved_within_5s"].result()


def test_notice_under_two_rank_ddp_is_agreed_saved_once_and_both_stop(outcomes):
    outcomes["notice_under_two_rank_ddp_is_agreed_saved_once_and_both_stop"].result()

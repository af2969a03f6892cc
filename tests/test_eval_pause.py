"""Saves during the evaluation of the loop people write: ``train batches; sched.step(); evaluate()``.

The scheduler steps between the epoch's last batch and its evaluation; a SIGTERM or a cloud's notice
0.5 s into a 20 s evaluation is saved during it (committed within 5 s), with the scheduler's and the
optimizer's learning rate as the last step boundary left them (keepalive keeps that small state at
each boundary: :class:`keepalive.pauses.BoundaryPart`), and the run resumed from that checkpoint
(after a SIGKILL) is bit-identical to an uninterrupted run without keepalive. Controls: a tensor
changed in the evaluation is refused, named, and saved at the next step boundary (still exact); the
same save writing the stepped scheduler resumes differently; the fingerprint that compared the
scheduler (the old rule) makes the save wait for the evaluation's end. The child is
tests/scripts/eval_pause_train.py; GCE's metadata service is tests/metaserver.py's stand-in.

The scenarios are children that mostly sleep: a module fixture runs them side by side, each in a thread
that waits for its own child's lines, and each test reports its scenario's outcome.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import re
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch")

from crashkit import assert_differs, assert_same  # noqa: E402
from forkserver import ForkServer  # noqa: E402
from metaserver import MetadataServer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "eval_pause_train.py")
BOUND = 5.0  # seconds from the signal / the notice to the committed checkpoint
PAUSED = "during a pause of the training loop"
AT_LAST_BATCH = "in epoch 1 after 8 batches, step 16"  # the boundary before epoch 1's evaluation
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0",
                KEEPALIVE_CLOUD="none",
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
FORKS: List[ForkServer] = []
#: what the scenarios measured (seconds from the signal to the commit), printed at the module's end
MEASURED: Dict[str, float] = {}


class Child:
    """The training script in a fork of the module's server; its lines read by a thread, each with
    the monotonic time it was read at."""

    def __init__(self, run_dir: str, out_file: str, env: Dict[str, str]):
        self.proc = FORKS[0].spawn([SCRIPT, run_dir, out_file], dict(BASE_ENV, **env))
        self.lines: List[Tuple[float, str]] = []
        self._queue: "queue.Queue[Optional[Tuple[float, str]]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self._queue.put((time.monotonic(), line.rstrip("\n")))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = 60.0) -> float:
        """The time of the first line (from here on) that matches ``pattern``."""
        end, regex = time.monotonic() + timeout, re.compile(pattern)
        while True:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {pattern!r} in {timeout} s:\n{self.text}") from None
            if item is None:
                self._queue.put(None)
                raise AssertionError(f"the child ended without a line {pattern!r}:\n{self.text}")
            self.lines.append(item)
            if regex.search(item[1]):
                return item[0]

    def finish(self, timeout: float = 60.0) -> int:
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

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def results(children: List[Child], out_file: str) -> Dict[str, object]:
    """What a training produced over its processes (a later process's line replaces an earlier one)."""
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
    """The uninterrupted runs without keepalive, one per variant, each made once (in a pool of its own)."""

    VARIANTS = ({}, {"EP_SCHED": "0"}, {"EP_TOUCH": "bn"})

    def __init__(self, folder, pool: concurrent.futures.ThreadPoolExecutor):
        self.folder, self.pool = folder, pool
        self.made: Dict[str, "concurrent.futures.Future[Dict[str, object]]"] = {}
        for env in self.VARIANTS:
            key = repr(sorted(env.items()))
            self.made[key] = pool.submit(self.make, env, str(folder / f"ref{len(self.made)}.pt"))

    def make(self, env: Dict[str, str], out: str) -> Dict[str, object]:
        child = Child(str(self.folder / "unused"), out, dict(env, EP_PLAIN="1", EP_EVAL_SECONDS="0"))
        assert child.finish() == 0, child.text
        return results([child], out)

    def __call__(self, **env: str) -> Dict[str, object]:
        return self.made[repr(sorted(env.items()))].result()


Scenario = Callable[..., None]
SCENARIOS: Dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Dict[str, "concurrent.futures.Future[None]"]:
    FORKS.append(ForkServer(["torch", "torch._dynamo", "torch.utils.data"], BASE_ENV))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(References.VARIANTS)) as refs_pool, \
                concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
            reference = References(tmp_path_factory.mktemp("plain"), refs_pool)
            found = {name: pool.submit(fn, tmp_path_factory.mktemp(name), reference)
                     for name, fn in SCENARIOS.items()}
            concurrent.futures.wait(list(found.values()))
    finally:
        FORKS.pop().close()
    print("\nseconds from the signal / the notice to the commit:",
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(MEASURED.items())))
    return found


def resume(run_dir: str, out_file: str, env: Dict[str, str]) -> Child:
    """The same script run again (no signal, no notice) until it completes."""
    child = Child(run_dir, out_file, dict(env, EP_EVAL_SECONDS="0"))
    assert child.finish() == 0, child.text
    assert "resuming run" in child.text, child.text
    return child


def interrupt_the_evaluation(name: str, tmp_path, env: Dict[str, str], how: str) -> Tuple[Child, str, str]:
    """Epoch 1's 20 s evaluation, after the scheduler's step, interrupted 0.5 s in by ``how``
    (``sigterm`` or a ``gce`` notice); the commit within 5 s; the child SIGKILLed once it landed (a
    SIGTERM's child exits 143 by itself, before the evaluation's end)."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    with MetadataServer(cloud="gce") as srv:
        cloud = {"KEEPALIVE_CLOUD": "gce", "KEEPALIVE_METADATA_URL": srv.url} if how == "gce" else {}
        first = Child(run, out, dict(env, **cloud))
        first.wait_line(r"^EVAL START 1$")
        time.sleep(0.5)
        sent = time.monotonic()
        if how == "gce":
            srv.preempt()
        else:
            first.proc.send_signal(signal.SIGTERM)
        MEASURED[name] = first.wait_line(r"^COMMITTED 16$", timeout=40) - sent
        if how == "gce":
            first.wait_line(f"saved {AT_LAST_BATCH} to {re.escape(run)} {PAUSED}; the training stops at its next step")
            first.proc.kill()
            first.finish()
        else:
            assert first.finish() == 143, first.text
    assert MEASURED[name] < BOUND, f"committed {MEASURED[name]:.2f} s after the {how}:\n{first.text}"
    assert "EVAL END 1" not in first.text and "paused between steps" not in first.text, first.text
    if how == "sigterm":
        assert f"SIGTERM: saved {AT_LAST_BATCH} to {run} {PAUSED}; exiting with code 143" in first.text, first.text
    return first, run, out


# ------------------------------------------------------------------- saved during the evaluation
@scenario
def sigterm_after_sched_step_plain_eval(tmp_path, reference) -> None:
    """SIGTERM during ``for x, y in val_loader`` (keepalive's guard thread saves)."""
    first, run, out = interrupt_the_evaluation("sigterm, plain loop", tmp_path, {}, "sigterm")
    assert_same(results([first, resume(run, out, {})], out), reference())


@scenario
def sigterm_after_sched_step_ckpt_batches_eval(tmp_path, reference) -> None:
    """SIGTERM during ``for x, y in ckpt.batches(val_loader)`` (saved at the evaluation's next batch)."""
    env = {"EP_EVAL": "ka"}
    first, run, out = interrupt_the_evaluation("sigterm, ckpt.batches", tmp_path, env, "sigterm")
    assert_same(results([first, resume(run, out, env)], out), reference())


@scenario
def gce_notice_after_sched_step(tmp_path, reference) -> None:
    """A GCE preemption notice during the evaluation, then the VM gone (SIGKILL)."""
    first, run, out = interrupt_the_evaluation("gce notice, scheduler", tmp_path, {}, "gce")
    assert_same(results([first, resume(run, out, {})], out), reference())


@scenario
def gce_notice_without_a_scheduler(tmp_path, reference) -> None:
    """No scheduler: the evaluation after the batch loop inside the epoch, a GCE notice 0.5 s in."""
    env = {"EP_SCHED": "0"}
    first, run, out = interrupt_the_evaluation("gce notice, no scheduler", tmp_path, env, "gce")
    assert_same(results([first, resume(run, out, env)], out), reference(EP_SCHED="0"))


# ----------------------------------------------------------------------------------- controls
def refused(tmp_path, env: Dict[str, str]) -> Tuple[Child, str, str]:
    """A SIGTERM 0.5 s into a 4 s evaluation that changed a tensor: refused once, saved at the epoch's
    end (after the evaluation), exit 143."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    first = Child(run, out, dict(env, EP_EVAL_SECONDS="4"))
    first.wait_line(r"^EVAL START 1$")
    time.sleep(0.5)
    first.proc.send_signal(signal.SIGTERM)
    end = first.wait_line(r"^EVAL END 1$")
    committed = first.wait_line(r"^COMMITTED 16$")
    assert first.finish() == 143 and committed > end, first.text
    assert first.text.count("paused between steps") == 1, first.text
    assert ("but its state is no longer that of its last step (a tensor of the state was changed in place since the "
            "last step (a forward pass in training mode, an EMA update)): the save waits for the next step "
            "boundary.") in first.text, first.text
    assert PAUSED not in first.text, first.text
    assert f"SIGTERM: saved at the end of epoch 1, step 16 to {run}; exiting with code 143" in first.text, first.text
    return first, run, out


@scenario
def control_batchnorm_forward_in_training_mode_is_refused_and_named(tmp_path, reference) -> None:
    first, run, out = refused(tmp_path, {"EP_TOUCH": "bn"})
    # (the running statistics are written by the batch-norm kernel, which moves no version counter;
    # the count of batches beside them is incremented in place, which does)
    assert "Changed in place since that step: 1.num_batches_tracked of 'model'" in first.text, first.text
    assert_same(results([first, resume(run, out, {"EP_TOUCH": "bn"})], out), reference(EP_TOUCH="bn"))


@scenario
def control_weight_written_is_refused_and_named(tmp_path, reference) -> None:
    first, _, _ = refused(tmp_path, {"EP_TOUCH": "param"})
    assert "Changed in place since that step: 4.bias of 'model'" in first.text, first.text


@scenario
def negative_control_the_stepped_scheduler_saved_resumes_otherwise(tmp_path, reference) -> None:
    """The save during the evaluation writing the registered objects as they are then (the scheduler
    stepped) instead of as the boundary left them: the resumed run steps it twice, and differs."""
    env = {"EP_NO_PARTS": "1"}
    first, run, out = interrupt_the_evaluation("control: stepped scheduler saved", tmp_path, env, "sigterm")
    assert_differs(results([first, resume(run, out, env)], out), reference())


@scenario
def negative_control_comparing_the_scheduler_waits_for_the_evaluation(tmp_path, reference) -> None:
    """The old rule (the scheduler's step count compared with the boundary's): the save is refused and
    waits for the evaluation's end, past the 5 s bound, so the tests above can fail."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    first = Child(run, out, {"EP_EVAL_SECONDS": "8", "EP_OLD_RULE": "1"})
    first.wait_line(r"^EVAL START 1$")
    time.sleep(0.5)
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    MEASURED["control: the old rule"] = took = first.wait_line(r"^COMMITTED 16$") - sent
    assert first.finish() == 143 and took > BOUND, first.text
    assert "(e.g. a scheduler stepped)): the save waits for the next step boundary" in first.text, first.text


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_eval_pause(outcomes, name):
    outcomes[name].result()


# ------------------------------------------------------------------------- the cost per step
def test_keeping_the_boundary_costs_under_2_percent_of_a_tiny_step(tmp_path):
    """What the boundary parts keep at each step boundary (the schedulers, the optimizer's groups,
    ckpt.extras) against one optimizer step of a tiny model without keepalive, the least of many
    timings each: an epoch's scheduler (not stepped between two boundaries: nothing copied) under 2 %;
    one stepped at every step (its whole state compared and its changes copied each time) under 5 %."""
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochly = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def least(fn: Callable[[], object], n: int = 50, rounds: int = 20) -> float:
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        return best

    step_s = least(step)  # without keepalive's hooks
    ckpt = DriveCheckpoint(str(tmp_path / "run"), model=model, optimizer=opt, scheduler=epochly, quiet=True)
    keep = ckpt.core.between_steps.keep_parts
    keep()
    epoch_s = least(keep)
    stepwise = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10**6)
    ckpt.register("stepwise", stepwise)
    keep()

    def stepped_and_kept() -> None:
        stepwise.step()
        keep()

    step_sched_s = least(stepped_and_kept) - least(stepwise.step) - epoch_s
    print(f"\na tiny step {step_s * 1e6:.0f} us; keeping the boundary's parts {epoch_s * 1e6:.2f} us "
          f"({100 * epoch_s / step_s:.2f} %), plus {step_sched_s * 1e6:.2f} us "
          f"({100 * step_sched_s / step_s:.2f} %) for a scheduler stepped at every step")
    assert epoch_s < 0.02 * step_s and step_sched_s < 0.05 * step_s


# ------------------------------------------------------------------------------ the pieces alone
def test_kept_copy_copies_no_tensor_and_only_what_changed():
    from keepalive.pauses import kept_copy

    weight = torch.zeros(3)
    live = {"last_epoch": 3, "base_lrs": [0.1], "phases": [{"end": 9.0}], "w": weight}
    first = kept_copy(live)
    assert first == {"last_epoch": 3, "base_lrs": [0.1], "phases": [{"end": 9.0}], "w": weight}
    assert first["w"] is weight and first["base_lrs"] is not live["base_lrs"]  # a tensor by reference
    live["base_lrs"][0] = 0.2  # changed in place after the boundary: the copy keeps the boundary's value
    live["last_epoch"] = 4
    second = kept_copy(live, first)
    assert first["base_lrs"] == [0.1] and second["base_lrs"] == [0.2] and second["last_epoch"] == 4
    assert second["phases"] is first["phases"]  # unchanged: shared, not copied again


def test_changed_tensor_names_the_tensor_that_moved_and_accepts_new_untouched_ones():
    from keepalive.pauses import changed_tensor, tensors_of, versions

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    saved = {"objects": {"model": model.state_dict()}}
    tensors = tensors_of(saved)
    before = versions(tensors)
    now = {"objects": {"model": model.state_dict()}, "rng": {"torch_cpu": torch.get_rng_state()}}
    assert changed_tensor(now, tensors, before) is None  # new views, a new (untouched) random state
    with torch.no_grad():
        model[0].bias.add_(1.0)
    assert changed_tensor({"objects": {"model": model.state_dict()}}, tensors, before) == "0.bias of 'model'"

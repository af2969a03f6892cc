"""The PyTorch loops people actually write, killed at the moment that hits their risk.

Each test trains a tiny real model (dropout, shuffled data with random noise) in a child process
(tests/scripts/loop_train.py), SIGKILLs it where the loop shape could go wrong (gradients pending, a
hand save just committed, the middle of an epoch whose prologue drew random numbers, ...), runs the
same script again, and compares the final model, optimizer and scheduler states, the counters and
the extras with those of an uninterrupted run of the same script: tensor for tensor with
``torch.equal``. Where exactness is impossible (the batch size changed), the test asserts the message
the user sees and that every sample is trained exactly once. Every scenario has a negative control:
the same kill with the piece of keepalive that makes it exact switched off (``--control``) must
give a different result, so no test here passes whatever keepalive does.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pytest
import torch

import crashkit
from crashkit import assert_differs, assert_same, run_to_completion
from forkserver import ForkingSubprocess, ForkServer, ServerPool
from keepalive.runs import position  # the words a resume line uses for a position

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "loop_train.py")
EPOCHS, SAMPLES, BATCH, ACC = 3, 80, 8, 3
ITERS = SAMPLES // BATCH  # 10 batches per epoch: not a multiple of ACC

pytestmark = pytest.mark.slow  # ~50 short training processes; for information, they all run

#: the training processes are forked from a server that has imported torch (tests/forkserver.py):
#: importing it was most of each short child's CPU time, some 50 times in this file; the children
#: that tests/crashkit.py starts fork from the same server
FORKS: List[ForkServer] = []
PRELOAD = ["torch", "torch._dynamo", "torch.utils.data"]


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    pool = ServerPool(lambda argv, env: ("torch", PRELOAD, "") if argv[0] == SCRIPT else None, quick_exit=True)
    server = pool.server_for([SCRIPT], dict(os.environ, PYTHONUNBUFFERED="1"))
    assert server is not None
    FORKS.append(server)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield FORKS[0]
    finally:
        FORKS.pop()
        pool.close()


# ------------------------------------------------------------------------------------- helpers
@dataclass
class Event:
    session: int  # 0 for the first process that trained this run, 1 for the next, ...
    kind: str
    fields: List[str]


class Training:
    """One run of loop_train.py: its run folder, log and final-state file; started until done."""

    def __init__(self, root, name: str, scenario: str, *options: str, env: Optional[dict] = None,
                 with_path: bool = True):
        self.name = name
        self.run_dir = root / name
        self.log = root / f"{name}.log"
        self.out = root / f"{name}.pt"
        self.base = [sys.executable, SCRIPT, "--scenario", scenario, "--out", str(self.out),
                     "--log", str(self.log), *(["--run", str(self.run_dir)] if with_path else []),
                     *options]
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.outputs: List[str] = []

    def start(self, *extra: str, killed: bool = False, returncode: Optional[int] = None) -> str:
        """Run the script once; ``killed``: it must end by the SIGKILL it was told to send itself;
        ``returncode``: it must end with this one."""
        if returncode is not None or not FORKS:
            # an exit status that is the point (an uncaught KeyboardInterrupt ends a real interpreter
            # by SIGINT, after its exit handlers; a fork cannot end that way): a fresh interpreter
            proc = subprocess.run([*self.base, *extra], capture_output=True, text=True, env=self.env,
                                  timeout=240)
        else:
            child = FORKS[0].spawn([*self.base[1:], *extra], self.env)
            stdout = child.stdout.read()  # its stdout and stderr, to the end: it has exited
            child.stdout.close()
            proc = subprocess.CompletedProcess(self.base, child.wait(timeout=240), stdout, "")
        output = proc.stdout + (proc.stderr or "")
        self.outputs.append(output)
        if returncode is not None:
            assert proc.returncode == returncode, f"{self.name}: ended {proc.returncode}:\n{output[-3000:]}"
        elif killed:
            assert proc.returncode == -signal.SIGKILL, f"{self.name}: not killed ({proc.returncode}):\n{output[-3000:]}"
            assert self.events("KILL"), f"{self.name}: killed, but not where it was told to"
        else:
            assert proc.returncode == 0 and "DONE" in proc.stdout, \
                f"{self.name} failed ({proc.returncode}):\n{output[-3000:]}"
        return output

    def state(self, suffix: str = "") -> Dict[str, Any]:
        return torch.load(f"{self.out}{suffix}", weights_only=False)

    def events(self, kind: Optional[str] = None) -> List[Event]:
        sessions: Dict[str, int] = {}
        out = []
        if not self.log.exists():
            return out
        for line in self.log.read_text().splitlines():
            pid, what, *fields = line.split(" ")
            session = sessions.setdefault(pid, len(sessions))
            if kind is None or what == kind:
                out.append(Event(session, what, fields))
        return out

    def commits(self) -> List[tuple]:
        """(session, epoch, batch, step, reason) of every checkpoint committed, all sessions."""
        return [(e.session, int(e.fields[0]), int(e.fields[1]), int(e.fields[2]), " ".join(e.fields[3:]))
                for e in self.events("COMMIT")]

    def first_epoch_line(self, session: int) -> tuple:
        """(epoch, batch, step) where the session's first epoch began: the resume point."""
        e = next(e for e in self.events("EPOCH") if e.session == session)
        return tuple(int(v) for v in e.fields)

    def last_commit_before_kill(self) -> tuple:
        events = self.events()
        kill = next(i for i, e in enumerate(events) if e.kind == "KILL")
        last = [e for e in events[:kill] if e.kind == "COMMIT"][-1]
        return tuple(int(v) for v in last.fields[:3])


def kill_and_resume(root, name: str, scenario: str, *options: str, kill: List[str],
                    resume: Optional[List[str]] = None, **kw) -> Training:
    """First session killed as ``kill`` says, the second runs the same script to the end."""
    t = Training(root, name, scenario, *options, **kw)
    t.start(*kill, killed=True)
    t.start(*(resume or []))
    return t


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("loops")


def _reference(root, name: str, scenario: str, *options: str) -> Training:
    t = Training(root, name, scenario, *options)
    t.start()
    assert not t.events("KILL")
    return t


# ------------------------------------------------------------------------- 1. accumulation
@pytest.fixture(scope="module")
def accum_ref(root):
    """An uninterrupted accumulation run; the save schedule changes nothing in the training, so it
    is the reference for every save schedule below."""
    return _reference(root, "accum-ref", "accum", "--every", "2")


def step_batch(batch: int, *, flush: bool = True) -> bool:
    """After ``batch`` (> 0) batches of an epoch, no gradient is pending (an optimizer step just ran;
    ``flush``: the loop steps at the epoch's last batch too)."""
    return batch % ACC == 0 or (flush and batch == ITERS)


def pending_commits(t: Training, flush: bool = True) -> List[tuple]:
    """The checkpoints taken while gradients were pending. At an epoch's end (batch 0) that is the
    case when the loop carries the epoch's rest into the next epoch (``flush=False``; ITERS is not a
    multiple of ACC), except at the end of training."""
    def pending(epoch: int, batch: int) -> bool:
        if batch == 0:  # an epoch's end
            return not flush and epoch < EPOCHS
        return not step_batch(batch, flush=flush)

    return [c for c in t.commits() if pending(c[1], c[2])]


@pytest.mark.parametrize("kill_at,grads,resumed", [
    ("1:8", "pending", (1, 6, 6)),  # after epoch 1's batch 7: (7 + 1) % 3, no step
    ("2:0", "clean", (1, 10, 8)),   # epoch 2's start; the newest save is after epoch 1's batches,
])                                  # before its scheduler step
def test_accumulation_every_2_steps(root, accum_ref, kill_at, grads, resumed):
    """`every=2` counts optimizer steps (4 per epoch here: after batches 3, 6, 9 and the epoch's last,
    10), not batches, and 2 is not a multiple of ACC=3. Killed right after a batch that only
    accumulated, or at the next epoch's start (the resume then runs the rest of epoch 1 after its
    batches: the scheduler step), it ends bit-identical."""
    name = f"accum-every2-{kill_at.replace(':', '-')}"
    t = kill_and_resume(root, name, "accum", "--every", "2", kill=["--kill-at", kill_at])
    assert grads in t.events("KILL")[0].fields
    assert t.last_commit_before_kill() == resumed
    assert t.first_epoch_line(1) == resumed
    assert f"resuming run '{name}'" in t.outputs[1]
    assert position(dict(zip(("epoch", "batch", "step"), resumed))) in t.outputs[1]
    assert pending_commits(t) == []
    assert_same(accum_ref.state(), t.state())


@pytest.mark.parametrize("signame,returncode,says", [
    ("TERM", 128 + signal.SIGTERM, "SIGTERM: saved in epoch 1 after 9 batches, step 7"),
    ("INT", -signal.SIGINT, "KeyboardInterrupt"),  # uncaught: python ends by SIGINT
])
def test_accumulation_signal_between_two_steps(root, accum_ref, signame, returncode, says):
    """SIGTERM / Ctrl-C right after a batch that only accumulated: keepalive finishes the accumulation
    up to the next optimizer step, saves there and stops; the re-run ends bit-identical."""
    name = f"accum-sig{signame}"
    t = Training(root, name, "accum", "--every", "epoch")
    out = t.start("--kill-at", "1:7", "--kill-signal", signame, returncode=returncode)
    assert "pending" in t.events("SIGNAL")[0].fields
    assert says in out
    assert [e for e in t.events("B") if e.session == 0][-1].fields[:2] == ["1", "8"]  # went on to the step
    assert t.commits()[-1][1:4] == (1, 9, 7)
    t.start()
    assert t.first_epoch_line(1) == (1, 9, 7)
    assert pending_commits(t) == []
    assert_same(accum_ref.state(), t.state())


def test_accumulation_control_without_the_pending_guard_differs(root, accum_ref):
    """Negative control: keepalive as it was before it followed the optimizer (every batch counts as a
    step, nothing waits for the optimizer step) saves between two steps; the same kill then drops the
    pending gradients."""
    t = kill_and_resume(root, "accum-guard-off", "accum", "--every", "2", "--control", "guard-off",
                        kill=["--kill-at", "1:8"])
    assert t.last_commit_before_kill()[:2] == (1, 8)  # a checkpoint with gradients pending
    assert pending_commits(t), "the pending-commit check must be able to fail"
    assert_differs(accum_ref.state(), t.state())


def killed_while_pending(t: Training, session: int) -> bool:
    """The session's last batch (before its kill) only accumulated gradients."""
    batches = [e for e in t.events("B") if e.session == session]
    return bool(batches) and not step_batch(int(batches[-1].fields[1]) + 1)


def test_accumulation_time_based_saves_random_kills(root, accum_ref):
    """`every="0.2s"`: saves come due at any batch, mostly between two optimizer steps; they wait for
    the next step. One kill exactly between two steps, then random SIGKILLs (mid-step, mid-write) until
    the run finishes: bit-identical, and no checkpoint was ever taken with gradients pending."""
    options = ["--every", "0.2s", "--sleep", "0.03"]
    t = Training(root, "accum-time", "accum", *options)
    t.start("--kill-at", "1:4", killed=True)  # after epoch 1's batch 3: one batch accumulated
    assert "pending" in t.events("KILL")[0].fields
    steps = EPOCHS * 4
    # kills land before the last two steps: a kill after the final save would leave the next start
    # nothing to do (fewer kills than planned, depending on the load)
    report = run_to_completion(t.base, total_steps=steps - 2, kills=4, rng=random.Random(13),
                               run_dir=str(t.run_dir), max_substep_delay=0.09, env=t.env)
    assert report.kills == 4
    resumed = [tr.resumed_step for tr in report.trials]
    assert all(r is not None for r in resumed), resumed
    commits = t.commits()
    assert pending_commits(t) == [], "a checkpoint was taken between two optimizer steps"
    assert any(0 < c[2] < ITERS for c in commits), "the time-based saves must land inside epochs"
    killed_pending = sum(1 for s in range(1, report.kills + 1) if killed_while_pending(t, s))
    print(f"\naccumulation every=0.2s: {report.kills + 1} kills survived "
          f"({1 + killed_pending} right after a batch without an optimizer step), {len(commits)} checkpoints, "
          f"resumed at steps {resumed}")
    assert_same(accum_ref.state(), t.state())


def test_accumulation_rest_carried_into_next_epoch_killed_after_epoch_end_save(root):
    """The snippet everyone copies: `for i, (x, y) in enumerate(loader)`, `if (i + 1) % ACC == 0:
    step` with no step for the epoch's rest (10 batches, ACC=3: batch 9's gradients roll into the
    next epoch). every="epoch" (the default). Killed early in epoch 1, after the epoch-0 save.

    An epoch's end is where every="epoch" saves, gradients pending or not: there the checkpoint
    holds the pending gradients (either is allowed), and only there: inside an epoch no
    checkpoint is ever taken while gradients are pending."""
    options = ["--every", "epoch", "--no-epoch-flush"]
    ref = _reference(root, "accum-noflush-ref", "accum", *options)
    t = kill_and_resume(root, "accum-noflush", "accum", *options, kill=["--kill-at", "1:1"])
    assert "pending" in t.events("KILL")[0].fields
    assert t.first_epoch_line(1)[0] == 1  # resumed in epoch 1
    pending = pending_commits(t, flush=False)
    assert pending and all(c[2] == 0 for c in pending), "mid-epoch checkpoint with gradients pending"
    for folder in t.run_dir.glob("ckpt-*"):  # each epoch-end checkpoint carries the gradients
        state = json.loads((folder / "state.json").read_text())
        if state["counters"]["batch"] == 0 and state["counters"]["epoch"] < EPOCHS:
            assert state["data"].get("pending_grads"), folder.name
    assert_same(ref.state(), t.state())


# ------------------------------------------------------------------------------ 2. batch size
def trained_once(t: Training, epoch: int) -> Counter:
    """How often each sample index of ``epoch`` was trained in the run's surviving history: each
    session's batches up to the step the next session resumed from, then the last session's."""
    sessions = 1 + max(e.session for e in t.events())
    resumed = {s: t.first_epoch_line(s)[2] for s in range(1, sessions)}
    seen: Counter = Counter()
    for e in t.events("B"):
        ep, step = int(e.fields[0]), int(e.fields[2])
        if ep == epoch and (e.session == sessions - 1 or step <= resumed[e.session + 1]):
            seen.update(int(i) for i in e.fields[3].split(","))
    return seen


@pytest.mark.parametrize("before,after,kill_at", [(8, 4, "1:6"), (4, 6, "1:13")])
def test_batch_size_changed_between_sessions(root, before, after, kill_at):
    """Killed mid-epoch with one batch size, re-run with another (the reaction to an out-of-memory
    error): the user is told, and the interrupted epoch trains each of its samples exactly once."""
    name = f"bs-{before}-{after}"
    t = kill_and_resume(root, name, "batchsize", "--every", "3",
                        kill=["--batch-size", str(before), "--kill-at", kill_at],
                        resume=["--batch-size", str(after)])
    epoch, batch, step = t.first_epoch_line(1)
    assert epoch == 1 and 0 < batch, "the kill must land mid-epoch, after a mid-epoch checkpoint"
    warning = f"the batch size is {after} now, {before} in the checkpoint"
    assert t.outputs[1].count(warning) == 1, t.outputs[1][-2000:]
    assert "not bit-identical" in t.outputs[1]
    assert trained_once(t, 1) == Counter(range(SAMPLES)), "samples skipped or repeated"
    assert trained_once(t, 2) == Counter(range(SAMPLES))  # the next epoch: whole, new size
    sizes = {len(e.fields[3].split(",")) for e in t.events("B") if e.session == 1 and int(e.fields[0]) == 2}
    assert max(sizes) == after
    assert t.state()["counters"]["samples"] == EPOCHS * SAMPLES


def test_batch_size_control_without_the_sample_position_skips(root):
    """Negative control: positioned by batch index x the new batch size (as keepalive once did), the
    interrupted epoch repeats samples: the exactly-once check fails."""
    t = kill_and_resume(root, "bs-control", "batchsize", "--every", "3",
                        kill=["--batch-size", "8", "--kill-at", "1:6"],
                        resume=["--batch-size", "4", "--control", "drop-position"])
    assert trained_once(t, 1) != Counter(range(SAMPLES))


def test_batch_size_changed_then_killed_again_in_the_same_epoch(root):
    """4 -> 6 mid-epoch (sample 52 is not a multiple of 6), killed again in the same epoch after a
    save, re-run with 6: the interrupted epoch still trains each sample exactly once."""
    t = Training(root, "bs-twice", "batchsize", "--every", "3")
    t.start("--batch-size", "4", "--kill-at", "1:13", killed=True)
    out = t.start("--batch-size", "6", "--kill-after-batches", "4", killed=True)
    assert "the batch size is 6 now, 4 in the checkpoint" in out
    t.start("--batch-size", "6")
    assert t.first_epoch_line(2)[0] == 1 and t.first_epoch_line(2)[2] > t.first_epoch_line(1)[2]
    assert trained_once(t, 1) == Counter(range(SAMPLES)), "samples skipped or repeated"


# ------------------------------------------------------------------------------ 3. hand saves
@pytest.fixture(scope="module")
def handsave_ref(root):
    """Hand saves do not change the training: one reference for both shapes."""
    return _reference(root, "hand-ref", "handsave", "--hand-save", "inside")


def test_hand_save_inside_the_batch_loop(root, handsave_ref):
    """`ckpt.save()` after `opt.step()` every 4th batch, every="epoch": killed the moment the third
    hand save (epoch 1, after its batch 3) is committed. The checkpoint describes the state it holds
    (4 batches done), so the resume redoes nothing."""
    t = kill_and_resume(root, "hand-inside", "handsave", "--hand-save", "inside",
                        kill=["--kill-after-hand-save", "3"])
    asked = [(int(e.fields[0]), int(e.fields[1])) for e in t.events("HANDSAVE") if e.session == 0]
    by_hand = [(c[1], c[2]) for c in t.commits() if c[0] == 0 and c[4] == "by hand"]
    assert by_hand == [(e, i + 1) for e, i in asked[:3]]  # counters of the batch the save was asked in
    assert t.first_epoch_line(1) == (1, 4, 14)
    assert_same(handsave_ref.state(), t.state())


def test_hand_save_inside_the_batch_loop_control(root, handsave_ref):
    """Negative control: the hand save written at once, with the counters of the running batch
    (as keepalive once did): that batch is trained twice after the resume."""
    t = kill_and_resume(root, "hand-inside-ctl", "handsave", "--hand-save", "inside",
                        "--control", "direct-save", kill=["--kill-after-hand-save", "3"])
    assert t.first_epoch_line(1) == (1, 3, 13)
    assert_differs(handsave_ref.state(), t.state())


def sched_epochs(t: Training, session: int) -> List[int]:
    return [int(e.fields[0]) for e in t.events("SCHED") if e.session == session]


@pytest.mark.parametrize("validation", ["loader", "ckpt.batches"])
def test_hand_save_after_scheduler_step_and_validation(root, handsave_ref, validation):
    """`sched.step()`, validation (over the loader, or `ckpt.batches(val_loader)`), `ckpt.save()` at
    each epoch's end (no other saves): killed the moment epoch 1's hand save is committed. The resume
    starts at epoch 2: epoch 1's scheduler step and validation do not run again."""
    options = ["--val-through-ckpt"] if validation == "ckpt.batches" else []
    ref = handsave_ref
    if options:  # keepalive's loaders leave the global RNG alone (a plain loader draws a seed from
        ref = _reference(root, "hand-ref-ckpt-val", "handsave", *options)  # it): another training
    t = kill_and_resume(root, f"hand-epoch-{validation}", "handsave", "--hand-save", "after-epoch",
                        "--every", "1000", *options, kill=["--kill-after-hand-save", "2"])
    assert [(c[1], c[2], c[4]) for c in t.commits() if c[0] == 0][:2] == [(1, 0, "by hand"), (2, 0, "by hand")]
    assert t.first_epoch_line(1) == (2, 0, 20)
    assert sched_epochs(t, 1) == [2]  # once per epoch: epochs 0 and 1 stepped in the first session
    state = t.state()
    assert state["scheduler"]["last_epoch"] == EPOCHS and state["extras"]["validations"] == EPOCHS
    assert_same(ref.state(), state)


def test_hand_save_after_scheduler_step_control(root, handsave_ref):
    """Negative control: the hand save written at once (counters: epoch 1, all its batches done):
    the resume runs epoch 1's scheduler step and validation a second time."""
    t = kill_and_resume(root, "hand-epoch-ctl", "handsave", "--hand-save", "after-epoch", "--every", "1000",
                        "--control", "direct-save", kill=["--kill-after-hand-save", "2"])
    assert sched_epochs(t, 1)[0] == 1  # stepped again
    assert t.state()["scheduler"]["last_epoch"] == EPOCHS + 1
    assert_differs(handsave_ref.state(), t.state())


# ------------------------------------------------------------------ 4. batch_sampler subset
@pytest.fixture(scope="module")
def subset_ref(root):
    return _reference(root, "subset-ref", "subset", "--every", "3")


def test_batch_sampler_over_a_subset(root, subset_ref):
    """`DataLoader(ds, batch_sampler=BatchSampler(SubsetRandomSampler(idx), 4, False))`: trained on the
    subset only, saved every 3 steps inside epochs too, killed mid-epoch: the resumed epoch replays the
    sampler's own permutation from the saved position, bit-identical."""
    t = kill_and_resume(root, "subset", "subset", "--every", "3", kill=["--kill-at", "1:5"])
    for output in [subset_ref.outputs[0], *t.outputs]:
        assert "checkpoints at epoch ends only" not in output, output[-2000:]
    epoch, batch, step = t.last_commit_before_kill()
    assert epoch == 1 and batch > 0 and step % 3 == 0, f"a save inside the epoch: {(epoch, batch, step)}"
    assert t.first_epoch_line(1) == (epoch, batch, step)
    trained = {int(i) for e in t.events("B") for i in e.fields[3].split(",")}
    assert trained == set(range(0, SAMPLES, 2)), "only the subset's indices may be trained"
    assert_same(subset_ref.state(), t.state())


def test_batch_sampler_over_a_subset_control(root, subset_ref):
    """Negative control: the same kill, the resumed epoch's loader iterated from the random state of
    now instead of the one its iter() had: another permutation, another result."""
    t = kill_and_resume(root, "subset-ctl", "subset", "--every", "3", "--control", "no-replay",
                        kill=["--kill-at", "1:5"])
    assert_differs(subset_ref.state(), t.state())


# ------------------------------------------------------------------------ 5. epoch prologue
@pytest.fixture(scope="module")
def prologue_ref(root):
    return _reference(root, "prologue-ref", "prologue", "--every", "2")


def prologue_of(t: Training, session: int, epoch: int) -> List[str]:
    return next(e.fields[1:] for e in t.events("PROLOGUE") if e.session == session and int(e.fields[0]) == epoch)


def test_random_draws_between_for_epoch_and_for_batch(root, prologue_ref):
    """Per epoch: `torch.randperm(...)[:k]` picks the classes weighted in the loss, `np.random.beta`
    the mixup lambda, `random.uniform` the label smoothing. Killed mid-epoch: the resumed epoch's
    prologue draws the same values, and the run ends bit-identical."""
    t = kill_and_resume(root, "prologue", "prologue", "--every", "2", kill=["--kill-at", "1:5"])
    assert t.first_epoch_line(1) == (1, 4, 14)
    assert prologue_of(t, 1, 1) == prologue_of(prologue_ref, 0, 1) == prologue_of(t, 0, 1)
    assert_same(prologue_ref.state(), t.state())


def test_random_draws_between_for_epoch_and_for_batch_control(root, prologue_ref):
    """Negative control: the prologue replayed with the mid-epoch RNG state draws other values."""
    t = kill_and_resume(root, "prologue-ctl", "prologue", "--every", "2", "--control", "no-prologue-replay",
                        kill=["--kill-at", "1:5"])
    assert prologue_of(t, 1, 1) != prologue_of(prologue_ref, 0, 1)
    assert_differs(prologue_ref.state(), t.state())


@pytest.fixture(scope="module")
def cosine_ref(root):
    return _reference(root, "cosine-ref", "cosine", "--every", "3")


def test_enumerate_with_cosine_warm_restarts(root, cosine_ref):
    """`for i, (x, y) in ckpt.enumerate(loader)` with `sched.step(epoch + i / iters)` (PyTorch docs'
    CosineAnnealingWarmRestarts pattern), killed mid-epoch: i continues at the true batch index."""
    t = kill_and_resume(root, "cosine", "cosine", "--every", "3", kill=["--kill-at", "1:5"])
    epoch, batch, _ = t.first_epoch_line(1)
    assert epoch == 1 and batch > 0
    first = next(e for e in t.events("B") if e.session == 1)
    assert int(first.fields[1]) == batch
    assert_same(cosine_ref.state(), t.state())


def test_enumerate_with_cosine_warm_restarts_control(root, cosine_ref):
    """Negative control: `enumerate(ckpt.batches(loader))` restarts i at 0 in the resumed epoch."""
    t = kill_and_resume(root, "cosine-ctl", "cosine", "--every", "3", "--control", "plain-enumerate",
                        kill=["--kill-at", "1:5"])
    assert_differs(cosine_ref.state(), t.state())


# ------------------------------------------------------------------------- 6. private RNGs
def test_private_generators_registered(root):
    """`DriveCheckpoint(..., aug_rng=np.random.default_rng(0), gen=torch.Generator().manual_seed(1))`
    used for augmentation in the loop, killed mid-epoch: bit-identical (the generators' states too).
    Negative control: the same script without registering them trains the same uninterrupted, but
    differs after the same kill."""
    ref = _reference(root, "private-ref", "private", "--every", "3")
    t = kill_and_resume(root, "private", "private", "--every", "3", kill=["--kill-at", "1:5"])
    assert t.first_epoch_line(1) == (1, 5, 15)
    assert_same(ref.state(), t.state())

    unregistered_ref = _reference(root, "private-unreg-ref", "private", "--every", "3", "--control", "no-register")
    assert_same(ref.state(), unregistered_ref.state())
    control = kill_and_resume(root, "private-ctl", "private", "--every", "3", "--control", "no-register",
                              kill=["--kill-at", "1:5"])
    assert_differs(ref.state(), control.state())


# ------------------------------------------------------------------------ 7. K-fold, no path
def test_kfold_without_a_path(root):
    """`for fold in range(3): ckpt = DriveCheckpoint(model=..., optimizer=...)` with KEEPALIVE_DIR set
    and no path: one run per fold (default, default-2, default-3). Killed during the second fold; the
    re-run finds fold 1 complete, resumes fold 2, trains fold 3: every fold's final state equals the
    uninterrupted run's. Negative control: all folds in one run."""
    def kfold(name: str, *options: str) -> Training:
        home = root / f"{name}-home"
        env = dict(os.environ, KEEPALIVE_DIR=str(home))
        return Training(root, name, "kfold", "--every", "3", "--epochs", "2", *options, env=env,
                        with_path=False)

    ref = kfold("kfold-ref")
    ref.start()
    t = kfold("kfold")
    t.start("--kill-at", "1:1:3", killed=True)
    assert [int(e.fields[0]) for e in t.events("FOLD")] == [0, 1]
    t.start()
    home = root / "kfold-home"
    runs = sorted(d for d in os.listdir(home) if (home / d).is_dir())
    assert runs == ["default", "default-2", "default-3"], runs
    for run in runs:
        assert any(n.startswith("ckpt-") for n in os.listdir(home / run)), run
    assert "already completed" in t.outputs[1]
    assert "resuming run 'default-2'" in t.outputs[1]
    assert "run 'default-2'" in t.outputs[0]  # the one-time word about unnamed runs
    for fold in range(3):
        assert_same(ref.state(f".fold{fold}"), t.state(f".fold{fold}"))

    control = kfold("kfold-ctl", "--control", "same-run")
    control.start()
    assert_same(ref.state(".fold0"), control.state(".fold0"))
    assert_differs(ref.state(".fold1"), control.state(".fold1"))

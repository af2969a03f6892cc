"""Loops whose optimizer steps are not one per ``ckpt.batches()`` batch, killed (SIGKILL) mid-run.

``ckpt.step`` must be the number of optimizer steps, ``every=N`` must save every N of them,
``every="2s"`` every two seconds, ``every="epoch"`` at every epoch's end, whatever the loop looks like:

1. two shuffled loaders of different lengths zipped, one step per pair (semi-supervised);
2. nanoGPT's ``for it in ckpt.epochs(max_iters): x, y = get_batch('train')``, no DataLoader;
3. manual ``torch.randperm`` batching inside ``ckpt.epochs()``, no DataLoader.

Each scenario trains a tiny real model (dropout, random augmentation or random batch offsets) in a
child process (tests/scripts/step_loops.py); an uninterrupted run is the reference (what it saved,
where, and its final state). The crash tests kill the child in the middle of a step (gradients
pending) right after the newest checkpoint is committed, run the same script again, and compare
the final model, optimizer and scheduler states, the counters and the extras with the reference's,
tensor for tensor with ``torch.equal``, and the data each step trained on, step for step.

The script counts its optimizer steps itself (``ckpt.extras["opt_steps"]``, saved with each
checkpoint): that count, not ``ckpt.step``, says where a checkpoint and a resume really are.

Every crash test has a negative control: the same kill with the resumed session perturbed from the
outside (``--control``: the second loader one batch off its position, or the global RNGs not
restored) must give a different result, so no test here passes whatever keepalive does.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from crashkit import assert_differs, assert_same
from forkserver import script_children_fixture
from keepalive import CheckpointStore

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "step_loops.py")
#: what step_loops.py imports before keepalive: its 17 children fork from a server that has imported it
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data"]

# tests/scripts/step_loops.py's sizes
ZIP_EPOCHS, ZIP_STEPS_PER_EPOCH, ZIP_EVERY = 3, 6, 4  # labeled: 48 samples / 8, unlabeled: 100 / 10
ZIP_STEPS = ZIP_EPOCHS * ZIP_STEPS_PER_EPOCH
MAX_ITERS, ITERS_EVERY = 200, 25
PERM_EPOCHS, PERM_STEPS_PER_EPOCH = 5, 8               # 64 samples / 8

pytestmark = pytest.mark.slow  # ~17 short training processes


# ------------------------------------------------------------------------------------- helpers
forked_children = script_children_fixture(SCRIPT, "torch", PRELOAD, sys.modules[__name__])


@dataclass
class Event:
    session: int  # 0 for the first process that trained this run, 1 for the next, ...
    kind: str
    fields: List[str]


@dataclass
class Saved:
    """One committed checkpoint: keepalive's counters in it and the script's own step count."""
    step: int          # keepalive's step (the folder's)
    epoch: int
    batch: int
    opt_steps: int     # optimizer steps the state in it really holds
    reason: str
    created: float


class Training:
    """One run of step_loops.py: its run folder, log and final-state file; started until done."""

    def __init__(self, root, name: str, scenario: str, *options: str):
        self.name = name
        self.run_dir = root / name
        self.log = root / f"{name}.log"
        self.out = root / f"{name}.pt"
        self.base = [sys.executable, SCRIPT, "--scenario", scenario, "--run", str(self.run_dir),
                     "--out", str(self.out), "--log", str(self.log), *options]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.outputs: List[str] = []

    def start(self, *extra: str, killed: bool = False) -> str:
        """Run the script once; ``killed``: it must end by the SIGKILL it was told to send itself."""
        proc = subprocess.run([*self.base, *extra], capture_output=True, text=True, env=self.env, timeout=240)
        output = proc.stdout + proc.stderr
        self.outputs.append(output)
        if killed:
            assert proc.returncode == -signal.SIGKILL, f"{self.name}: not killed ({proc.returncode}):\n{output[-3000:]}"
            assert self.events("KILL"), f"{self.name}: killed, but not where it was told to"
        else:
            assert proc.returncode == 0 and "DONE" in proc.stdout, \
                f"{self.name} failed ({proc.returncode}):\n{output[-3000:]}"
        return output

    def state(self) -> Dict[str, Any]:
        return torch.load(self.out, weights_only=False)

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

    def saved(self) -> List[Saved]:
        """The committed checkpoints in the run folder, oldest first (keep=None: all of them)."""
        out = []
        for info in CheckpointStore(str(self.run_dir)).list():
            state = json.loads((self.run_dir / info.name / "state.json").read_text())
            c = state["counters"]
            out.append(Saved(info.step, c["epoch"], c["batch"], state["extras"].get("opt_steps", 0),
                             ((info.manifest or {}).get("metadata") or {}).get("reason", "?"),
                             float(info.created or 0.0)))
        return out

    def resumed_at(self, session: int) -> Tuple[int, int]:
        """(epoch, the script's optimizer steps) where the session's first epoch began."""
        e = next(e for e in self.events("START") if e.session == session)
        return int(e.fields[0]), int(e.fields[1])

    def trained(self) -> List[Tuple[str, ...]]:
        """The data of every optimizer step in the run's surviving history, in order: each session's
        steps up to where the next session resumed, then the last session's."""
        sessions = 1 + max(e.session for e in self.events())
        keep = {s: self.resumed_at(s + 1)[1] for s in range(sessions - 1)}
        out = []
        for e in self.events("B"):
            n = int(e.fields[0])
            if e.session == sessions - 1 or n <= keep[e.session]:
                out.append((e.fields[0], *e.fields[2:]))  # the step number and its data, not ckpt.step
        return out


def killed_run(root, name: str, scenario: str, *options: str, kill_after: int) -> Tuple[Training, List[Saved]]:
    """The first session, killed in its (kill_after + 1)-th optimizer step once the newest save is
    committed; returns the run and the checkpoints committed before the kill."""
    t = Training(root, name, scenario, *options)
    t.start("--kill-after-steps", str(kill_after), killed=True)
    assert int(t.events("KILL")[0].fields[0]) == kill_after
    return t, t.saved()


def newest(before: List[Saved]) -> Saved:
    assert before, "no checkpoint was committed before the kill"
    return before[-1]


def saves(t: Training) -> List[Tuple[int, int]]:
    """(keepalive's step, the optimizer steps it holds) of each checkpoint: equal when steps are
    counted right."""
    return [(s.step, s.opt_steps) for s in t.saved()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("steps")


def _reference(root, name: str, scenario: str, *options: str) -> Training:
    t = Training(root, name, scenario, *options)
    t.start()
    assert not t.events("KILL")
    return t


# ---------------------------------------------------------------------------- 1. zipped loaders
@pytest.fixture(scope="module")
def zip_ref(root):
    return _reference(root, "zip-ref", "zip", "--every", str(ZIP_EVERY))


def test_zip_two_loaders_counts_one_step_per_pair(zip_ref):
    """`zip(ckpt.batches(labeled), ckpt.batches(unlabeled))`, one optimizer step per pair, every=4:
    ckpt.step is the number of optimizer steps (18, not one per batch of either loader), and the
    checkpoints hold 4, 8, 12, 16 optimizer steps (and 18: the end)."""
    state = zip_ref.state()
    assert state["extras"]["opt_steps"] == ZIP_STEPS
    assert state["counters"]["step"] == ZIP_STEPS, f"ckpt.step {state['counters']['step']} after {ZIP_STEPS} steps"
    assert state["counters"]["epoch"] == ZIP_EPOCHS
    expected = [*range(ZIP_EVERY, ZIP_STEPS, ZIP_EVERY), ZIP_STEPS]
    assert saves(zip_ref) == [(n, n) for n in expected]


def zip_kill(root, name: str, *resume: str) -> Tuple[Training, Saved]:
    """Killed in epoch 1's fifth step (step 11: gradients pending), after the every=4 save of step 8
    (epoch 1, 2 of 6 pairs done: each loader mid-epoch, at its own sample position) was committed."""
    t, before = killed_run(root, name, "zip", "--every", str(ZIP_EVERY), kill_after=10)
    t.start(*resume)
    return t, newest(before)


def test_zip_two_loaders_killed_mid_epoch_resumes_each_at_its_position(root, zip_ref):
    t, last = zip_kill(root, "zip")
    assert (last.step, last.opt_steps) == (8, 8), f"newest checkpoint before the kill: {last}"
    assert t.resumed_at(1) == (1, 8)
    assert f"resuming run '{t.name}'" in t.outputs[1]
    assert t.trained() == zip_ref.trained(), "the labeled / unlabeled batches of some steps differ"
    assert_same(zip_ref.state(), t.state())


def test_zip_two_loaders_control_second_loader_one_batch_late(root, zip_ref):
    """Negative control: the same kill, the resumed epoch's unlabeled stream one batch past its saved
    position (the labeled one where it was): other batches, another final state."""
    t, _ = zip_kill(root, "zip-ctl", "--control", "unlabeled-late")
    epoch, done = t.resumed_at(1)
    assert done % ZIP_STEPS_PER_EPOCH, f"the resume must land inside an epoch (epoch {epoch}, step {done})"
    assert t.trained() != zip_ref.trained()
    assert_differs(zip_ref.state(), t.state())


# ----------------------------------------------------------------------- 2. nanoGPT iterations
@pytest.fixture(scope="module")
def iters_ref(root):
    """Uninterrupted, every=25; the save schedule (and the sleep) changes nothing in the training: the
    reference for the time-based saves too."""
    return _reference(root, "iters-ref", "iters", "--every", str(ITERS_EVERY))


def test_iterations_without_a_loader_count_and_save_every_25_steps(iters_ref):
    """`for it in ckpt.epochs(200)` with `get_batch()`, one optimizer step per iteration: ckpt.step is
    200 and the checkpoints hold 25, 50, ..., 200 optimizer steps."""
    state = iters_ref.state()
    assert state["extras"]["opt_steps"] == MAX_ITERS
    assert state["counters"]["step"] == MAX_ITERS, f"ckpt.step {state['counters']['step']} after {MAX_ITERS} steps"
    assert saves(iters_ref) == [(n, n) for n in range(ITERS_EVERY, MAX_ITERS + 1, ITERS_EVERY)]


def test_iterations_every_25_killed_resumes_at_the_last_save(root, iters_ref):
    """Killed in iteration it=135 (gradients pending), the save of step 125 committed: the re-run starts at
    `it` = 125 (not 0) and ends bit-identical: same random offsets, dropout masks, learning rates."""
    t, before = killed_run(root, "iters-25", "iters", "--every", str(ITERS_EVERY), kill_after=135)
    assert [(s.step, s.opt_steps) for s in before] == [(n, n) for n in range(25, 126, 25)], before
    t.start()
    assert t.resumed_at(1) == (125, 125)
    assert t.trained() == iters_ref.trained()
    assert_same(iters_ref.state(), t.state())


def test_iterations_every_2s_killed_resumes_at_the_last_time_based_save(root, iters_ref):
    """every="2s", 30 ms per iteration, killed in iteration it=160 (>= 4.8 s of training): at least two
    time-based saves are committed by then, inside the run; the re-run continues at the newest."""
    t, before = killed_run(root, "iters-2s", "iters", "--every", "2s", "--sleep", "0.03", kill_after=160)
    assert len(before) >= 2, f"time-based saves committed before the kill (after 160 of 200 steps): {before}"
    assert all(s.step == s.opt_steps and 0 < s.step <= 160 for s in before), before
    gaps = [b.created - a.created for a, b in zip(before, before[1:])]
    assert all(g > 1.0 for g in gaps), f"saves {gaps} s apart with every='2s'"
    t.start()
    assert t.resumed_at(1) == (before[-1].opt_steps, before[-1].opt_steps)
    assert t.trained() == iters_ref.trained()
    assert_same(iters_ref.state(), t.state())


def test_iterations_control_without_the_random_state(root, iters_ref):
    """Negative control: the same every=25 kill, the resumed session re-seeding the global RNGs as the
    script's start did (what a resume that does not restore them gives): other offsets, other masks."""
    t, _ = killed_run(root, "iters-ctl", "iters", "--every", str(ITERS_EVERY), kill_after=135)
    t.start("--control", "reseed-on-resume")
    assert t.resumed_at(1)[1] > 0, "the control needs a resume from a checkpoint inside the run"
    assert t.trained() != iters_ref.trained()
    assert_differs(iters_ref.state(), t.state())


# ------------------------------------------------------------------ 3. randperm inside epochs()
@pytest.fixture(scope="module")
def perm_ref(root):
    return _reference(root, "perm-ref", "randperm", "--every", "epoch")


def test_randperm_batches_save_every_epoch(perm_ref):
    """`perm = torch.randperm(N)`, `for i in range(0, N, B)` inside `ckpt.epochs(5)`, every="epoch": a
    checkpoint at each epoch's end, holding that epoch's 8 optimizer steps; ckpt.step is 40."""
    state = perm_ref.state()
    assert state["extras"]["opt_steps"] == PERM_EPOCHS * PERM_STEPS_PER_EPOCH
    assert state["counters"]["step"] == PERM_EPOCHS * PERM_STEPS_PER_EPOCH, state["counters"]
    assert [(s.epoch, s.batch, s.step, s.opt_steps) for s in perm_ref.saved()] == \
        [(e, 0, e * PERM_STEPS_PER_EPOCH, e * PERM_STEPS_PER_EPOCH) for e in range(1, PERM_EPOCHS + 1)]


def perm_kill(root, name: str, *resume: str) -> Tuple[Training, Saved]:
    """Killed in the third epoch (epoch 2 as ckpt.epochs yields it) after 3 of its 8 steps, gradients
    pending, the checkpoint of 2 completed epochs (16 steps) committed."""
    t, before = killed_run(root, name, "randperm", "--every", "epoch", kill_after=2 * PERM_STEPS_PER_EPOCH + 3)
    t.start(*resume)
    return t, newest(before)


def test_randperm_batches_killed_in_the_third_epoch_resume_at_its_start(root, perm_ref):
    t, last = perm_kill(root, "perm")
    assert (last.epoch, last.batch, last.step, last.opt_steps) == (2, 0, 16, 16), \
        f"newest checkpoint before the kill: {last}"
    assert t.resumed_at(1) == (2, 16)
    assert "at the end of epoch 1, step 16" in t.outputs[1]
    assert t.trained() == perm_ref.trained()
    assert_same(perm_ref.state(), t.state())


def test_randperm_batches_control_without_the_random_state(root, perm_ref):
    """Negative control: the same kill, the resumed session re-seeding the global RNGs: the resumed
    epoch's permutation and noise differ."""
    t, _ = perm_kill(root, "perm-ctl", "--control", "reseed-on-resume")
    assert t.resumed_at(1)[1] > 0, "the control needs a resume from a checkpoint inside the run"
    assert t.trained() != perm_ref.trained()
    assert_differs(perm_ref.state(), t.state())

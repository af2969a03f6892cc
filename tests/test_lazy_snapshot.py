"""Lazy snapshots: a save copies parameters and optimizer state in the background while the loop runs
its next forward and backward; the next optimizer step waits for what is not copied yet.

Each test trains a real torch model in this process, keeps a clone of the whole state at every step
boundary, and compares each committed checkpoint with the clone of its step, tensor by tensor: a
checkpoint that holds one new value among old ones fails. The races that could tear a snapshot (a
weight changed in place before its copy) are forced, not waited for: the background copy is held
until the loop has made its change. Controls: the same race with the version check switched off
commits a torn checkpoint, which the comparison catches; the kill test's control commits a buffer
the copy never filled.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from crashkit import run_to_completion
from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.state import PendingCopy
from lazykit import CHANGED, RELEASE, checkpoints, held_copy, hold_next_copy  # noqa: F401 - a fixture
from lazykit import clone as _clone
from lazykit import differences as _differences

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torch_train.py")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=200)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(160, 32, generator=g), torch.randint(0, 4, (160,), generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    return model, opt, sched, loader








def _train(run: str, *, epochs: int = 2, every: Any = 3, change_at: Optional[int] = None,
           ema: bool = False, accum: int = 1, **options: Any) -> Dict[str, Any]:
    """Train with keepalive; returns the state clones per step boundary, the steps whose save was
    deferred, and the deferred bytes seen."""
    model, opt, sched, loader = _setup()
    objects: Dict[str, Any] = dict(model=model, optimizer=opt, scheduler=sched)
    shadow = None
    if ema:
        shadow = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        objects["ema"] = shadow
    ckpt = DriveCheckpoint(run, every=every, keep=None, quiet=True, **objects, **options)
    boundaries: Dict[int, Any] = {}
    before_change: Dict[int, Any] = {}
    deferred: List[int] = []
    for _ in ckpt.epochs(epochs):
        model.train()
        for i, (x, y) in ckpt.enumerate(loader):
            pending = ckpt.core.writer._pending
            if pending is not None and ckpt.step not in deferred:
                deferred.append(ckpt.step)
            if i % accum == 0:  # a consistent boundary (no gradients pending): what a save there holds
                boundaries[ckpt.step] = _clone({k: v.state_dict() for k, v in objects.items()})
            if change_at is not None and ckpt.step == change_at - 1:
                hold_next_copy()  # the copy of the save at the next boundary waits for the change below
            if change_at is not None and ckpt.step == change_at and pending is not None:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)  # a hand-made change before the next step
                before_change[ckpt.step] = boundaries[ckpt.step]
                boundaries[ckpt.step] = None  # the state of this boundary is gone now
                RELEASE.set()
            (F.cross_entropy(model(x), y) / accum).backward()
            if (i + 1) % accum == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad()
                sched.step()
                if shadow is not None:
                    shadow.update_parameters(model)  # an EMA, in place, right after the step
    boundaries.setdefault(ckpt.step, _clone({k: v.state_dict() for k, v in objects.items()}))  # the last save
    ckpt.close()
    return dict(boundaries=boundaries, deferred=deferred, core=ckpt.core, before_change=before_change)


def _saved(run: str) -> Dict[int, Any]:
    return {step: tree["objects"] for step, tree in checkpoints(run).items()}


def _assert_each_save_is_its_step(found: Dict[str, Any], run: str, skip=()) -> Dict[int, Any]:
    saved = _saved(run)
    assert saved
    for step, objects in saved.items():
        if step in skip:
            continue
        expected = found["boundaries"].get(step)
        assert expected is not None, f"step {step} was saved, but its state was changed before the save"
        diff = _differences(expected, objects)
        assert not diff, f"the checkpoint of step {step} is not the state of step {step}: {diff[:5]}"
    return saved


def test_each_lazy_save_holds_exactly_the_state_of_its_step(tmp_path, capsys):
    found = _train(str(tmp_path / "run"), every=3)
    assert len(found["deferred"]) >= 4, "no save copied lazily"
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert {s for s in found["deferred"] if s} <= set(saved)
    assert CHANGED not in capsys.readouterr().err


def test_blocking_copies_everything_at_once(tmp_path):
    found = _train(str(tmp_path / "run"), every=3, snapshot="blocking")
    assert found["deferred"] == []
    _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    with pytest.raises(ValueError, match="snapshot='eager'"):
        DriveCheckpoint(str(tmp_path / "bad"), model=torch.nn.Linear(1, 1), snapshot="eager")


@pytest.mark.usefixtures("held_copy")
def test_a_weight_changed_before_its_copy_is_said_once_and_saved_again(tmp_path, capsys):
    """A hand-made in-place change of a parameter between a save and the next optimizer step, with
    the copy held until after it: the version check drops that save (said once), the next step
    boundary saves again, and that parameter is copied at once from then on."""
    found = _train(str(tmp_path / "run"), every=3, change_at=6)
    err = capsys.readouterr().err
    assert err.count(CHANGED) == 1, err
    assert "0.weight changed in place before its snapshot was copied" in err
    assert "the save of step 6 is made again at the next step boundary" in err
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert 6 not in saved and 7 in saved  # dropped, made again one step later
    assert "objects.model.0.weight" in found["core"].snapshots.copy_at_once or any(
        k.endswith("0.weight") for k in found["core"].snapshots.copy_at_once)


@pytest.mark.usefixtures("held_copy")
def test_control_without_the_version_check_the_torn_save_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(PendingCopy, "changed", lambda self: [])
    found = _train(str(tmp_path / "run"), every=3, change_at=6)
    saved = _saved(str(tmp_path / "run"))
    assert 6 in saved  # committed: its weight is the changed one, the rest is step 6's
    assert _differences(found["before_change"][6], saved[6]) == [".model.0.weight"]


def test_ema_updated_in_place_after_each_step_is_exact(tmp_path, capsys):
    """An EMA (torch's AveragedModel) updated in place right after optimizer.step(): its tensors are
    no optimizer's, so they are copied at the save itself; the parameters the background copies are
    changed only by the next step, which waits for the copy."""
    found = _train(str(tmp_path / "run"), every=2, ema=True)
    assert found["deferred"]
    _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert CHANGED not in capsys.readouterr().err


def test_gradient_accumulation_over_four_micro_batches(tmp_path, capsys):
    """A step every 4 batches: the copy overlaps four forwards and backwards, and the step that ends
    them waits for it; saves land only where no gradient is pending."""
    found = _train(str(tmp_path / "run"), epochs=2, every=1, accum=4)
    assert found["deferred"]
    _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert CHANGED not in capsys.readouterr().err


# ------------------------------------------------------------------------ a kill during the copy
EPOCHS, SAMPLES, ACCUM = 2, 320, 4
BATCHES = -(-SAMPLES // 16)
STEPS = EPOCHS * -(-BATCHES // ACCUM)  # 5 optimizer steps per epoch


def _cmd(run, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", f"{run}.st", "--epochs", str(EPOCHS), "--samples",
            str(SAMPLES), "--every", "4", "--hidden", "512", "--accum", str(ACCUM), *extra]


def _kill_at(cmd: List[str], prefix: str) -> str:
    """Run the child until it prints a line starting with ``prefix``, SIGKILL it there."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: List[str] = []
    try:
        while True:
            line = lines.get(timeout=120)
            if line is None:
                raise AssertionError(f"the child ended before {prefix!r}:\n" + "".join(seen[-30:]))
            seen.append(line)
            if line.startswith(prefix):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(seen)


def _differing(a, b) -> List[str]:
    wa, wb = load_file(a), load_file(b)
    return [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.mark.parametrize("broken", [False, True], ids=["lazy", "control_copy_skipped"])
def test_kill_during_the_lazy_copy_resumes_exactly(tmp_path, broken):
    """SIGKILL while the background copy of a save runs (gradient accumulation over 4 micro-batches:
    the copy overlaps them; the child holds it 2 s so the kill lands inside it): that save was never
    committed, the resume starts from the one before, and the result is bit-identical to a run
    without interruption. Control: a child whose background copy copies nothing commits the buffer
    as the previous save left it; killed after that commit, its resume differs."""
    ref = run_to_completion(_cmd(tmp_path / "ref"), total_steps=STEPS, kills=0, rng=random.Random(0))
    assert "DONE" in ref.final_output
    crash = tmp_path / "crash"
    if broken:
        first = _kill_at(_cmd(crash, "--skip-lazy-copy"), "COMMITTED 8")
    else:
        first = _kill_at(_cmd(crash, "--hold-lazy-copy", "2"), "LAZY_COPY 8")
        assert "COMMITTED 4" in first and "COMMITTED 8" not in first, first[-2000:]
    resumed = run_to_completion(_cmd(crash, *(["--skip-lazy-copy"] if broken else [])), total_steps=STEPS,
                                kills=0, rng=random.Random(0))
    assert "DONE" in resumed.final_output
    differ = _differing(f"{tmp_path / 'ref'}.st", f"{crash}.st")
    if broken:
        assert resumed.trials[0].resumed_step == 8
        assert differ, "the control's unfilled checkpoint went unnoticed: this test cannot fail"
        return
    assert resumed.trials[0].resumed_step == 4, resumed.final_output[-2000:]
    assert not differ, f"differs from the uninterrupted run: {differ}"


@pytest.mark.parametrize("settled", [True, False], ids=["settled_at_epoch_end", "control_not_settled"])
def test_weights_swapped_in_through_data_after_an_epoch_end_are_not_in_its_save(tmp_path, monkeypatch, settled):
    """`for epoch in range(n)` around `ckpt.batches(loader)`: the epoch's end is saved when the loader
    runs out, and the epoch's own code runs next, here an evaluation with averaged weights swapped in
    through `p.data` (which moves no version counter, so no check could see it). The save's copy is
    finished before that code runs. Control: left running (the copy held while the weights are
    swapped in), the checkpoint holds the swapped weights, and the comparison catches it."""
    original = PendingCopy.run

    def slow(self):
        import time

        time.sleep(0.2)
        original(self)

    monkeypatch.setattr(PendingCopy, "run", slow)
    if not settled:
        from keepalive.core import Checkpointer

        monkeypatch.setattr(Checkpointer, "settle_snapshot", lambda self: None)
    model, opt, _, loader = _setup()
    ckpt = DriveCheckpoint(str(tmp_path / "run"), model=model, optimizer=opt, keep=None, quiet=True)
    at_end: Dict[int, Any] = {}
    for _ in range(2):
        model.train()
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        at_end[ckpt.step] = _clone({"model": model.state_dict(), "optimizer": opt.state_dict()})
        pending = ckpt.core.writer._pending
        backup = [p.data.clone() for p in model.parameters()]
        for p in model.parameters():
            p.data.fill_(0.125)  # "EMA weights" for the evaluation
        if pending is not None:
            pending.wait()  # (only the control gets here: the copy ran while they were swapped in)
        with torch.no_grad():
            model.eval()
            model(torch.randn(4, 32))
        for p, b in zip(model.parameters(), backup):
            p.data.copy_(b)
    ckpt.close()
    saved = _saved(str(tmp_path / "run"))
    assert set(saved) == set(at_end)
    torn = {step: _differences(at_end[step], saved[step]) for step in saved}
    if settled:
        assert not any(torn.values()), torn
    else:
        assert any(torn.values()), "the control's torn checkpoint went unnoticed: this test cannot fail"

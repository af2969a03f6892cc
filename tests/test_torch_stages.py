"""The torch adapter and what the loop's code keeps outside the registered objects: several stages on
one ``ckpt`` (an optimizer registered after the resume), ``requires_grad`` flags set in the loop, the
plan (epochs, a scheduler's settings) changed between sessions, a ``break`` out of ``ckpt.epochs()``,
``enumerate(ckpt.batches())`` in a resumed epoch, a re-run of the loop in the same process after
Ctrl-C, a checkpoint of the first optimizer step, ``torch.compile`` toggled between sessions.

Each resume is compared with an uninterrupted run (tensor for tensor), or the message the user reads
is asserted word for word; each has a negative control (the piece of keepalive switched off, or the
case where nothing is to be said), so that no test passes whatever keepalive does. The SIGKILL cases
run tests/scripts/torch_stages.py in child processes."""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from crashkit import assert_differs, assert_same
from forkserver import script_children_fixture
from keepalive import StateMismatchError
from keepalive.callbacks import _torch_objects as ka_torch_objects
from keepalive.callbacks.torch import DriveCheckpoint

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torch_stages.py")
#: the children fork from a server that has imported torch (tests/forkserver.py): most of a child's CPU
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data"]


forked_children = script_children_fixture(SCRIPT, "torch", PRELOAD, sys.modules[__name__])
N, BATCH = 40, 8
PER_EPOCH = N // BATCH


def data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def make(seed=0, lr=0.1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Killed(Exception):
    """Stands for a kill in in-process tests: leaves the loop by an exception (not a break)."""


# ------------------------------------------------------------------ SIGKILL: stages, first step
def _child(tmp_path, name, *extra, killed=False):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "scripts") + os.pathsep
               + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1", KEEPALIVE_PROGRESS="0")
    proc = subprocess.run([sys.executable, SCRIPT, "--run", str(tmp_path / name), "--out",
                           str(tmp_path / f"{name}.pt"), *extra], capture_output=True, text=True,
                          env=env, timeout=180)
    out = proc.stdout + proc.stderr
    if killed:
        assert proc.returncode == -signal.SIGKILL and "KILL" in proc.stdout, out
    else:
        assert proc.returncode == 0 and "DONE" in proc.stdout, out
    return out


def _state(tmp_path, name):
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def test_stages_killed_in_stage_two_resume_bit_exact_with_controls(tmp_path):
    """Stage 1 trains the head (backbone frozen) with SGD; stage 2 registers an Adam after the resume
    and unfreezes the backbone inside its loop at epoch 3; SIGKILL in epoch 4. The re-run restores
    Adam at its register() and the backbone's requires_grad: bit-identical to the same training
    without keepalive. Controls: either piece switched off gives another model."""
    _child(tmp_path, "plain", "--plain")
    _child(tmp_path, "ref")
    assert_same(_state(tmp_path, "plain"), _state(tmp_path, "ref"))  # transparent
    _child(tmp_path, "run", "--kill-at", "4:3", killed=True)
    for control in ("late", "frozen"):  # the controls resume the same killed run
        shutil.copytree(tmp_path / "run", tmp_path / control)
    out = _child(tmp_path, "run")
    assert "opt2: registered after the resume; its state is restored from the checkpoint" in out
    assert "model: requires_grad of 2 parameter(s) set as saved" in out
    assert "ckpt.epochs(2): run 'run' is past this loop (4 epochs completed, saved in a later loop " \
           "of the run): skipped" in out
    assert_same(_state(tmp_path, "ref"), _state(tmp_path, "run"))
    for control in ("late", "frozen"):
        _child(tmp_path, control, "--control", control)
        assert_differs(_state(tmp_path, "ref"), _state(tmp_path, control))


def test_first_step_checkpoint_resumes_bit_exact_with_control(tmp_path):
    """every=1 and a SIGKILL right after the first optimizer step's checkpoint is durable: the resume
    continues after that step (no extra step). Control: that checkpoint without the training loader's
    position replays the epoch from sample 0 and differs."""
    _child(tmp_path, "ref", "--scenario", "first")
    _child(tmp_path, "run", "--scenario", "first", "--kill-at", "0:1", killed=True)
    out = _child(tmp_path, "run", "--scenario", "first")
    assert "step 1," in out
    assert_same(_state(tmp_path, "ref"), _state(tmp_path, "run"))
    _child(tmp_path, "control", "--scenario", "first", "--kill-at", "0:1", "--control", "first", killed=True)
    _child(tmp_path, "control", "--scenario", "first", "--control", "first")
    assert_differs(_state(tmp_path, "ref"), _state(tmp_path, "control"))


# ------------------------------------------------------------------- stages in one process
def test_optimizer_registered_after_the_resume_is_restored_and_a_newer_one_is_not(tmp_path):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)

    def run(path, kill=False):
        model, opt = make()
        ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
        for _ in ckpt.epochs(1):
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
        opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
        ckpt.register("opt2", opt2)
        try:
            for epoch in ckpt.epochs(3):
                for x, y in ckpt.batches(loader):
                    step(model, opt2, x, y)
                if kill and epoch == 1:
                    raise Killed
        except Killed:
            ckpt.close()
            return None, None
        ckpt.close()
        return weights(model), opt2.state_dict()

    ref, ref_opt2 = run(tmp_path / "ref")
    run(tmp_path / "run", kill=True)
    resumed, opt2 = run(tmp_path / "run")
    assert_same(ref, resumed)
    assert_same(ref_opt2["state"], opt2["state"])


def test_a_saved_object_never_registered_is_told_once(tmp_path, capsys):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    aux = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, aux=aux, quiet=True)
    for _ in ckpt.epochs(1):
        for x, y in ckpt.batches(loader):
            step(model, opt, x, y)
    ckpt.close()
    capsys.readouterr()
    model2, opt2 = make()
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    for _ in again.epochs(2):
        for x, y in again.batches(loader):
            step(model2, opt2, x, y)
    again.close()
    err = capsys.readouterr().err
    text = ("the checkpoint resumed from holds ['aux'], which this run has not registered: its state is "
            "not restored, and this checkpoint lacks it. Register it before the loop that uses it "
            "(ckpt.register('aux', ...)).")
    assert err.count(text) == 1, err


def test_a_new_checkpointer_of_the_same_model_after_its_loop_ended_is_told_it_is_no_stage(tmp_path, capsys):
    """One DriveCheckpoint per stage on one path (as one callback per fit): the second resumes the run,
    so its stage would not train as written: said before anything is loaded. Control: a new model on the
    path (a new session simulated in this process) is a resume and is not told."""
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    first = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    for _ in first.epochs(1):
        for x, y in first.batches(loader):
            step(model, opt, x, y)
    first.close()
    model2, opt2 = make()
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    assert again.resume()
    again.close()
    assert "does not start a further stage" not in capsys.readouterr().err
    stage2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=torch.optim.Adam(model.parameters()),
                             quiet=True)
    with pytest.raises(StateMismatchError):  # the stage's Adam against the checkpoint's SGD: refused
        stage2.resume()
    stage2.close()
    err = capsys.readouterr().err
    assert err.count("a ckpt.epochs() loop of this model on this path already ran to its end in this "
                     "process, and this new DriveCheckpoint resumes the run") == 1, err
    assert "ckpt.register('opt2', opt2)" in err and "run='stage2'" in err


# ------------------------------------------------------------------- requires_grad, param groups
def _unfreeze_run(path, kill_in=None, control=False, monkeypatch=None):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    for q in model[0].parameters():
        q.requires_grad = False
    if control:
        monkeypatch.setattr(ka_torch_objects, "restore_requires_grad", lambda module, frozen: 0)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    try:
        for epoch in ckpt.epochs(4):
            if epoch == 1:
                for q in model[0].parameters():
                    q.requires_grad = True
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
            if epoch == kill_in:
                raise Killed
    except Killed:
        ckpt.close()
        return None
    ckpt.close()
    return weights(model)


def test_unfreeze_in_the_loop_survives_a_resume_with_control(tmp_path, monkeypatch):
    ref = _unfreeze_run(tmp_path / "ref")
    _unfreeze_run(tmp_path / "run", kill_in=2)
    assert_same(ref, _unfreeze_run(tmp_path / "run"))
    _unfreeze_run(tmp_path / "control", kill_in=2)
    assert_differs(ref, _unfreeze_run(tmp_path / "control", control=True, monkeypatch=monkeypatch))


def test_add_param_group_after_a_checkpoint_is_refused_with_how_to_proceed(tmp_path):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, _ = make()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    for epoch in ckpt.epochs(2):
        if epoch == 1:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.001})
        for x, y in ckpt.batches(loader):
            step(model, opt, x, y)
    ckpt.close()
    model2, _ = make()
    opt2 = torch.optim.SGD(model2[2].parameters(), lr=0.1)
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    with pytest.raises(StateMismatchError) as err:
        again.resume()
    assert str(err.value) == (
        "optimizer: the checkpoint has 2 parameter group(s), the optimizer 1: the run added group(s) after "
        "it started (optimizer.add_param_group, e.g. at an unfreeze; group 1: 2 parameter(s), lr 0.001). "
        "Nothing was loaded. To continue it, add the same group(s) to optimizer now (as your loop did) and "
        "run the loop again (the same checkpointer retries the resume); or start a new run (another path "
        "or run=).")
    opt2.add_param_group({"params": list(model2[0].parameters()), "lr": 0.001})  # as the line says
    assert again.resume() and again.epoch == 2
    again.close()


# ----------------------------------------------------------------------------------- the plan
def _epochs_run(path, epochs, kill_after=None, capsys=None):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    ran = []
    try:
        for epoch in ckpt.epochs(epochs):
            ran.append(epoch)
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
            if epoch == kill_after:
                raise Killed
    except Killed:
        pass
    ckpt.close()
    return ran, ckpt


def test_a_stale_smaller_epoch_count_is_told_and_the_planned_run_goes_on(tmp_path, capsys):
    _epochs_run(tmp_path / "run", 6, kill_after=4)  # epochs 0..3 saved (epoch 4's end never came)
    capsys.readouterr()
    ran, ckpt = _epochs_run(tmp_path / "run", 4)  # a stale EPOCHS = 4 cell
    err = capsys.readouterr().err
    assert ran == [] and ckpt.epoch == 4
    assert err.count("epochs 6 -> 4: this run was planned for 6 epochs (its checkpoint's plan) and has "
                     "completed 4; your code's ckpt.epochs(4) wins: nothing to train. To train the 2 "
                     "epoch(s) left, run ckpt.epochs(6).") == 1, err
    ran, ckpt = _epochs_run(tmp_path / "run", 6)
    assert ran == [4, 5] and ckpt.finished
    assert "epochs 6 ->" not in capsys.readouterr().err
    # control: the same plan says nothing
    _epochs_run(tmp_path / "same", 6, kill_after=2)
    capsys.readouterr()
    ran, _ = _epochs_run(tmp_path / "same", 6)
    assert ran == [2, 3, 4, 5] and "epochs" not in capsys.readouterr().err


def _cosine_run(path, t_max, epochs, kill_after=None):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, scheduler=sched, quiet=True)
    lrs = []
    for epoch in ckpt.epochs(epochs):
        lrs.append(opt.param_groups[0]["lr"])
        for x, y in ckpt.batches(loader):
            step(model, opt, x, y)
        sched.step()
    ckpt.close()
    return lrs


def test_a_scheduler_built_with_new_settings_wins_with_the_checkpoints_progress(tmp_path, capsys):
    _cosine_run(tmp_path / "run", 5, 5)
    capsys.readouterr()
    lrs = _cosine_run(tmp_path / "run", 8, 8)
    err = capsys.readouterr().err
    assert err.count("scheduler: your code now builds it with T_max 5 -> 8: your settings are used, with the "
                     "checkpoint's progress (last_epoch 5); lr 0 -> 0.03087. To keep the checkpoint's "
                     "schedule, build it as before (T_max=5).") == 1, err
    expected = [0.1 * (1 + math.cos(math.pi * e / 8)) / 2 for e in (5, 6, 7)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    # control: the same settings keep the checkpoint's schedule (its LR climbs back up) and say nothing
    _cosine_run(tmp_path / "same", 5, 5)
    capsys.readouterr()
    lrs = _cosine_run(tmp_path / "same", 5, 8)
    assert lrs[0] == 0 and lrs[1] > lrs[0] and "your code now builds" not in capsys.readouterr().err


def _one_cycle_run(path, total_epochs, planned):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=planned * PER_EPOCH)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, scheduler=sched, quiet=True)
    for _ in ckpt.epochs(total_epochs):
        for x, y in ckpt.batches(loader):
            step(model, opt, x, y)
            sched.step()
    ckpt.close()


def test_one_cycle_past_its_total_steps_is_told_before_torchs_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="Tried to step"):
        _one_cycle_run(tmp_path / "run", 3, 2)
    err = capsys.readouterr().err
    assert err.count("scheduler: OneCycleLR's schedule ends at its total_steps=10 and the training goes on "
                     "(ckpt.epochs(3)): its next step() raises torch's \"Tried to step 11 times\" ValueError. "
                     "Build it with total_steps covering the whole run") == 1, err
    _one_cycle_run(tmp_path / "ok", 3, 3)  # control: a schedule that covers the run says nothing
    assert "OneCycleLR" not in capsys.readouterr().err


def test_no_learning_rate_warning_when_a_cell_is_run_again_with_the_decayed_optimizer(tmp_path, capsys):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make(lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    def cell(epochs):  # the training cell, run twice in the same kernel
        ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, scheduler=sched, quiet=True)
        for _ in ckpt.epochs(epochs):
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
            sched.step()
        ckpt.close()

    cell(2)
    assert opt.param_groups[0]["lr"] == 0.0025
    cell(4)
    assert "your code now sets" not in capsys.readouterr().err
    # control: an optimizer the code builds with another lr is told
    model2, opt2 = make(lr=0.02)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5)
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, scheduler=sched2, quiet=True)
    again.resume()
    again.close()
    assert "optimizer: your code now sets lr 0.01 -> 0.02 (group 0)" in capsys.readouterr().err


# ------------------------------------------------------------------------- leaving the loop early
def _early_stopping_run(path, stop_at, how="break"):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    ran = []
    try:
        for epoch in ckpt.epochs(8):
            ran.append(epoch)
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
            if epoch == stop_at:  # "no improvement for `patience` epochs"
                if how == "break":
                    break
                raise Killed
    except Killed:
        pass
    ckpt.close()
    return ran, weights(model), ckpt


def test_a_break_out_of_the_epochs_is_the_runs_end_with_control(tmp_path, capsys):
    ran, stopped, ckpt = _early_stopping_run(tmp_path / "run", 2)
    assert ran == [0, 1, 2] and ckpt.finished and ckpt.epoch == 3
    capsys.readouterr()
    ran, again, ckpt = _early_stopping_run(tmp_path / "run", 99)  # killed after the loop, run again
    out = capsys.readouterr().out
    assert ran == [] and ckpt.finished
    assert_same(stopped, again)
    assert out.count("keepalive: the loop was left with a break after 3 of 8 epochs (e.g. early stopping), and "
                     "that was saved as the end of the run: nothing to train; the model is the one it left "
                     "with. To train on from epoch 3, ask for another number of epochs (ckpt.epochs(n) with "
                     "n > 3 and n != 8), or start a new run.") == 1, out
    # control: leaving by an error (a crash) is no end: the next run trains on
    _early_stopping_run(tmp_path / "crash", 2, how="error")
    ran, _, ckpt = _early_stopping_run(tmp_path / "crash", 99)
    assert ran == [2, 3, 4, 5, 6, 7] and ckpt.finished


def _enumerate_run(path, wrap, kill_at=None):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=2, quiet=True)
    indices = []
    try:
        for _ in ckpt.epochs(2):
            batches = enumerate(ckpt.batches(loader)) if wrap else ckpt.enumerate(loader)
            for i, (x, y) in batches:
                indices.append(i)
                step(model, opt, x, y)
                if ckpt.step == kill_at:
                    raise Killed
    except Killed:
        pass
    ckpt.close()
    return indices


def test_enumerate_of_batches_in_a_resumed_epoch_is_told_once_with_control(tmp_path, capsys):
    _enumerate_run(tmp_path / "run", True, kill_at=PER_EPOCH + 3)
    capsys.readouterr()
    indices = _enumerate_run(tmp_path / "run", True)
    err = capsys.readouterr().err
    assert indices[:2] == [0, 1]  # the index restarted although the epoch continues at batch 3
    assert err.count("enumerate(ckpt.batches(...)) counts from 0 in this resumed epoch, which continues at "
                     "batch 3: code that uses the index (an accumulation flush at (i + 1) == len(loader), "
                     "`if i >= ...: break`, a schedule stepped with i) sees other values than an "
                     "uninterrupted run. Write `for i, batch in ckpt.enumerate(loader):` for the true "
                     "index.") == 1, err
    _enumerate_run(tmp_path / "control", False, kill_at=PER_EPOCH + 3)
    indices = _enumerate_run(tmp_path / "control", False)
    assert indices[:2] == [3, 4] and "enumerate(" not in capsys.readouterr().err


# --------------------------------------------------------------- Ctrl-C, the loop run again
def _prologue_loop(ckpt, model, opt, loader, interrupt_at=None):
    """A training whose epoch prologue draws random numbers (a per-epoch noise scale)."""
    for _ in ckpt.epochs(3):
        scale = float(torch.rand(()))  # between `for epoch` and `for batch`
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            F.cross_entropy(model(x + scale * torch.randn_like(x)), y).backward()
            if ckpt.step + 1 == interrupt_at:
                signal.raise_signal(signal.SIGINT)  # "Interrupt kernel" in the middle of a step
            opt.step()


@pytest.mark.parametrize("control", [False, True])
def test_loop_cell_run_again_after_ctrl_c_replays_the_prologue(tmp_path, control):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ref = DriveCheckpoint(tmp_path / "ref", model=model, optimizer=opt, quiet=True)
    _prologue_loop(ref, model, opt, loader)
    ref.close()
    expected = weights(model)

    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        _prologue_loop(ckpt, model, opt, loader, interrupt_at=PER_EPOCH + 2)
    assert (ckpt.epoch, ckpt.counters["batch"]) == (1, 2)
    if control:  # without the epoch-start random state the prologue draws from the state of now
        ckpt._data.epoch_rng = None
    _prologue_loop(ckpt, model, opt, loader)  # the same cell, run again in the same process
    ckpt.close()
    if control:
        assert_differs(expected, weights(model))
    else:
        assert_same(expected, weights(model))


# -------------------------------------------------------------------------------- torch.compile
def _compile_run(path, compiled, epochs, kill_after=None):
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    net = torch.compile(model, backend="eager") if compiled else model
    ckpt = DriveCheckpoint(path, model=net, optimizer=opt, quiet=True)
    try:
        for epoch in ckpt.epochs(epochs):
            for x, y in ckpt.batches(loader):
                step(net, opt, x, y)
            if epoch == kill_after:
                raise Killed
    except Killed:
        pass
    ckpt.close()
    return weights(model)


@pytest.mark.parametrize("first,then", [(True, False), (False, True)])
def test_torch_compile_toggled_between_sessions_resumes(tmp_path, first, then):
    ref = _compile_run(tmp_path / "ref", False, 3)
    _compile_run(tmp_path / "run", first, 3, kill_after=1)
    assert_same(ref, _compile_run(tmp_path / "run", then, 3))


def test_a_checkpoint_with_the_compile_prefix_loads_unwrapped_with_control(tmp_path, monkeypatch):
    """A checkpoint of a compiled model written as it is (by a keepalive that did not unwrap it: keys
    `_orig_mod.*`, class OptimizedModule) loads into the plain model."""
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    with monkeypatch.context() as older:
        older.setattr(ka_torch_objects, "unwrap_module", lambda obj: obj)
        old = DriveCheckpoint(tmp_path / "run", model=torch.compile(model, backend="eager"), optimizer=opt,
                              quiet=True)
    assert all(k.startswith("_orig_mod.") for k in old.objects["model"].state_dict())
    for _ in old.epochs(1):
        for x, y in old.batches(loader):
            step(model, opt, x, y)
    old.close()
    saved = weights(model)
    model2, opt2 = make(seed=4)
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    assert again.resume()
    assert_same(saved, weights(model2))
    again.close()
    monkeypatch.setattr(ka_torch_objects, "unwrapped_keys", lambda live, saved: saved)  # control
    control = DriveCheckpoint(tmp_path / "run", model=make()[0], optimizer=opt2, quiet=True)
    with pytest.raises(StateMismatchError, match="'0.weight' is not in the checkpoint"):
        control.resume()
    control.close()


# ------------------------------------------------------ a real kernel: "Interrupt kernel", run again
_KERNEL_SETUP = """
import time, torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from keepalive.callbacks.torch import DriveCheckpoint
torch.set_num_threads(1)
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))

def build(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    return model, opt, loader, DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)

def loop(ckpt, model, opt, loader, sleep=0.0):
    for epoch in ckpt.epochs(3):
        scale = float(torch.rand(()))  # the epoch's prologue draws
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            F.cross_entropy(model(x + scale * torch.randn_like(x)), y).backward()
            opt.step()
            print("STEP", ckpt.step + 1, flush=True)
            time.sleep(sleep)

ref_model, ref_opt, ref_loader, ref = build("ref")
loop(ref, ref_model, ref_opt, ref_loader)
expected = {k: v.clone() for k, v in ref_model.state_dict().items()}
model, opt, loader, ckpt = build("run")
"""


@pytest.mark.parametrize("control", [False, True])
def test_kernel_interrupted_then_the_loop_cell_run_again_is_exact(tmp_path, control):
    from kernelkit import Kernel, kernel_env

    with Kernel(kernel_env(tmp_path / "ckpts", tmp_path), cwd=str(tmp_path)) as k:
        k.run_ok(_KERNEL_SETUP)
        k.start("loop(ckpt, model, opt, loader, sleep=0.2)")
        k.read_until(lambda r: "STEP 7" in r.stdout)
        k.km.interrupt_kernel()  # the notebook's "Interrupt kernel": SIGINT
        first = k.read_until(lambda r: r.ename is not None)
        assert first.ename == "KeyboardInterrupt", first.text
        k.run("pass")  # the kernel is idle again (a request sent while it handled the error is aborted)
        state = k.run_ok("print('AT', ckpt.epoch, ckpt.counters['batch'])").stdout
        assert state.split()[1] == "1", state  # inside epoch 1: its prologue drew before the interrupt
        if control:  # without the epoch-start random state, the prologue draws from the state of now
            k.run_ok("ckpt._data.epoch_rng = None")
        k.run_ok("loop(ckpt, model, opt, loader)")  # the same cell, run again
        same = k.run_ok("print('SAME', all(torch.equal(v, expected[n]) "
                        "for n, v in model.state_dict().items()))").stdout
    assert ("SAME False" if control else "SAME True") in same, same

"""The loop's own state (keepalive.loopstate) with the plain-PyTorch adapter.

The bytecode reading on this Python and on every other CPython found (tests/scripts/loop_cases.py);
the import of keepalive.loopstate pulls in no framework; a top-level loop's plain variables saved and
put back with their types, devices and dtypes, objects named with the fix, ``track_globals`` /
``track``; ``ckpt.iterations()``'s interval; an ``epochs()`` loop of single steps told about it; and a
loop that prints ``loss.item()`` after its batch loop, killed just after a save at an epoch's last
batch (tests/scripts/postloop_train.py): at the top level and inside a function it resumes and
finishes exactly, where the controls crash with a ``NameError`` on every re-run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import List

import numpy as np
import pytest
import torch

from forkserver import ForkServer
from test_break_detection import VERSIONS, _pythons

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "scripts", "loop_cases.py")
POSTLOOP = os.path.join(HERE, "scripts", "postloop_train.py")

NANOGPT_NAMES = ["it", "lr", "val", "best", "micro", "loss", "X", "Y", "local_iter_num", "squares"]
EXPECTED = {
    "module": {"globals": NANOGPT_NAMES, "locals": [], "carried": ["X", "Y", "best", "local_iter_num"],
               "module_level": True},
    "function": {"globals": [], "locals": NANOGPT_NAMES, "carried": ["X", "Y", "best", "local_iter_num"],
                 "module_level": False},
    "global": {"globals": ["best"], "locals": [n for n in NANOGPT_NAMES if n != "best"],
               "carried": ["X", "Y", "best", "local_iter_num"], "module_level": False},
    "wrapped": {"globals": [], "locals": ["it", "n"], "carried": [], "module_level": False},
    "postloop": {"globals": ["epoch", "x", "loss", "total", "shown"], "locals": [], "carried": [],
                 "module_level": True},
    "postloop_function": {"globals": [], "locals": ["epoch", "x", "loss", "total", "shown"], "carried": [],
                          "module_level": False},
    "mutated": {"globals": ["epoch", "n", "history", "scores"], "locals": [], "carried": [],
                "module_level": True},
    "mutated_function": {"globals": [], "locals": ["epoch", "n", "history", "scores"],
                         "carried": ["history", "scores"], "module_level": False},
    "reads": {"postloop": ["loss"], "postloop_function": ["loss"]},
}


def _said(capsys) -> str:
    """What keepalive said (news on stdout, warnings on stderr)."""
    out = capsys.readouterr()
    return out.out + out.err


def _cases(python):
    out = subprocess.run([python, CASES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ------------------------------------------------------------------------------ reading the code
def test_the_loop_code_is_read_on_this_python():
    assert _cases(sys.executable)["said"] == EXPECTED


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != f"3.{sys.version_info[1]}"])
def test_the_loop_code_is_read_on_another_python(version):
    python = _pythons().get(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (pyenv, PATH)")
    assert _cases(python)["said"] == EXPECTED


def test_importing_loopstate_imports_no_framework():
    code = ("import sys, keepalive.loopstate; "
            "print([m for m in ('torch', 'tensorflow', 'keras', 'jax', 'fastai', 'IPython') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --------------------------------------------------------------------- in a cell: saved, put back
CELL = '''
from keepalive.callbacks.torch import DriveCheckpoint
ckpt = DriveCheckpoint(URL, model=model, optimizer=opt, **OPTIONS)
best, history, seen = 1e9, [], {"n": 0}
for epoch in ckpt.epochs(EPOCHS):
    opt.zero_grad()
    loss = model(torch.ones(1, 2)).sum()
    loss.backward()
    opt.step()
    best = min(best, loss.item())
    history = history + [round(loss.item(), 6)]
    seen = {"n": seen["n"] + 1, "last": (epoch, "x")}
    half = torch.full((2,), float(epoch), dtype=torch.bfloat16)
    arr = np.arange(3) * epoch
    scalar = np.float32(epoch) / 2
    ema = Holder()
    if epoch == STOP:
        raise RuntimeError("interrupted")
'''


class Holder:
    """An object without state_dict: named with ckpt.extras as the fix."""

    def __init__(self):
        self.value = 1


def _cell(url, epochs, stop=-1, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    ns = {"torch": torch, "np": np, "Holder": Holder, "model": model, "URL": url, "EPOCHS": epochs,
          "STOP": stop, "OPTIONS": dict(quiet=False, **options),
          "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    try:
        exec(compile(CELL, "<cell>", "exec"), ns)
    except RuntimeError:
        pass
    return ns


def test_a_cell_loops_variables_are_saved_and_put_back(tmp_path, capsys):
    url = str(tmp_path / "run")
    _cell(url, 4, stop=2)  # saved at the ends of epochs 0 and 1, then an error in epoch 2
    first = _said(capsys)
    assert "the loop's variables are saved with each checkpoint and put back on resume: epoch, loss, best, " \
           "history, seen, half, arr, scalar" in first
    assert "`ema` (Holder): keep what it holds in ckpt.extras" not in first  # assigned before use: not carried
    ns = _cell(url, 2)  # the run had saved epoch 1's end: nothing left to train, the values come back
    assert ns["best"] == _cell(str(tmp_path / "ref"), 2)["best"]
    assert ns["history"] == _cell(str(tmp_path / "ref2"), 2)["history"] and len(ns["history"]) == 2
    assert ns["seen"] == {"n": 2, "last": (1, "x")}
    assert ns["half"].dtype == torch.bfloat16 and ns["half"].tolist() == [1.0, 1.0]
    assert type(ns["arr"]) is np.ndarray and ns["arr"].tolist() == [0, 1, 2]
    assert type(ns["scalar"]) is np.float32 and ns["scalar"] == 0.5


def test_track_globals_false_and_track_choose_what_is_saved(tmp_path, capsys):
    _cell(str(tmp_path / "off"), 2, stop=1, track_globals=False)
    assert _cell(str(tmp_path / "off"), 1, track_globals=False)["best"] == 1e9
    _cell(str(tmp_path / "only"), 2, stop=1, track=["best"])
    ns = _cell(str(tmp_path / "only"), 1, track=["best"])
    assert ns["best"] < 1e9 and ns["history"] == [] and ns["seen"] == {"n": 0}
    assert "put back on resume: best\n" in _said(capsys)


def test_a_carried_object_is_named_once_with_its_fix(tmp_path, capsys):
    src = CELL.replace("    ema = Holder()\n", "    ema = ema if epoch else Holder()\n    sched = sched\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = {"torch": torch, "np": np, "Holder": Holder, "model": model, "URL": str(tmp_path / "r"), "EPOCHS": 3,
          "STOP": -1, "OPTIONS": {}, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 1)}
    exec(compile(src, "<cell>", "exec"), ns)
    err = _said(capsys)
    assert err.count("the loop carries") == 1, err
    assert "`ema` (Holder): keep what it holds in ckpt.extras (ckpt.extras['ema'] = ..." in err
    assert "`sched` (StepLR): register it with ckpt.register('sched', sched)" in err


# ------------------------------------------------------------------------------ iteration loops
TIMM = '''
from keepalive.callbacks.torch import DriveCheckpoint
ckpt = DriveCheckpoint(URL, model=model, optimizer=opt, every=2, quiet=False)
updates_per_epoch = 4
history = []


def train_one_epoch(epoch):
    num_updates = epoch * updates_per_epoch
    for x in ckpt.batches(LOADER):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        num_updates += 1
        lrs.append(0.1 / num_updates)


for epoch in ckpt.epochs(2):
    train_one_epoch(epoch)
    history.append(epoch)
'''


def test_a_batch_loop_in_a_function_of_its_own_names_its_counters_once(tmp_path, capsys):
    """timm's train.py shape: the epoch loop at the top level, the batch loop in train_one_epoch(),
    whose ``num_updates`` feeds the schedule: it cannot be put back, so it is named (once), while the
    top-level ``history`` the epoch loop appends to is saved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    ns = {"URL": str(tmp_path / "timm"), "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
          "LOADER": torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=1), "lrs": []}
    exec(compile(TIMM, "<cell>", "exec"), ns)
    said = _said(capsys)
    assert said.count("runs inside train_one_epoch()") == 1, said
    assert "num_updates carry from one step to the next" in said
    assert "put back on resume: epoch, history" in said


def _iteration_cell(tmp_path, loop: str, n: int, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    from keepalive.callbacks.torch import DriveCheckpoint

    ckpt = DriveCheckpoint(str(tmp_path / loop), model=model, optimizer=opt, **options)
    for _ in getattr(ckpt, loop)(n):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    return ckpt


def test_iterations_saves_every_auto_interval_and_says_so(tmp_path, capsys):
    ckpt = _iteration_cell(tmp_path, "iterations", 30)
    err = _said(capsys)
    assert "ckpt.iterations(30) saves every 'auto' interval" in err
    assert ckpt.finished and ckpt.step == 30
    assert len(ckpt.core.store.list()) <= 3  # the first iteration (measuring a save) and the end


def test_epochs_as_an_iteration_loop_is_told(tmp_path, capsys):
    _iteration_cell(tmp_path, "epochs", 100, every=50)  # an explicit interval: nothing to tell
    assert "iteration loop" not in _said(capsys)
    _iteration_cell(tmp_path / "b", "epochs", 100, background=False)
    err = _said(capsys)
    assert err.count("ckpt.epochs(100) runs one optimizer step per epoch and no ckpt.batches() loop") == 1
    assert "Write `for it in ckpt.iterations(100):`" in err


# ----------------------------------------------------------- print(loss.item()) after the batch loop
FORKS: List[ForkServer] = []


@pytest.fixture(scope="module")
def server():
    FORKS.append(ForkServer(["torch", "torch.utils.data"], dict(os.environ, PYTHONUNBUFFERED="1"), quick_exit=True))
    try:
        yield FORKS[0]
    finally:
        FORKS.pop().close()


def _postloop(server, root, name, *options, kill=False):
    argv = [POSTLOOP, "--run", str(root / name), "--out", str(root / f"{name}.pt"), "--log",
            str(root / f"{name}.log"), *options, *(["--kill"] if kill is True else [kill] if kill else [])]
    child = server.spawn(argv, dict(os.environ, PYTHONUNBUFFERED="1"))
    output = child.stdout.read()
    child.stdout.close()
    return child.wait(timeout=300), output


@pytest.mark.parametrize("where", ["top level", "in a function"])
def test_a_resume_at_an_epochs_last_batch_finishes_exactly(server, tmp_path, where):
    options = ["--in-main"] if where == "in a function" else []
    assert _postloop(server, tmp_path, "ref", *options)[0] == 0
    code, _ = _postloop(server, tmp_path, "run", *options, kill=True)
    assert code == -signal.SIGKILL
    code, output = _postloop(server, tmp_path, "run", *options)
    assert code == 0 and "resuming run" in output, output
    resumed_at = next(line for line in output.splitlines() if "resuming run" in line)
    # at the top level from epoch 0's last batch (step 4 of 4), its loss put back for the print; in a
    # function from the save before it (step 2): the save due at the last batch waited for the epoch's end
    assert (", step 4," if where == "top level" else ", step 2,") in resumed_at, output
    ref, run = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
    assert (tmp_path / "ref.log").read_text() == (tmp_path / "run.log").read_text()


@pytest.mark.parametrize("options", [["--no-track", "--no-wait"], ["--in-main", "--no-wait"]])
def test_control_a_resume_at_the_last_batch_crashes_for_ever(server, tmp_path, options):
    """Without the loop's variables put back and without the save moved to the epoch's end, the
    issue's NameError, on every re-run."""
    assert _postloop(server, tmp_path, "run", *options, kill=True)[0] == -signal.SIGKILL
    for _ in range(2):
        code, output = _postloop(server, tmp_path, "run", *options)
        assert code != 0 and "'loss'" in output and "Error" in output, output


@pytest.mark.parametrize("control", [False, True])
def test_a_signal_at_an_epochs_last_batch_in_a_function_saves_at_the_epochs_end(server, tmp_path, control):
    """SIGTERM during the last batch of an epoch whose code after the batch loop reads ``loss``, in a
    function: saved after that code (then the process stops), and the re-run finishes exactly.
    Control: saved at the last batch, the re-run crashes."""
    options = ["--in-main", *(["--no-wait"] if control else [])]
    assert _postloop(server, tmp_path, "ref", *options)[0] == 0
    code, output = _postloop(server, tmp_path, "run", *options, kill="--term")
    assert code != 0 and "SIGTERM" in output, output
    code, output = _postloop(server, tmp_path, "run", *options)
    if control:
        assert code != 0 and "'loss'" in output, output
        return
    assert code == 0 and ", step 4," in next(line for line in output.splitlines() if "resuming run" in line), output
    ref, run = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
    assert (tmp_path / "ref.log").read_text() == (tmp_path / "run.log").read_text()


def test_a_save_during_an_evaluation_takes_the_loops_variables_of_the_last_boundary():
    """What the loop assigns after its last step (a best value, a list appended to) is not in a save
    made during the evaluation that follows: a resume runs that code again."""
    from keepalive.loopstate import LoopVariables

    ns = {"best": 1.0, "history": [1.0], "X": torch.ones(2)}
    lv = LoopVariables(lambda m: None, lambda m, key=None: None, track=["best", "history", "X"])
    lv.namespace = ns
    kept = lv.keep()  # the step boundary
    ns["best"], ns["X"] = 0.5, torch.zeros(2)
    ns["history"].append(0.5)
    tree = {"loop": lv.capture(tell=False)}
    assert tree["loop"]["values"]["best"] == 0.5
    lv.put(tree, kept)
    assert tree["loop"]["values"]["best"] == 1.0 and tree["loop"]["values"]["history"] == [1.0]
    assert tree["loop"]["values"]["X"].tolist() == [1.0, 1.0]

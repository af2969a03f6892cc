"""The notebook flow in real IPython kernels (jupyter_client, nbclient), as a user meets it.

* Unnamed runs: two bare ``DriveCheckpoint()`` s in two cells (the same model structure) write two
  runs, each named after its cell's code, and say which; the same cell in a new kernel (a restart)
  finds its own run again, and an unfinished run an older keepalive named ``default`` from that cell
  goes on. Control: two cells that name one run share it (the second trains nothing).
* The writer lease: while a kernel's training loop runs, a second kernel is refused the run
  (``RunLockedError``); once the loop is left (the loop's own error), or the training finished, the idle kernel no
  longer holds it and the other kernel resumes, or is told the run is complete.
* A stop before the session's deadline: with the budget already used up (``KEEPALIVE_BUDGET=2min`` on
  the VM's clock, as on Colab) the training says so at its start, saves at its first chance, and the
  cell ends with ``TrainingStopped`` after the save is durable, so "Run all" (nbclient) does not run
  the evaluation cell after it. Control: ``on_deadline="save"`` trains on and the next cell runs.
"""
from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("nbclient")
pytest.importorskip("torch")

import nbformat  # noqa: E402

from kernelkit import Kernel, kernel_env, kernelspec  # noqa: E402  (tests/kernelkit.py)

pytestmark = pytest.mark.timeout(300)

SETUP = """\
import os
import time
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from keepalive.callbacks.torch import DriveCheckpoint
torch.set_num_threads(1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
loader = DataLoader(data, batch_size=16, shuffle=True)
"""


def training_cell(tag: str, run: str = "") -> str:
    """A cell that trains its own model (always the same structure) for 2 epochs; ``run`` names the
    run (default: none, a bare DriveCheckpoint)."""
    named = f"run={run!r}, " if run else ""
    return (f"model_{tag} = torch.nn.Linear(8, 4)\n"
            f"opt_{tag} = torch.optim.SGD(model_{tag}.parameters(), lr=0.1)\n"
            f"ckpt_{tag} = DriveCheckpoint({named}model=model_{tag}, optimizer=opt_{tag})\n"
            f"for epoch in ckpt_{tag}.epochs(2):\n"
            f"    for x, y in ckpt_{tag}.batches(loader):\n"
            f"        opt_{tag}.zero_grad()\n"
            f"        F.cross_entropy(model_{tag}(x), y).backward()\n"
            f"        opt_{tag}.step()\n"
            f"    print('EPOCH {tag}', epoch, flush=True)\n"
            f"print('RUN {tag}', ckpt_{tag}.url, flush=True)\n")


LEGACY = training_cell("e").replace("for epoch in ckpt_e.epochs(2):\n",
                                    "for epoch in ckpt_e.epochs(2):\n"
                                    "    if FAIL and epoch == 1:\n        raise RuntimeError('killed')\n")


def printed(text: str, tag: str) -> str:
    m = re.search(rf"RUN {tag} (\S+)", text)
    assert m, text
    return m.group(1)


def test_bare_checkpoints_in_two_cells_write_two_runs_and_a_restart_finds_each(tmp_path):
    ckpts = tmp_path / "ckpts"
    env = kernel_env(ckpts, tmp_path)
    with Kernel(env=env, cwd=str(tmp_path)) as k:
        k.run_ok(SETUP)
        a = k.run_ok(training_cell("a"))
        b = k.run_ok(training_cell("b"))
        run_a, run_b = printed(a.text, "a"), printed(b.text, "b")
        assert run_a != run_b
        for res, url in ((a, run_a), (b, run_b)):
            name = os.path.basename(url)
            assert re.fullmatch(r"cell-[0-9a-f]{8}", name), name
            assert res.stdout.count("EPOCH") == 2, res.text  # each trained its own 2 epochs
            assert (f"keepalive: DriveCheckpoint() without a path or run= writes run '{name}' in {ckpts} "
                    "(named after this cell's code: running this cell again resumes it; run='name' names "
                    "it)") in res.stdout, res.stdout
        assert "already completed" not in b.text
        same = k.run_ok("print('SAME', torch.equal(model_a.weight, model_b.weight))")
        assert "SAME False" in same.stdout
        # control: two cells that name one run share it; the second trains nothing (what bare
        # checkpoints did before they were named after their cell)
        k.run_ok(training_cell("c", run="shared"))
        d = k.run_ok(training_cell("d", run="shared"))
        assert "EPOCH" not in d.stdout and "already completed 2 epoch(s)" in d.text, d.text
        # an unfinished run as an older keepalive named it ('default'), made by the cell LEGACY
        k.run_ok("FAIL = True")
        failed = k.run(LEGACY)
        assert failed.ename == "RuntimeError" and "EPOCH e 0" in failed.stdout, failed.text
    made = re.search(r"writes run '(cell-[0-9a-f]{8})'", failed.stdout)
    assert made, failed.text
    os.rename(ckpts / made.group(1), ckpts / "default")
    # a new kernel (a restart): the same cell finds its own run, complete (its first kernel ended)
    with Kernel(env=env, cwd=str(tmp_path)) as k:
        k.run_ok(SETUP)
        again = k.run_ok(training_cell("a"))
        assert printed(again.text, "a") == run_a
        assert "EPOCH" not in again.stdout and "already completed 2 epoch(s)" in again.text, again.text
        # the same cell goes on with the older keepalive's run, and says so
        k.run_ok("FAIL = False")
        legacy = k.run_ok(LEGACY)
        assert (f"writes run 'default' in {ckpts} (the unfinished run an older keepalive made from this "
                "cell") in legacy.stdout, legacy.text
        assert "resuming run 'default'" in legacy.stdout and "EPOCH e 1" in legacy.stdout, legacy.text
        assert "EPOCH e 0" not in legacy.stdout
    assert sorted(os.listdir(ckpts)) == sorted([os.path.basename(run_a), os.path.basename(run_b), "shared",
                                                "default"])


LOOP = """\
model_s = torch.nn.Linear(8, 4)
opt_s = torch.optim.SGD(model_s.parameters(), lr=0.1)
ckpt_s = DriveCheckpoint(run="locked", model=model_s, optimizer=opt_s)
for epoch in ckpt_s.epochs(3):
    if epoch == BREAK_AT:
        raise RuntimeError("the loop's own error")
    for x, y in ckpt_s.batches(loader):
        if WAIT:
            print("WAITING", flush=True)
            while not os.path.exists(GO):
                time.sleep(0.02)
            WAIT = False
        opt_s.zero_grad()
        F.cross_entropy(model_s(x), y).backward()
        opt_s.step()
print("LEFT", ckpt_s.epoch, flush=True)
"""


def lease(ckpts) -> dict:
    with open(ckpts / "locked" / "LEASE.json") as f:
        return json.load(f)


def test_an_idle_kernel_holds_no_run_once_its_loop_is_left_or_finished(tmp_path):
    ckpts = tmp_path / "ckpts"
    go = tmp_path / "go"
    env = kernel_env(ckpts, tmp_path)
    with Kernel(env=env, cwd=str(tmp_path)) as first, Kernel(env=env, cwd=str(tmp_path)) as second:
        for k in (first, second):
            k.run_ok(SETUP + f"GO = {str(go)!r}\n")
        # while the first kernel's loop runs, the run is its own: the second is refused (control)
        first.start("WAIT, BREAK_AT = True, 1\n" + LOOP)
        first.read_until(lambda r: "WAITING" in r.stdout, timeout=120)
        refused = second.run("WAIT, BREAK_AT = False, None\n" + LOOP)
        assert refused.status == "error" and refused.ename == "RunLockedError", refused.text
        assert "that process is alive on this machine" in refused.evalue and "wait" not in refused.evalue
        assert not lease(ckpts)["released"]
        # the loop is left by an error as its second epoch begins: the idle first kernel lets go of the run
        go.touch()
        left = first.read_until(lambda r: r.ename is not None, timeout=120)
        assert left.ename == "RuntimeError", left.text
        assert lease(ckpts)["released"]
        resumed = second.run_ok("WAIT, BREAK_AT = False, None\n" + LOOP)
        assert "resuming run 'locked'" in resumed.stdout and "LEFT 3" in resumed.stdout, resumed.text
        assert lease(ckpts)["released"]  # finished: the second kernel, idle now, holds it no more
        done = first.run_ok("WAIT, BREAK_AT = False, None\n" + LOOP)
        assert "already completed 3 epoch(s)" in done.text and "LEFT 3" in done.stdout, done.text
        assert lease(ckpts)["released"]


STOP_TRAIN = """\
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = DriveCheckpoint(run="budget", model=model, optimizer=opt, every=2, on_deadline=ON_DEADLINE)
for epoch in ckpt.epochs(3):
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
print("TRAINED", ckpt.epoch, flush=True)
"""
EVALUATE = "print('EVALUATED', flush=True)\ntorch.save(model.state_dict(), 'model.pt')\n"


def run_all(tmp_path, on_deadline: str):
    """The notebook SETUP / training / evaluation run top to bottom by nbclient ("Run all"), with a
    budget of 2 minutes on the VM's clock (long used up: the machine started before this test)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP + f"ON_DEADLINE = {on_deadline!r}"),
                nbformat.v4.new_code_cell(STOP_TRAIN), nbformat.v4.new_code_cell(EVALUATE)]
    env = dict(os.environ, **kernel_env(tmp_path / "ckpts", tmp_path), KEEPALIVE_BUDGET="2min",
               KEEPALIVE_CLOCK="vm")
    env.pop("KEEPALIVE_SESSION_START", None)
    client = NotebookClient(nb, timeout=240, kernel_name=kernelspec(), allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    error = None
    try:
        client.execute(env=env)
    except CellExecutionError as exc:
        error = exc

    def text(cell) -> str:
        return "".join(o.get("text", "") + ("\n".join(o.get("traceback") or []) if o.get("ename") else "")
                       for o in cell.get("outputs", []))
    return error, [text(c) for c in nb.cells]


def test_a_stop_before_the_deadline_ends_run_all_after_a_durable_save(tmp_path):
    error, (_, train, evaluate) = run_all(tmp_path, "save_and_stop")
    assert error is not None and "TrainingStopped" in str(error), error
    # said at the start of training: the budget is used up, and from which clock it counts
    assert "already used up" in train and "vm clock" in train, train
    m = re.search(r"stopping before the session ends: saved (.+?) to \S+\. Why: (.+?)\. In a new session", train)
    assert m and "already used up" in m.group(2), train
    # the cell's error is one clear line (and the hint), not a traceback through keepalive
    error_lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
                   if "TrainingStopped" in ln or "Traceback" in ln or ln.startswith("File ")]
    assert "Traceback" not in str(error) and len(error_lines) <= 2, str(error)
    assert "training stopped before the session ends" in train
    assert "The cells after this one did not run" in train
    assert "TRAINED" not in train and evaluate == "" and not (tmp_path / "model.pt").exists()
    # the stop's checkpoint was durable before the cell ended: committed (a manifest), not finished
    from keepalive.runs import open_run

    run = open_run(str(tmp_path / "ckpts" / "budget"))
    assert run.newest is not None and run.newest.step == 1 and not run.finished
    assert run.newest_valid() is not None


def test_on_deadline_save_trains_on_and_run_all_goes_on(tmp_path):
    error, (_, train, evaluate) = run_all(tmp_path, "save")
    assert error is None, error
    assert "already used up" in train and "TRAINED 3" in train and "TrainingStopped" not in train, train
    assert "EVALUATED" in evaluate and (tmp_path / "model.pt").exists()

"""The notebook face in real IPython kernels (jupyter_client), as a user meets it.

* ``%load_ext keepalive`` and every ``%keepalive`` sub-command, ``--help``, loading twice, unloading.
* The full story: a kernel trains with ``DriveCheckpoint`` and is SIGKILLed after a random step; a
  fresh kernel loads the extension (which names the unfinished run), runs the setup cell again and
  ``%resume_training``; its final weights equal, bit for bit, those of a kernel never killed.
* ``%resume_training`` with nothing to resume, with a missing variable, and with a damaged newest
  checkpoint (it falls back to the one before and still ends bit-exact).
"""
from __future__ import annotations

import json
import os
import random
import re

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kernelkit import Kernel, kernel_env  # noqa: E402  (tests/kernelkit.py)

pytestmark = pytest.mark.timeout(300)

SETUP = """\
import time
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from safetensors.torch import save_file
from keepalive.callbacks.torch import DriveCheckpoint
torch.set_num_threads(1)
torch.manual_seed(1234)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(240, 16, generator=g), torch.randint(0, 4, (240,), generator=g))
loader = DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
"""

# 3 epochs x 15 batches = 45 steps; a checkpoint every 4 steps (mid-epoch ones included)
TRAIN = """\
ckpt = DriveCheckpoint(run="story", model=model, optimizer=opt, scheduler=sched, every=4)
for epoch in ckpt.epochs(3):
    model.train()
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        print(f"STEP {ckpt.step + 1}", flush=True)
        if CRASH_AT == ckpt.step + 1:
            raise RuntimeError("simulated crash")
        time.sleep(SLEEP)
    sched.step()
if ckpt.finished:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, OUT)
    print("DONE", flush=True)
"""
STEPS = 45


def params(out, sleep=0.0, crash_at=None):
    return f"OUT = {str(out)!r}\nSLEEP = {sleep!r}\nCRASH_AT = {crash_at!r}\n"


def assert_same_weights(a, b):
    wa, wb = safetensors_torch.load_file(str(a)), safetensors_torch.load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of a kernel that trains the story run without interruption."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref.safetensors"
    with Kernel(kernel_env(tmp / "ckpts", tmp), cwd=str(tmp)) as k:
        k.run_ok(SETUP + params(out))
        res = k.run_ok(TRAIN)
        assert "DONE" in res.stdout and f"STEP {STEPS}" in res.stdout
    return out


# ------------------------------------------------------------------------------ load + status
def test_load_ext_status_dir_ls_help_and_unload(tmp_path):
    ckpts = tmp_path / "ckpts"
    with Kernel(kernel_env(ckpts, tmp_path), cwd=str(tmp_path)) as k:
        res = k.run_ok("%load_ext keepalive")
        assert "%resume_training" in res.stdout and str(ckpts) in res.stdout
        assert "unfinished" not in res.stdout
        res = k.run_ok("import sys, json\n"
                       "print(json.dumps(sorted(m for m in ('torch', 'tensorflow', 'keras', 'fastai', "
                       "'ipywidgets') if m in sys.modules)))")
        assert json.loads(res.stdout) == [], "loading the extension imported a framework"

        # the panel: a live widget whose display carries the text panel as text/plain
        res = k.run_ok("%keepalive status")
        assert len(res.displays) == 1, res.text
        shown = res.displays[0]
        assert "application/vnd.jupyter.widget-view+json" in shown
        text = shown["text/plain"]
        for needle in ("keepalive status: platform", "budget", "idle", "RAM", "/dev/shm",
                       f"checkpoints in {ckpts}"):
            assert needle in text, (needle, text)
        assert k.run_ok("%keepalive").displays, "bare %keepalive shows the panel"
        # the panel refreshes itself in a daemon thread; only the newest one does
        k.run_ok("%keepalive status --interval 0.3 --full-every 0.6")
        res = k.run_ok("import time\nfrom keepalive.magics import widget\np = widget._PANELS[-1]\n"
                       "before = p.footer.value\ntime.sleep(1.5)\n"
                       "print('panels', len(widget._PANELS), 'alive', p._thread.is_alive(), "
                       "'refreshed', p.footer.value != before)")
        assert "panels 1 alive True refreshed True" in res.stdout, res.text
        res = k.run_ok("%keepalive status --text")
        assert "keepalive status: platform" in res.stdout and not res.displays
        res = k.run_ok("%keepalive status --json")
        report = json.loads(res.stdout)
        assert {"platform", "remaining_seconds", "idle_seconds", "hardware", "runs"} <= report.keys()
        res = k.run_ok("from keepalive import session\nprint('tracking', session.tracker().registered)")
        assert "tracking True" in res.stdout

        # dir and ls
        assert f"go to {ckpts} ($KEEPALIVE_DIR)" in k.run_ok("%keepalive dir").stdout
        other = tmp_path / "other"
        assert str(other) in k.run_ok(f"%keepalive dir {other}").stdout
        assert f"go to {other}" in k.run_ok("%keepalive dir").stdout
        assert "no checkpoints" in k.run_ok("%keepalive ls").stdout
        k.run_ok(f"%keepalive dir {ckpts}")

        # --help on every magic and sub-command
        for line in ("%keepalive --help", "%keepalive status --help", "%keepalive dir --help",
                     "%keepalive ls --help", "%resume_training --help"):
            res = k.run_ok(line)
            assert res.stdout.startswith("usage: %"), (line, res.text)
        res = k.run("%keepalive nonsense")
        assert res.status == "error" and "invalid choice" in res.text

        # loading twice is harmless; reload works; unload removes everything
        k.run_ok("%load_ext keepalive")
        assert "keepalive" in k.run_ok("%reload_ext keepalive").stdout
        assert k.run_ok("%keepalive status --text").stdout
        k.run_ok("%unload_ext keepalive")
        res = k.run("%keepalive status")
        assert res.status == "error" and "not found" in res.text
        res = k.run_ok("from keepalive import notebook as context\n"
                       "print('hooks', context.is_registered(), session.tracker().registered)")
        assert "hooks False False" in res.stdout
        res = k.run_ok("p._thread.join(2)\nprint('panel stopped', not p._thread.is_alive(), widget._PANELS)")
        assert "panel stopped True []" in res.stdout
        k.run_ok("%load_ext keepalive")
        assert k.run_ok("%keepalive status --text").stdout


# --------------------------------------------------------------------------------- the story
def test_sigkill_then_resume_training_in_a_fresh_kernel_is_bit_exact(tmp_path, reference):
    ckpts = tmp_path / "ckpts"
    out = tmp_path / "resumed.safetensors"
    env = kernel_env(ckpts, tmp_path)
    kill_after = random.Random(os.getpid()).randint(6, STEPS - 8)
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(SETUP + params(out, sleep=0.03))
        k.start(TRAIN)
        k.read_until(lambda r: f"STEP {kill_after}\n" in r.stdout, timeout=120)
        k.kill()
    assert not out.exists()
    with Kernel(env, cwd=str(tmp_path)) as k:
        res = k.run_ok("%load_ext keepalive")
        assert "unfinished run 'story'" in res.stdout, res.text
        assert "%resume_training" in res.stdout and "stopped at step" in res.stdout
        k.run_ok(SETUP + params(out))
        res = k.run_ok("%resume_training", timeout=240)
        assert "re-running training cell" in res.stdout
        m = re.search(r"resuming run 'story' from ckpt-\d+-\w+: (?:in )?epoch (\d+)[^;]*?, step (\d+)", res.stdout)
        assert m, res.text
        resumed_step = int(m.group(2))
        assert 0 < resumed_step <= kill_after
        assert "DONE" in res.stdout and f"STEP {resumed_step + 1}\n" in res.stdout
        res = k.run_ok("%resume_training")
        assert "nothing to resume" in res.stdout and "finished" in res.stdout
    assert_same_weights(reference, out)
    print(f"\nkilled after step {kill_after}, resumed at step {resumed_step}: bit-exact")


# ------------------------------------------------------------------------------- the messages
def _flip_newest(run_dir):
    ckpts = sorted(p for p in run_dir.iterdir() if p.name.startswith("ckpt-"))
    newest = ckpts[-1]
    target = newest / "tensors.safetensors"
    if not target.exists():
        target = max((p for p in newest.iterdir() if p.name != "MANIFEST.json"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return newest.name, ckpts[-2].name


def test_resume_training_messages_missing_names_and_damaged_checkpoint(tmp_path, reference):
    ckpts = tmp_path / "ckpts"
    out = tmp_path / "after-fallback.safetensors"
    with Kernel(kernel_env(ckpts, tmp_path), cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        res = k.run_ok("%resume_training")
        assert "nothing to resume: no keepalive runs under" in res.stdout

        # a training that crashes at step 30 leaves an unfinished run
        k.run_ok(SETUP + params(out, crash_at=30))
        res = k.run(TRAIN)
        assert res.status == "error" and "simulated crash" in res.text

        # a name the training cell needs is gone: nothing runs, the setup cell that defined it is shown
        k.run_ok("del model, sched")
        res = k.run("%resume_training")
        assert res.status == "error" and res.ename == "UsageError", res.text
        for needle in ("cannot resume run 'story' yet", "model, sched", "defines model, sched",
                       "model = torch.nn.Sequential", "--replay", "Nothing was trained"):
            assert needle in res.text, (needle, res.text)
        assert "STEP" not in res.stdout

        # the newest checkpoint is damaged: a clear message, then the one before is used
        damaged, previous = _flip_newest(ckpts / "story")
        k.run_ok(SETUP + params(out))
        res = k.run_ok("%resume_training story", timeout=240)
        assert f"checkpoint {damaged} of run 'story' is damaged" in res.stdout, res.text
        assert "falling back" in res.stdout
        assert f"resuming run 'story' from {previous}" in res.stdout
        assert "DONE" in res.stdout
        res = k.run_ok("%resume_training")
        assert "nothing to resume: every run under" in res.stdout
        res = k.run("%resume_training nosuch")
        assert res.status == "error" and "no run named 'nosuch'" in res.text
    assert_same_weights(reference, out)


def test_resume_training_replay_reruns_the_setup_cells(tmp_path, reference):
    """``--replay``: a fresh kernel with nothing defined re-runs the recorded setup cells first."""
    ckpts = tmp_path / "ckpts"
    out = tmp_path / "replayed.safetensors"
    env = kernel_env(ckpts, tmp_path)
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(SETUP)
        k.run_ok(params(out, crash_at=20))
        assert k.run(TRAIN).status == "error"
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        res = k.run_ok("%resume_training --show")
        assert "training cell" in res.stdout and "not defined in this kernel yet" in res.stdout
        # the recorded CRASH_AT = 20 would crash again at once: redefine it after the replay
        res = k.run("%resume_training --replay")
        assert "replay: running setup cell" in res.stdout and "replay: skipping" in res.stdout, res.text
        assert "simulated crash" in res.text    # the recorded parameters came back too
        k.run_ok("CRASH_AT = None")
        res = k.run_ok("%resume_training", timeout=240)
        assert "DONE" in res.stdout
    assert_same_weights(reference, out)


# ---------------------------------------------------- a run at an explicit path
def test_a_run_at_an_explicit_drive_path_is_named_and_resumed_after_a_kill(tmp_path, reference):
    """As every README example: ``DriveCheckpoint("/content/drive/MyDrive/runs/...")``, a folder
    OUTSIDE the default checkpoint dir. The kernel is SIGKILLed; a new kernel's ``%load_ext``
    names the run (found through RUNS.json in the default dir) and a bare ``%resume_training``
    resumes it bit-exactly."""
    ckpts = tmp_path / "ckpts"                      # the default dir (KEEPALIVE_DIR): no run in it
    drive_run = tmp_path / "content" / "drive" / "MyDrive" / "runs" / "story"
    out = tmp_path / "resumed-at-path.safetensors"
    env = kernel_env(ckpts, tmp_path)
    train_at_path = TRAIN.replace('DriveCheckpoint(run="story", ', f"DriveCheckpoint({str(drive_run)!r}, ")
    assert train_at_path != TRAIN
    kill_after = random.Random(os.getpid() + 8).randint(6, STEPS - 8)
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(SETUP + params(out, sleep=0.03))
        k.start(train_at_path)
        k.read_until(lambda r: f"STEP {kill_after}\n" in r.stdout, timeout=120)
        k.kill()
    assert not out.exists() and (ckpts / "RUNS.json").is_file()
    assert not any(p.name.startswith("ckpt-") for p in ckpts.rglob("*"))
    with Kernel(env, cwd=str(tmp_path)) as k:
        res = k.run_ok("%load_ext keepalive")
        assert f"unfinished run 'story' in {drive_run} stopped at step" in res.stdout, res.text
        k.run_ok(SETUP + params(out))
        res = k.run_ok("%resume_training", timeout=240)
        assert f"run 'story' ({drive_run})" in res.stdout and "re-running training cell" in res.stdout
        m = re.search(r"resuming run 'story' from ckpt-\d+-\w+: (?:in )?epoch (\d+)[^;]*?, step (\d+)", res.stdout)
        assert m, res.text
        assert 0 < int(m.group(2)) <= kill_after
        assert "DONE" in res.stdout
        res = k.run_ok("%resume_training")
        assert "nothing to resume" in res.stdout
    assert_same_weights(reference, out)

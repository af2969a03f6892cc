"""A notebook's training cell keeps its own counters at the top level; a kill and
``%resume_training`` in a fresh kernel brings them back with the weights (real IPython kernels).

The cell is the early-stopping shape of Kaggle and Colab notebooks: ``best_acc``, ``patience`` and a
``history`` list live in the notebook's namespace beside the model, assigned (and appended to) inside
the ``ckpt.epochs()`` loop. keepalive reads which names the loop assigns from the cell's code, saves
their plain values with each checkpoint and puts them back before the loop continues. The kernel is
SIGKILLed in the third epoch (after a mid-epoch checkpoint); the resumed kernel's counters and final
weights equal a kernel never killed. Negative control: ``track_globals=False`` resumes the weights
but not the counters, which then differ.
"""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
torch = pytest.importorskip("torch")

from kernelkit import Kernel, kernel_env  # noqa: E402  (tests/kernelkit.py)

pytestmark = pytest.mark.timeout(300)

SETUP = """\
import json, torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from keepalive.callbacks.torch import DriveCheckpoint
torch.set_num_threads(1)
torch.manual_seed(1234)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
xv, yv = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
loader = DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
best_acc, patience, history = 0.0, 0, []
"""

# 5 epochs x 6 batches = 30 steps; a checkpoint every 4 steps: the kill after step 17 resumes at 16,
# inside the third epoch, after two evaluations changed the counters
TRAIN = """\
ckpt = DriveCheckpoint(run="counters", model=model, optimizer=opt, every=4, track_globals=TRACK)
for epoch in ckpt.epochs(5):
    model.train()
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"STEP {ckpt.step}", flush=True)
    model.eval()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    history.append(round(acc, 6))
    if acc > best_acc:
        best_acc, patience = acc, 0
    else:
        patience += 1
print("COUNTERS " + json.dumps({"best_acc": best_acc, "patience": patience, "history": history,
                                 "weights": [float(p.double().sum()) for p in model.parameters()],
                                 "last_loss": loss.item()}), flush=True)
"""
KILL_AFTER = 17


def _counters(text):
    m = re.search(r"^COUNTERS (.*)$", text, re.M)
    assert m, text[-3000:]
    return json.loads(m.group(1))


def _killed_then_resumed(tmp_path, track):
    env = kernel_env(tmp_path / "ckpts", tmp_path)
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok(SETUP + f"TRACK = {track!r}\n")
        k.start(TRAIN)
        k.read_until(lambda r: f"STEP {KILL_AFTER}\n" in r.stdout, timeout=120)
        k.kill()
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(SETUP + f"TRACK = {track!r}\n")
        res = k.run_ok("%resume_training", timeout=240)
        assert "resuming run 'counters'" in res.stdout, res.text
        return _counters(res.stdout), res.text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    with Kernel(kernel_env(tmp / "ckpts", tmp), cwd=str(tmp)) as k:
        k.run_ok(SETUP + "TRACK = True\n")
        res = k.run_ok(TRAIN)
        # an uninterrupted run says nothing about its loop's variables but the one line that they are saved
        assert "not in the checkpoint" not in res.text, res.text
        return _counters(res.stdout)


def test_counters_of_a_top_level_cell_resume_with_the_weights(tmp_path, reference):
    got, text = _killed_then_resumed(tmp_path, True)
    assert got == reference, (got, reference)
    assert len(reference["history"]) == 5


def test_control_without_tracking_the_counters_differ(tmp_path, reference):
    got, _ = _killed_then_resumed(tmp_path, False)
    assert got["weights"] == reference["weights"]  # the registered objects resume exactly either way
    assert got["history"] != reference["history"] and len(got["history"]) < 5

"""A Lightning fit whose training loader keeps its workers (``persistent_workers=True``) and augments in them
resumes bit-exactly after a SIGKILL (``keepalive.callbacks._lightning_data``).

Such workers start once and go on across epochs: their random states carry over, and no new base seed is
drawn after the first epoch. A resumed fit starts new workers; its checkpoint carries what the running
ones had (the generator their base seed was drawn from, each worker's state for its next batch, as the
torch adapter's does: ``keepalive.callbacks._torch_workers.PersistentWorkers``), and the new workers start
from it. The fit (tests/scripts/lightning_persistent.py): a real ``lightning.Trainer``, random flips and
noise in 2 workers, dropout, 6 batches an epoch, 4 epochs. Killed in epoch 1 after its 5th batch's
checkpoint (one batch left: one worker makes none before the next epoch, so its state comes from the
checkpoint), and after epoch 1's end (new workers for epoch 2): the re-run equals the uninterrupted fit,
weights and every step's loss, and nothing is said. Controls: the same kills with the workers' states
not taken from the checkpoint (keepalive's former behaviour) differ.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest
import torch

from crashkit import assert_differs, assert_same
from forkserver import ForkServer

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "lightning_persistent.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "shims"), os.path.join(HERE, "scripts"),
                                                   os.path.dirname(HERE)]),
           KEEPALIVE_PROGRESS="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
#: what the script imports before keepalive (the server's interpreter runs the shims' sitecustomize)
PRELOAD = ["torch", "torch._dynamo", "lightning.pytorch"]


@pytest.fixture(scope="module")
def forks():
    server = ForkServer(PRELOAD, ENV)
    try:
        yield server
    finally:
        server.close()


def _run(forks, root, name, *args, killed=False):
    """One process of fit ``name`` (its run folder and outputs under ``root``); its output."""
    child = forks.spawn([SCRIPT, str(root / name), str(root / f"{name}.pt"), *args], ENV)
    out = child.stdout.read()
    child.stdout.close()
    code = child.wait(timeout=300)
    if killed:
        assert code == -signal.SIGKILL, f"{name}: not killed ({code}):\n{out[-3000:]}"
    else:
        assert code == 0 and "DONE" in out, f"{name} failed ({code}):\n{out[-3000:]}"
    return out


def _result(root, name):
    with open(root / f"{name}.pt.log") as f:
        losses = json.load(f)
    return {"weights": torch.load(root / f"{name}.pt"), "losses": losses}


@pytest.fixture(scope="module")
def reference(forks, tmp_path_factory):
    """The fit without keepalive, uninterrupted."""
    root = tmp_path_factory.mktemp("lightning-persistent")
    _run(forks, root, "plain", "--plain")
    return _result(root, "plain")


@pytest.mark.parametrize("every,kill_after,resumed_at", [
    ("11", 11, "in epoch 1 after 5 batches"),  # mid-epoch 1, one batch left
    ("epoch", 12, "at the end of epoch 1"),
])
def test_killed_fit_resumes_exactly_and_the_control_differs(forks, tmp_path, reference, every, kill_after,
                                                           resumed_at):
    for name, extra in (("ka", []), ("control", ["--control"])):
        first = _run(forks, tmp_path, name, "--every", every, "--kill-after", str(kill_after), *extra, killed=True)
        second = _run(forks, tmp_path, name, "--every", every, *extra)
        assert resumed_at in second, second
        if not extra:
            assert "persistent_workers=False" not in first + second, first + second
    assert_same(reference, _result(tmp_path, "ka"), f"killed after step {kill_after}")
    control = _result(tmp_path, "control")
    assert_differs(reference["weights"], control["weights"])
    delta = max((reference["weights"][k] - control["weights"][k]).abs().max().item() for k in control["weights"])
    print(f"\ncontrol (new workers go on from their own states): weights max |delta| {delta:.3g}")

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

With ``Trainer(reload_dataloaders_every_n_epochs=1)`` (a new loader each epoch, iterated twice by
Lightning): a fit with keepalive equals one without (0 workers, 2 persistent workers that augment, also in
a DataLoader subclass whose ``__iter__`` is a generator), and SIGKILLs after epoch 1's end and inside it
resume bit-exactly; the control (a resume at an epoch's start without the dropped ``iter()``) differs;
every 2 epochs is said once, at the first save.
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
    server = ForkServer(PRELOAD, ENV, quick_exit=True)
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


# ------------------------------------------------------------ reload_dataloaders_every_n_epochs=1
# Lightning builds the training loader anew each epoch and calls iter() on it twice (when it builds it,
# and when the epoch starts: the first iterator is dropped unread); a fit resumed at an epoch's start
# calls it once. keepalive takes no batch of the dropped iterator (its workers would fetch one more
# batch ahead, and persistent ones go on from that fetch) and makes the dropped iter() of a fit resumed
# at an epoch's start (its draws: the workers' base seed, the order's seed).
RELOAD = {"0 workers": ["--workers", "0"], "2 persistent workers": [],
          # its iterator is made at the first next(): the one Lightning drops starts no worker
          "2 persistent workers, __iter__ a generator": ["--generator-loader"]}


@pytest.fixture(scope="module")
def reload_reference(forks, tmp_path_factory):
    """The reloading fits without keepalive, uninterrupted, by loader settings (made when first asked)."""
    root, made = tmp_path_factory.mktemp("lightning-reload"), {}

    def get(loader):
        if loader not in made:
            name = f"plain-{len(made)}"
            _run(forks, root, name, "--plain", "--reload", *RELOAD[loader])
            made[loader] = _result(root, name)
        return made[loader]
    return get


@pytest.mark.parametrize("loader", list(RELOAD))
def test_reloaded_loaders_are_transparent(forks, tmp_path, reload_reference, loader):
    out = _run(forks, tmp_path, "ka", "--reload", *RELOAD[loader])
    assert "keepalive: warning" not in out, out
    assert_same(reload_reference(loader), _result(tmp_path, "ka"), f"reloaded loaders, {loader}, no kill")


@pytest.mark.parametrize("loader,every,kill_after,resumed_at", [
    ("0 workers", "epoch", 12, "at the end of epoch 1"),
    ("2 persistent workers", "epoch", 12, "at the end of epoch 1"),
    ("2 persistent workers, __iter__ a generator", "epoch", 12, "at the end of epoch 1"),
    ("2 persistent workers", "11", 11, "in epoch 1 after 5 batches"),
])
def test_reloaded_loaders_resume_exactly(forks, tmp_path, reload_reference, loader, every, kill_after, resumed_at):
    args = ["--reload", *RELOAD[loader], "--every", every]
    first = _run(forks, tmp_path, "ka", *args, "--kill-after", str(kill_after), killed=True)
    second = _run(forks, tmp_path, "ka", *args)
    assert resumed_at in second and "keepalive: warning" not in first + second, first + second
    assert_same(reload_reference(loader), _result(tmp_path, "ka"), f"reloaded loaders, {loader}, killed after "
                                                                   f"step {kill_after}")


def test_reload_control_without_the_unread_iteration_differs(forks, tmp_path, reload_reference):
    """A fit resumed at an epoch's start that skips the iter() Lightning drops (keepalive's former
    behaviour) trains the next epoch on another order."""
    args = ["--reload", *RELOAD["0 workers"], "--unread-control"]
    _run(forks, tmp_path, "control", *args, "--kill-after", "12", killed=True)
    _run(forks, tmp_path, "control", *args)
    reference, control = reload_reference("0 workers"), _result(tmp_path, "control")
    assert_differs(reference["weights"], control["weights"])
    delta = max((reference["weights"][k] - control["weights"][k]).abs().max().item() for k in control["weights"])
    print(f"\ncontrol (no unread iter() at the resumed epoch's start): weights max |delta| {delta:.3g}")


def test_reload_every_few_epochs_is_said_at_the_first_save(forks, tmp_path):
    out = _run(forks, tmp_path, "ka", "--reload", "2", "--workers", "0", "--kill-after", "6", killed=True)
    assert out.count("reload_dataloaders_every_n_epochs=2") == 1, out
    assert "reload_dataloaders_every_n_epochs=1 (or 0) resumes bit-exactly" in out, out

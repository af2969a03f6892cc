"""``persistent_workers=True`` (timm's ``create_loader`` default) resumes bit-exactly in a plain-PyTorch loop.

Such workers start once and go on across epochs: their random states carry over, and no new base seed is
drawn from torch's generator after the first epoch. A resumed process starts new workers; keepalive
draws their base seed from a copy of the generator as it was when the uninterrupted run started its
workers (the global generator is left as that run has it) and hands each worker the state it had
(``keepalive.callbacks._torch_workers.PersistentWorkers``). The training (tests/scripts/persistent_train.py):
a small U-Net, 8x8 images, random flips and noise in 2 workers, dropout, a validation pass with its own
persistent workers and random test-time noise; SIGKILLed in epoch 2's middle (the resumed epoch starts
on the other worker), inside a validation, and after an epoch boundary; each re-run until done equals the
uninterrupted run, weights and every logged loss. Control: keepalive's former behaviour differs.
Loaders built anew inside each epoch start new workers each epoch (a new base seed): a resume after an
epoch's end starts them anew as well (``keepalive.callbacks._torch_loaders.LoaderBirths``).
Loaders whose workers a resume cannot carry are told once.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

from crashkit import assert_differs, assert_same
from objectskit import forks_fixture

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "persistent_train.py")


forks = forks_fixture(quick_exit=True)  # a fork server that has imported torch, for the module


def _run(forks, root, name, *args, killed=False):
    """One process of training ``name`` (its run folder and outputs under ``root``); its output."""
    child = forks.spawn([SCRIPT, str(root / name), str(root / f"{name}.pt"), *args], dict(os.environ))
    out = child.stdout.read()
    child.stdout.close()
    code = child.wait(timeout=240)
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
    """The training without keepalive, uninterrupted."""
    root = tmp_path_factory.mktemp("persistent")
    _run(forks, root, "plain", "--plain")
    return _result(root, "plain")


def test_with_keepalive_the_training_is_the_one_without(forks, tmp_path, reference):
    out = _run(forks, tmp_path, "ka")
    assert_same(reference, _result(tmp_path, "ka"), "with keepalive, no kill")
    assert "warning" not in out, out


def test_killed_mid_epoch_and_in_a_validation_resumes_exactly(forks, tmp_path, reference):
    """Killed after batch 6 of epoch 2 (a checkpoint every 3 steps: resumed after its 5th batch, so the
    resumed workers start on each other's slots), then inside epoch 2's validation (resumed after the
    epoch's last batch: the validation's new workers go on from the last one's states). Control: the
    same kills with keepalive's former behaviour differ."""
    for name, extra in (("crash", []), ("old", ["--old"])):
        first = _run(forks, tmp_path, name, "--kill", "train:2:6", *extra, killed=True)
        second = _run(forks, tmp_path, name, "--kill", "val:2:1", *extra, killed=True)
        assert "in epoch 2 after 5 batches" in second, second
        last = _run(forks, tmp_path, name, *extra)
        assert "in epoch 2 after 8 batches" in last, last
        if not extra:
            assert "warning" not in first + second + last
    assert_same(reference, _result(tmp_path, "crash"), "killed in epoch 2 and in its validation")
    assert_differs(reference["weights"], _result(tmp_path, "old")["weights"])


def test_killed_after_an_epoch_boundary_resumes_exactly_and_the_control_differs(forks, tmp_path, reference):
    """Checkpoints at epoch ends; killed in epoch 2, resumed from epoch 1's end: the new workers take the
    seed and states the running ones had. Control: keepalive's former behaviour (new workers seeded
    from a new draw of the global generator) differs, as the issue measured."""
    for name, extra in (("boundary", []), ("old", ["--old"])):
        _run(forks, tmp_path, name, "--every", "epoch", "--kill", "train:2:3", *extra, killed=True)
        out = _run(forks, tmp_path, name, "--every", "epoch", *extra)
        assert "at the end of epoch 1" in out, out
    assert_same(reference, _result(tmp_path, "boundary"), "killed after an epoch boundary")
    old = _result(tmp_path, "old")
    assert_differs(reference["weights"], old["weights"])
    delta = max((reference["weights"][k] - old["weights"][k]).abs().max().item() for k in old["weights"])
    print(f"\ncontrol (workers started anew): weights max |delta| {delta:.3g}")


def test_loaders_built_anew_each_epoch_resume_exactly_after_an_epoch_end(forks, tmp_path):
    """The loaders are built inside ``for epoch in ckpt.epochs(n)``: each epoch's loader starts new
    persistent workers, seeded by a new draw of torch's generator. Killed right after epoch 0's end
    (its checkpoint, the first at an epoch's end) and after epoch 1's: each re-run equals the
    uninterrupted run. Control: keepalive not seeing that epoch 0 built its loaders carries their
    workers' seed and states into epoch 1's new ones, as before the fix (it differed, silently)."""
    _run(forks, tmp_path, "plain", "--plain", "--rebuild")
    reference = _result(tmp_path, "plain")
    for name, extra in (("rebuilt", []), ("blind", ["--blind"])):
        kills = ("train:1:2", "train:2:3") if not extra else ("train:1:2",)
        outs = [_run(forks, tmp_path, name, "--rebuild", "--every", "epoch", "--kill", k, *extra, killed=True)
                for k in kills]
        outs.append(_run(forks, tmp_path, name, "--rebuild", "--every", "epoch", *extra))
        assert "at the end of epoch 0" in outs[1], outs[1]
        if not extra:
            assert "at the end of epoch 1" in outs[2], outs[2]
            assert "warning" not in "".join(outs)
    assert_same(reference, _result(tmp_path, "rebuilt"), "loaders built each epoch, killed after epoch ends")
    blind = _result(tmp_path, "blind")
    assert_differs(reference["weights"], blind["weights"])
    delta = max((reference["weights"][k] - blind["weights"][k]).abs().max().item() for k in blind["weights"])
    print(f"\ncontrol (epoch 0's workers carried into epoch 1's new loader): weights max |delta| {delta:.3g}")


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.randn(4, 2).unbind())


def test_loaders_whose_workers_a_resume_cannot_carry_are_told_once(tmp_path, capsys):
    """A persistent-worker loader iterated outside ckpt.batches() (keepalive never sees its iterator
    created), one over an IterableDataset (positioned at epoch ends only), and one iterated before its
    first ckpt.batches() loop (its workers started unseen): one line each, with the fix."""
    from keepalive.callbacks.torch import DriveCheckpoint

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(num_workers=1, persistent_workers=True)
    train = torch.utils.data.DataLoader(_Stream(), batch_size=2, **kw)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2, **kw)
    early = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2, **kw)
    next(iter(early))  # a look at a batch before the training
    ckpt = DriveCheckpoint(str(tmp_path / "run"), model=model, optimizer=opt)
    for _ in ckpt.epochs(2):
        for x in ckpt.batches(train):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for (x,) in val:
                model(x)
            for (x,) in ckpt.batches(early):
                model(x)
    ckpt.close()
    for loader in (train, val, early):  # their workers (forked from this process) end now, not at exit
        loader._iterator._shutdown_workers()
    err = capsys.readouterr().err
    assert err.count("persistent_workers=False") == 3, err
    assert err.count("were started before its first ckpt.batches() loop") == 1, err
    assert err.count("val (iterated outside ckpt.batches()) keeps its workers") == 1, err
    assert err.count("over a _Stream keeps its workers") == 1, err
    assert "pass it through ckpt.batches()" in err
    sys.stderr.write(err)

"""An ``every=`` that can never fire in the loop at hand is told at the first epoch end, never silent.

``every=10`` counts optimizer steps: a torch loop that steps an optimizer keepalive was not given
counts none, and a Keras fit of 3 epochs of 5 steps never reaches ``every=10_000``; a duration longer
than the whole training never comes either. Either way no checkpoint is saved before the training's
end and a kill re-trains from its start, so the core says it once, with the line that fixes it
(:mod:`keepalive.lifecycle.reach`). The negative controls run the same loops with a schedule that
fires: they save before the end, and the line is absent.
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import pytest  # noqa: E402

from keepalive.store import CheckpointStore  # noqa: E402

NEVER = "no checkpoint will be saved before the training's end"
EPOCHS, BATCHES = 3, 5


def _steps_saved(path):
    """The steps of the run's checkpoints, oldest first."""
    return sorted(info.step for info in CheckpointStore(str(path)).list())


def _warnings(err):
    return [line for line in err.splitlines() if NEVER in line]


# ----------------------------------------------------------------------------------------- torch
def _torch_loop(path, *, register_optimizer, every):
    torch = pytest.importorskip("torch")
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(BATCHES)]
    objects = {"optimizer": opt} if register_optimizer else {}
    ckpt = DriveCheckpoint(str(path), model=model, every=every, track_globals=False, **objects)
    for _epoch in ckpt.epochs(EPOCHS):
        for x, y in data:  # a plain loop: keepalive counts only the given optimizer's steps
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return ckpt


@pytest.mark.parametrize("every,words", [
    (10, "every=10 counts optimizer steps and none was counted in epoch 0: " + NEVER),
    ("1h", "every='1h' is looked at after each optimizer step or batch keepalive counts, and none was "
           "counted in epoch 0: " + NEVER)])
def test_torch_optimizer_not_given_is_told(tmp_path, capsys, every, words):
    """The loop steps an optimizer DriveCheckpoint was not given: no step is counted, nothing saves
    before the end. Told once (3 epochs, one line), at the first epoch's end, with the fix."""
    _torch_loop(tmp_path / "run", register_optimizer=False, every=every)
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and words in lines[0], lines
    assert "optimizer=opt" in lines[0] and "every='epoch'" in lines[0]
    assert _steps_saved(tmp_path / "run") == [0]  # the line was right: only the end was saved


def test_torch_optimizer_given_is_quiet(tmp_path, capsys):
    """Negative control: the same loop with the optimizer given counts 15 steps and saves at step 10."""
    _torch_loop(tmp_path / "run", register_optimizer=True, every=10)
    assert not _warnings(capsys.readouterr().err)
    assert _steps_saved(tmp_path / "run") == [10, 15]


# ----------------------------------------------------------------------------------------- Keras
def _keras_fit(path, every):
    keras = pytest.importorskip("keras")
    import numpy as np

    from keepalive.callbacks.keras import DriveCheckpoint

    keras.utils.set_random_seed(1)
    rs = np.random.RandomState(0)
    x, y = rs.normal(size=(BATCHES * 4, 3)).astype("float32"), rs.normal(size=(BATCHES * 4, 1)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(x, y, batch_size=4, epochs=EPOCHS, verbose=0, callbacks=[DriveCheckpoint(str(path), every=every)])


@pytest.mark.parametrize("every,words", [
    (10_000, "every=10000 counts optimizer steps, and the whole training has 15 (3 epochs of 5): " + NEVER),
    ("1h", "every='1h' is longer than the whole training (about ")])
def test_keras_schedule_longer_than_training_is_told(tmp_path, capsys, every, words):
    _keras_fit(tmp_path / "run", every)
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and words in lines[0], lines
    assert ("every=5 (once an epoch)" if every == 10_000 else "a shorter duration") in lines[0]
    assert _steps_saved(tmp_path / "run") == [15]


def test_keras_schedule_that_fires_is_quiet(tmp_path, capsys):
    """Negative control: every=5 in the same fit saves at steps 5, 10 and 15, and says nothing."""
    _keras_fit(tmp_path / "run", 5)
    assert not _warnings(capsys.readouterr().err)
    assert _steps_saved(tmp_path / "run") == [5, 10, 15]

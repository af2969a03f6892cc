"""A script run again with other settings and an unnamed DriveCheckpoint(), for the adapters of several
fits (Keras 3, fastai): a finished run of the same model whose fits were built with other optimizer
settings is another training -- a run of its own, said in one line -- never that run's result. A fit is
compared with every fit the run recorded, so a re-run of a two-fit script unchanged, or with its first
fit left out, is still that run (controls)."""
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from keepalive import notebook  # noqa: E402
from keepalive.callbacks.keras import DriveCheckpoint  # noqa: E402


def _data():
    rs = np.random.RandomState(3)
    x = rs.normal(size=(40, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def _script(monkeypatch, rates, epochs=1):
    """A new process's script: a model built anew, one fit per learning rate in ``rates`` (recompiled
    each time), all with one unnamed DriveCheckpoint(). Returns (runs, epochs trained per fit)."""
    monkeypatch.setattr(notebook, "_UNNAMED", {})
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = _data()
    runs, trained = [], []
    ckpt = DriveCheckpoint()
    for lr in rates:
        model.compile(keras.optimizers.Adam(lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=10, epochs=epochs, verbose=0, callbacks=[ckpt])
        runs.append(ckpt.core.store.run)
        trained.append(len(history.history.get("loss", [])))
    return runs, trained


def test_keras_a_finished_run_with_another_learning_rate_is_another_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _script(monkeypatch, [0.01]) == (["default"], [1])
    assert _script(monkeypatch, [0.01])[0] == ["default"]  # control: the same training is complete
    assert "run 'default' already completed" in capsys.readouterr().out
    runs, trained = _script(monkeypatch, [0.003])
    out = capsys.readouterr().out
    assert runs[0].startswith("default-") and trained == [1], out
    assert out.count(f"keepalive: run '{runs[0]}' (new: other settings than run 'default', which finished: "
                     "optimizer learning_rate 0.01 → 0.003") == 1, out
    assert _script(monkeypatch, [0.003])[0] == runs  # run again: its own run, complete
    assert sorted(os.listdir(tmp_path / "home")) == sorted(["default", runs[0]])


def test_keras_a_two_fit_script_run_again_is_the_same_run_also_without_its_first_fit(tmp_path, monkeypatch,
                                                                                       capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _script(monkeypatch, [0.01, 0.001])[0] == ["default", "default"]
    capsys.readouterr()
    assert _script(monkeypatch, [0.01, 0.001])[0] == ["default", "default"]  # unchanged: complete
    assert _script(monkeypatch, [0.001])[0] == ["default"]  # the first fit left out: the second fit's
    out = capsys.readouterr().out
    assert "other settings" not in out and os.listdir(tmp_path / "home") == ["default"], out


def _fastai_script(monkeypatch, *fits):
    """A new process's script: a learner built anew, its fit calls ``fits`` ((kind, lr) each: "one_cycle"
    or "fine_tune"), all with one unnamed DriveCheckpoint(). Returns (run, training batches seen)."""
    from fastai.callback.core import Callback

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    from fastai_setup import make_learner

    from keepalive.callbacks.fastai import DriveCheckpoint as FastaiCheckpoint

    class Count(Callback):
        order, n = 201, 0

        def after_batch(self):
            self.n += self.learn.training

    monkeypatch.setattr(notebook, "_UNNAMED", {})
    learn = make_learner()
    learn.logger = lambda *a, **k: None
    learn.remove_cb(learn.progress)
    ckpt, count = FastaiCheckpoint(), Count()
    for kind, lr in fits:
        if kind == "fine_tune":
            learn.fine_tune(1, lr, freeze_epochs=1, cbs=[ckpt, count])
        else:
            learn.fit_one_cycle(1, lr, cbs=[ckpt, count])
    return ckpt.core.store.run, count.n


def test_fastai_a_finished_run_with_another_learning_rate_is_another_training(tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastai")
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _fastai_script(monkeypatch, ("one_cycle", 5e-3)) == ("default", 6)
    assert _fastai_script(monkeypatch, ("one_cycle", 5e-3)) == ("default", 0)  # control: complete
    capsys.readouterr()
    run, trained = _fastai_script(monkeypatch, ("one_cycle", 1e-3))
    out = capsys.readouterr().out
    assert run.startswith("default-") and trained == 6, out
    assert out.count(f"keepalive: run '{run}' (new: other settings than run 'default', which finished: "
                     "lr_max 0.005 → 0.001, hyper-parameter schedule") == 1, out
    assert _fastai_script(monkeypatch, ("one_cycle", 1e-3)) == (run, 0)  # run again: its own run, complete


def test_fastai_fine_tune_run_again_is_the_same_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastai")
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _fastai_script(monkeypatch, ("fine_tune", 5e-3)) == ("default", 12)
    assert _fastai_script(monkeypatch, ("fine_tune", 5e-3)) == ("default", 0)  # both fits complete
    assert "other settings" not in capsys.readouterr().out and os.listdir(tmp_path / "home") == ["default"]

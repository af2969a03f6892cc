"""Keras DriveCheckpoint in-process: ResumableData's order, the deadline stop and exact resume,
callback states (EarlyStopping / ReduceLROnPlateau / ModelCheckpoint) across a crash, finished and
early-stopped runs, schedules, mismatches. (The SIGKILL tests are in test_keras_crash.py.)"""
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()

from keepalive.callbacks.keras import DriveCheckpoint, ResumableData  # noqa: E402
from keepalive.errors import StateMismatchError  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402

N, BATCH = 96, 16
STEPS_PER_EPOCH = N // BATCH


def _data():
    rs = np.random.RandomState(3)
    return rs.normal(size=(N, 8)).astype("float32"), rs.randint(0, 3, size=(N,)).astype("int32")


def _model(seed=5, hidden=16):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(hidden, activation="relu"),
                          keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    m.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def _state(model):
    return [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class Crash(keras.callbacks.Callback):
    """Raises inside fit at a given global step (a crash without killing the test process)."""

    def __init__(self, at_step, steps_per_epoch=STEPS_PER_EPOCH):
        super().__init__()
        self.at, self.spe, self.epoch = at_step, steps_per_epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch * self.spe + batch + 1 == self.at:
            raise RuntimeError("simulated crash")


# ------------------------------------------------------------------------------ ResumableData
def test_resumable_data_order_is_a_function_of_seed_and_epoch():
    x, y = _data()
    ds = ResumableData({"a": x, "b": x[:, :2]}, y, batch_size=BATCH, seed=11)
    assert len(ds) == STEPS_PER_EPOCH and ds.batch_size == BATCH
    seen = []
    for epoch in range(3):
        rows = np.concatenate([ds.get(epoch, b)[1] for b in range(ds.batches_per_epoch)])
        assert sorted(rows.tolist()) == sorted(y.tolist())  # every sample once per epoch
        seen.append(np.concatenate([ds.get(epoch, b)[0]["a"] for b in range(ds.batches_per_epoch)]))
    assert not np.array_equal(seen[0], seen[1])  # reshuffled per epoch
    other = ResumableData({"a": x, "b": x[:, :2]}, y, batch_size=BATCH, seed=11)
    other.plan(1, 4)  # start epoch 1 at batch 4: only the rest of that epoch, same batches
    assert len(other) == STEPS_PER_EPOCH - 4
    assert np.array_equal(other[0][0]["a"], ds.get(1, 4)[0]["a"])
    assert other.next_pass() == (1, 4) and other.next_pass() == (2, 0)
    # the default seed follows NumPy's global seeding without drawing from it
    np.random.seed(1)
    s1, before = ResumableData(x, y).seed, np.random.get_state()[2]
    assert np.random.get_state()[2] == before
    np.random.seed(1)
    assert ResumableData(x, y).seed == s1
    np.random.seed(2)
    assert ResumableData(x, y).seed != s1


def test_resumable_data_wraps_a_py_dataset():
    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return np.full((2, 1), i, "float32"), np.zeros((2,), "int32")

    ds = ResumableData(Batches(), seed=3)
    orders = [[int(ds.get(e, b)[0][0, 0]) for b in range(5)] for e in range(3)]
    assert all(sorted(o) == list(range(5)) for o in orders) and orders[0] != orders[1]
    assert ds.samples_in(0) == 1 and ds.batch_size is None


# ------------------------------------------------------------------------ deadline and resume
class Slices(keras.utils.PyDataset):
    """A user's PyDataset: fixed batches of (x, y)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def _resumable(form, x, y):
    if form == "arrays":
        return ResumableData(x, y, batch_size=BATCH, seed=4)
    return ResumableData(Slices(x, y), seed=4)  # batch-level shuffle of the user's PyDataset


@pytest.mark.parametrize("form", ["arrays", "pydataset"])
def test_deadline_stops_mid_epoch_saves_and_the_rerun_is_exact(tmp_path, capsys, form):
    x, y = _data()
    ref = _model()
    ref.fit(_resumable(form, x, y), epochs=3, verbose=0,
            callbacks=[DriveCheckpoint(tmp_path / "ref", quiet=True)])
    want = _state(ref)

    holder = {}
    # the session "ends" once 8 steps ran: 0.5 s left, less than a step plus a save plus the margin
    remaining = lambda: 1e6 if holder["ckpt"].step < 8 else 0.5  # noqa: E731
    model = _model()
    ckpt = holder["ckpt"] = DriveCheckpoint(tmp_path / "run", remaining_fn=remaining,
                                            deadline_margin=1)
    with pytest.raises(SystemExit) as stop:  # a script's stop exits 143 (EXIT_STOPPED) after its save
        model.fit(_resumable(form, x, y), epochs=3, verbose=0, callbacks=[ckpt])
    out = capsys.readouterr().out
    assert stop.value.code == 143 and ckpt.stopped and not ckpt.finished and model.stop_training
    assert "stopping before the session ends" in out and "saved in epoch 1 after 2 batches, step 8" in out
    (info,) = [i for i in CheckpointStore(str(tmp_path / "run")).list() if i.step == 8]
    assert info.epoch == 1

    # a "new session": fresh objects, the same fit call
    model2 = _model(seed=99)  # other initial weights: everything must come from the checkpoint
    ckpt2 = DriveCheckpoint(tmp_path / "run")
    history = model2.fit(_resumable(form, x, y), epochs=3, verbose=0,
                         callbacks=[ckpt2])
    out = capsys.readouterr().out
    assert "resuming run 'run'" in out and "in epoch 1 after 2 batches, step 8" in out
    assert "restored weights, optimizer, RNG, data position" in out  # the position: "in epoch 1 after 2 batches"
    assert ckpt2.finished and ckpt2.step == 3 * STEPS_PER_EPOCH
    assert history.epoch == [0, 1, 2]
    assert _same(_state(model2), want)


def test_every_steps_saves_inside_epochs_with_resumable_data_only(tmp_path):
    x, y = _data()
    m = _model()
    m.fit(ResumableData(x, y, batch_size=BATCH), epochs=2, verbose=0,
          callbacks=[DriveCheckpoint(tmp_path / "rd", every=3, keep=None, quiet=True)])
    # steps 3 and 9 inside epochs; step 6 is epoch 0's last batch: saved at the epoch end, after the
    # other callbacks' epoch-end updates (epoch counter 1, batch 0)
    got = [(i.step, i.epoch) for i in CheckpointStore(str(tmp_path / "rd")).list()]
    assert got == [(3, 0), (6, 1), (9, 1), (12, 2)]
    m = _model()
    m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
          callbacks=[DriveCheckpoint(tmp_path / "arr", every=4, keep=None, quiet=True)])
    # plain arrays cannot resume inside an epoch: the saves that came due wait for the epoch end
    assert [i.step for i in CheckpointStore(str(tmp_path / "arr")).list()] == [6, 12]


# ---------------------------------------------------------------------------- callback states
def _callbacks(tmp_path, tag):
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=10, min_delta=0.05, restore_best_weights=True)
    rlr = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=0.05)
    mc = keras.callbacks.ModelCheckpoint(str(tmp_path / f"{tag}.best.weights.h5"), monitor="loss",
                                         save_best_only=True, save_weights_only=True)
    return es, rlr, mc


def test_callback_states_survive_a_crash(tmp_path, capsys):
    x, y = _data()
    ref = _model()
    es0, rlr0, mc0 = _callbacks(tmp_path, "ref")
    ref.fit(x, y, batch_size=BATCH, epochs=5, verbose=0,
            callbacks=[DriveCheckpoint(tmp_path / "ref", quiet=True), es0, rlr0, mc0])
    assert rlr0.wait or rlr0.cooldown_counter or float(ref.optimizer.learning_rate) < 1e-2 or es0.wait

    model = _model()
    es, rlr, mc = _callbacks(tmp_path, "run")
    with pytest.raises(RuntimeError, match="simulated crash"):  # in epoch 3 (0-based), after 3 epochs saved
        model.fit(x, y, batch_size=BATCH, epochs=5, verbose=0,
                  callbacks=[DriveCheckpoint(tmp_path / "run"), es, rlr, mc, Crash(3 * STEPS_PER_EPOCH + 2)])
    # the same code run again (Keras' own shuffle of plain arrays follows TF's global seed, which the
    # script sets before fit); the weights are scrambled to show they come from the checkpoint
    model2 = _model()
    for v in model2.trainable_variables:
        v.assign(np.zeros(v.shape, v.dtype))
    es2, rlr2, mc2 = _callbacks(tmp_path, "run")
    # listed after the checkpoint callback: their epoch-end updates must still be in the checkpoint
    h = model2.fit(x, y, batch_size=BATCH, epochs=5, verbose=0,
                   callbacks=[DriveCheckpoint(tmp_path / "run"), es2, rlr2, mc2])
    out = capsys.readouterr().out
    assert "at the end of epoch 2, step 18" in out and "EarlyStopping" in out and "ReduceLROnPlateau" in out
    assert h.epoch == [0, 1, 2, 3, 4] and len(h.history["loss"]) == 5
    assert _same(_state(model2), _state(ref))
    assert (es2.wait, es2.best, es2.best_epoch) == (es0.wait, es0.best, es0.best_epoch)
    assert _same(es2.best_weights, es0.best_weights)
    assert (rlr2.wait, rlr2.cooldown_counter, rlr2.best) == (rlr0.wait, rlr0.cooldown_counter, rlr0.best)
    assert mc2.best == mc0.best


def test_finished_and_early_stopped_runs_do_nothing_again(tmp_path, capsys):
    x, y = _data()
    m = _model()
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=100.0)  # stops at epoch 1
    h = m.fit(x, y, batch_size=BATCH, epochs=6, verbose=0, callbacks=[DriveCheckpoint(tmp_path / "es"), es])
    assert h.epoch == [0, 1]
    want = _state(m)
    m2 = _model(seed=8)
    es2 = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=100.0)
    h2 = m2.fit(x, y, batch_size=BATCH, epochs=6, verbose=0,
                callbacks=[es2, DriveCheckpoint(tmp_path / "es")])
    out = capsys.readouterr().out
    assert "ended early after 2 epoch(s)" in out and "nothing to do" in out
    assert h2.epoch == [0, 1] and _same(_state(m2), want)

    _model().fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[DriveCheckpoint(tmp_path / "done")])
    n_ckpts = len(CheckpointStore(str(tmp_path / "done")).list())
    # the same code run again (a model built anew; the same model's next fit is a next stage:
    # test_keras_stages.py)
    m3 = _model()
    m3.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[DriveCheckpoint(tmp_path / "done")])
    assert "already completed 2 epoch(s) of 2; nothing to do" in capsys.readouterr().out
    assert len(CheckpointStore(str(tmp_path / "done")).list()) == n_ckpts  # nothing new written
    # run again asking for more epochs: the finished run goes on from where it ended
    m4 = _model()
    h4 = m4.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[DriveCheckpoint(tmp_path / "done")])
    assert h4.epoch == [0, 1, 2] and m4.optimizer.iterations.numpy() == 3 * STEPS_PER_EPOCH
    assert "epochs 2 -> 3: this code's 3 wins" in capsys.readouterr().err


def test_a_different_model_is_refused_and_left_untouched(tmp_path):
    x, y = _data()
    _model().fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                 callbacks=[DriveCheckpoint(tmp_path / "r", quiet=True)])
    other = _model(hidden=32)
    other.optimizer.build(other.trainable_variables)
    before = _state(other)
    with pytest.raises(StateMismatchError, match="shape"):
        other.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                  callbacks=[DriveCheckpoint(tmp_path / "r", quiet=True)])
    assert _same(_state(other), before)


def test_importing_keepalive_does_not_import_keras_or_tensorflow():
    code = ("import sys, keepalive, keepalive.core, keepalive.dataorder\n"
            "bad = [m for m in ('keras', 'tensorflow', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""Keras 3: several fits on one run, one NEW ``DriveCheckpoint(path)`` per fit (the README's inline form
copied into each call), and a plan that changed between sessions.

A new callback on the path of a fit that this process just finished with the same model is the next
stage, not a resume; a fit is recognised by its plan (epochs, optimizer, learning rate), so a re-run
with the first fit commented out resumes the second; a changed ``epochs`` (a stale cell) or learning
rate wins and is said once, with how to get the checkpoint's instead. The in-process tests use plain
arrays (exact at epoch ends) and raise inside fit; the SIGKILL tests run
tests/scripts/keras_stages_train.py and compare every model and optimizer variable, each fit's History
and the step counter with the same script run without keepalive."""
import os
import random
import re
import shutil
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KEEPALIVE_PROGRESS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":  # pragma: no cover - this module runs TF in-process
    pytest.skip("the in-process tests need KERAS_BACKEND=tensorflow", allow_module_level=True)
tf.config.experimental.enable_op_determinism()

import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import script_children_fixture  # noqa: E402
from keepalive.callbacks.keras import DriveCheckpoint  # noqa: E402

N, BATCH = 60, 10
SPE = N // BATCH  # steps per epoch


def _data():
    rs = np.random.RandomState(3)
    x = rs.normal(size=(N, 8)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")


def _compile(model, lr):
    model.compile(keras.optimizers.Adam(lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def _state(model):
    return [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class _Crash(keras.callbacks.Callback):
    """Raises inside fit once the run's global step reaches ``at`` (a crash without a kill)."""

    def __init__(self, ckpt, at):
        super().__init__()
        self.ckpt, self.at = ckpt, at

    def on_train_batch_end(self, batch, logs=None):
        if self.ckpt.step == self.at:
            raise RuntimeError("simulated crash")


def _fit(model, path, epochs, crash_at=None):
    x, y = _data()
    callbacks = [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.02)]
    if path is not None:
        ckpt = DriveCheckpoint(path)  # a new callback per fit, the same path
        callbacks = [ckpt, *callbacks] + ([_Crash(ckpt, crash_at)] if crash_at else [])
    h = model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks)
    return {"epoch": list(h.epoch), **{k: list(v) for k, v in h.history.items()}}


def _build():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dropout(0.3), keras.layers.Dense(3)])


def _script(path, *, recompile=True, fits=(1, 2), epochs=(3, 3), lr2=3e-3, crash_at=None):
    """Transfer learning as a script: fit 1 (the first layer frozen when recompiled after it); unfreeze,
    recompile with a lower learning rate (or not) and fit 2. ``path=None``: without keepalive.
    ``fits=(2,)``: fit 1 commented out. Returns the model and each fit's History."""
    keras.utils.set_random_seed(11)
    model = _build()
    histories = {}
    # (unfrozen without recompiling, Keras would go on training the layer set traced in fit 1)
    if 1 in fits:
        model.layers[0].trainable = not recompile
        _compile(model, 1e-2)
        histories[1] = _fit(model, path, epochs[0], crash_at)
    if 2 in fits:
        model.layers[0].trainable = True
        if recompile or 1 not in fits:
            _compile(model, lr2 if recompile else 1e-2)
        histories[2] = _fit(model, path, epochs[1], crash_at)
    return model, histories


@pytest.mark.parametrize("recompile", [True, False], ids=["recompiled", "same-optimizer"])
def test_a_new_callback_per_fit_trains_each_fit_as_without_keepalive(tmp_path, capsys, recompile):
    """Never killed: fit -> (compile with a lower learning rate) -> fit, a new DriveCheckpoint(path) in
    each, equals the same script without keepalive (weights, optimizer, both Histories); the second fit
    trains (it raised StateMismatchError when recompiled, and trained nothing when not). Then the script
    run again (a model built anew) finds both fits complete and trains nothing."""
    ref_model, ref_hist = _script(None, recompile=recompile)
    model, hist = _script(tmp_path / "run", recompile=recompile)
    out = capsys.readouterr()
    assert "nothing to do" not in out.out + out.err and "warning" not in out.err, out
    assert "fit 2 of run 'run': the next stage, after fit 1 of this model (from epoch 3, step 18)" in out.out, out
    assert hist == ref_hist and _same(_state(model), _state(ref_model))
    assert int(model.optimizer.iterations.numpy()) == (3 if recompile else 6) * SPE

    again, hist2 = _script(tmp_path / "run", recompile=recompile)
    out = capsys.readouterr().out
    assert "fit 1 of run 'run' had completed before the restart (the checkpoint is in fit 2): skipped" in out
    assert "fit 2 of run 'run' already completed 3 epoch(s) of 3; nothing to do" in out
    assert hist2 == ref_hist and _same(_state(again), _state(ref_model))


def test_control_a_model_built_anew_for_the_second_fit_is_a_rerun_not_a_stage(tmp_path, capsys):
    """Negative control: what tells a next stage from a re-run is the model that finished the fit here.
    Fit 2 on a model built anew (the first fit's weights copied in, same plan) is the script run again:
    the run is complete, nothing trains, and the result differs from the two-fit script."""
    ref_model, _ = _script(None, recompile=False)
    model, _ = _script(tmp_path / "run", recompile=False, fits=(1,))
    other = keras.models.clone_model(model)
    other.set_weights(model.get_weights())
    _compile(other, 1e-2)
    _fit(other, tmp_path / "run", 3)
    assert "already completed 3 epoch(s) of 3; nothing to do" in capsys.readouterr().out
    assert int(other.optimizer.iterations.numpy()) == 3 * SPE  # restored, not trained further
    assert not _same(_state(other), _state(ref_model))


def test_a_crash_in_the_second_fit_resumes_it_whole_script_or_without_the_first_fit(tmp_path, capsys):
    """The same optimizer in both fits (not recompiled). A crash inside fit 2 (after one of its epochs
    was saved), then the whole script again: fit 1 is skipped and fit 2 resumes, bit-identical to the
    script without keepalive. A crash in fit 2 before its first save, then only fit 2 (fit 1 commented
    out): recognised by its plan as the next fit after the checkpoint's completed one (said once), it
    starts from fit 1's end state, bit-identical too."""
    ref_model, ref_hist = _script(None, recompile=False, epochs=(2, 3))
    with pytest.raises(RuntimeError, match="simulated crash"):
        _script(tmp_path / "a", recompile=False, epochs=(2, 3), crash_at=3 * SPE + 2)
    capsys.readouterr()
    model, hist = _script(tmp_path / "a", recompile=False, epochs=(2, 3))
    out = capsys.readouterr().out
    assert "fit 1 of run 'a' had completed before the restart (the checkpoint is in fit 2): skipped" in out
    assert hist == ref_hist and _same(_state(model), _state(ref_model))

    with pytest.raises(RuntimeError, match="simulated crash"):
        _script(tmp_path / "b", recompile=True, epochs=(2, 3), crash_at=2 * SPE + 3)
    capsys.readouterr()
    ref_model, ref_hist = _script(None, recompile=True, epochs=(2, 3))
    model, hist = _script(tmp_path / "b", recompile=True, epochs=(2, 3), fits=(2,))
    err = capsys.readouterr().err
    assert ("fit 2 of run 'b': fit 1 had completed before the restart with another plan than this fit's "
            "(epochs 2 -> 3, optimizer.learning_rate 0.01 -> 0.003), so this fit is taken as the next one and "
            "starts from its end state. If it is fit 1 with new settings, use another path or run= to train "
            "it anew.") in err
    assert hist[2] == ref_hist[2] and _same(_state(model), _state(ref_model))


def test_the_second_fit_run_again_in_the_same_process_after_it_raised_before_its_first_save(tmp_path, capsys):
    """In a notebook: fit 2 (recompiled) raised before its first save, and its cell is run again. With
    its compile in the cell: it starts from fit 1's end, bit-identical to a run never interrupted.
    Without (control): its optimizer already took steps, and that is said, with the fix."""
    ref_model, ref_hist = _script(None, recompile=True, epochs=(2, 3))
    for tag, compile_again in (("exact", True), ("stepped", False)):
        keras.utils.set_random_seed(11)
        model = _build()
        model.layers[0].trainable = False
        _compile(model, 1e-2)
        _fit(model, tmp_path / tag, 2)
        model.layers[0].trainable = True
        _compile(model, 3e-3)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(model, tmp_path / tag, 3, crash_at=2 * SPE + 3)
        capsys.readouterr()
        if compile_again:
            _compile(model, 3e-3)
        hist = _fit(model, tmp_path / tag, 3)
        err = capsys.readouterr().err
        if compile_again:
            assert "warning" not in err and hist == ref_hist[2] and _same(_state(model), _state(ref_model)), err
        else:
            assert ("fit 2 of run 'stepped' starts again from the end of fit 1, but the optimizer compiled for it "
                    "took 3 step(s) in its interrupted attempt: call model.compile(...) again before fit for the "
                    "start of a run never interrupted") in err, err


# ------------------------------------------------------------------------ a changed plan (epochs, lr)
def _one_fit(path, epochs, lr=1e-2, crash_at=None):
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    _compile(model, lr)
    return model, _fit(model, path, epochs, crash_at)


def test_a_stale_epochs_cell_ends_the_fit_and_says_so_once(tmp_path, capsys):
    """A 6-epoch run crashed after 3 epochs; the re-run's code says epochs=4 (a stale cell): the code
    wins, fit ends after epoch 4, and one warning says so and how to train the 6. fit(epochs=6) then goes
    on from there and ends bit-identical to an uninterrupted 6-epoch run. The same code run again with
    its plan unchanged says nothing of plans (negative control)."""
    ref_model, ref_hist = _one_fit(None, 6)
    path = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _one_fit(path, 6, crash_at=3 * SPE + 2)
    capsys.readouterr()
    model, hist = _one_fit(path, 4)
    err = capsys.readouterr().err
    assert err.count("plan differs") == 1 and (
        "warning: run 'run', fit 1: this code's plan differs from the checkpoint's: epochs 6 -> 4: this code's 4 "
        "wins, the fit ends after 4 epochs and counts as complete; to train the 6 planned, run fit(epochs=6) "
        "(it goes on from there).") in err, err
    assert hist["epoch"] == [0, 1, 2, 3] and int(model.optimizer.iterations.numpy()) == 4 * SPE

    _one_fit(path, 4)  # control: the plan the checkpoint holds now
    out = capsys.readouterr()
    assert "already completed 4 epoch(s) of 4; nothing to do" in out.out and "plan" not in out.err, out

    model, hist = _one_fit(path, 6)
    err = capsys.readouterr().err
    assert ("this code's plan differs from the checkpoint's: epochs 4 -> 6: this code's 6 wins, the fit goes on "
            "to 6 epochs; to end at 4, run fit(epochs=4).") in err, err
    assert hist == ref_hist and _same(_state(model), _state(ref_model))

    # the stale cell after the 4th epoch was saved: nothing is left to train, and that is said too
    with pytest.raises(RuntimeError, match="simulated crash"):
        _one_fit(tmp_path / "late", 6, crash_at=4 * SPE + 1)
    capsys.readouterr()
    _one_fit(tmp_path / "late", 4)
    out = capsys.readouterr()
    assert "epochs 6 -> 4: this code's 4 wins, the fit ends after 4 epochs (reached already: nothing to train)" \
        in out.err and "already completed 4 epoch(s) of 4" in out.out, out


def test_a_changed_learning_rate_wins_and_is_said_once(tmp_path, capsys):
    """Compiled with another learning rate than the checkpoint's fit was: the code's rate is the one
    training goes on with (the checkpoint restored its optimizer variable), said once with how to keep
    the checkpoint's. Compiled with the same rate: the checkpoint's variable, nothing said (control)."""
    path = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _one_fit(path, 4, crash_at=2 * SPE + 1)
    capsys.readouterr()
    keras.utils.set_random_seed(11)
    seen = []

    class Rate(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    _compile(model, 5e-3)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, callbacks=[DriveCheckpoint(path), Rate()])
    err = capsys.readouterr().err
    assert err.count("plan differs") == 1 and (
        "this code's plan differs from the checkpoint's: optimizer.learning_rate 0.01 -> 0.005: this code's "
        "0.005 wins (it replaces the checkpoint's rate); to go on with the checkpoint's, compile with "
        "learning_rate=0.01 as before.") in err, err
    assert seen == [pytest.approx(5e-3)] * 2

    with pytest.raises(RuntimeError, match="simulated crash"):
        _one_fit(tmp_path / "same", 4, crash_at=2 * SPE + 1)
    capsys.readouterr()
    _one_fit(tmp_path / "same", 4)
    assert "plan" not in capsys.readouterr().err

    # a schedule: its settings are the plan (the code's schedule is the one used anyway)
    cosine = keras.optimizers.schedules.CosineDecay
    with pytest.raises(RuntimeError, match="simulated crash"):
        _one_fit(tmp_path / "cos", 4, lr=cosine(1e-2, 100), crash_at=2 * SPE + 1)
    capsys.readouterr()
    _one_fit(tmp_path / "cos", 4, lr=cosine(1e-2, 200))
    assert ("this code's plan differs from the checkpoint's: optimizer.learning_rate.decay_steps 100 -> 200: "
            "this code's wins; to go on with the checkpoint's, set it as before.") in capsys.readouterr().err


# ------------------------------------------------------------------------------------ SIGKILL
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_stages_train.py")
ENV = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
           KEEPALIVE_PROGRESS="0")
CHILD_SPE = 12  # the script: 120 samples, batches of 10
#: what keras_stages_train.py imports before keepalive: its 6 children fork from a server that has
#: imported it (most of a child's CPU time); TensorFlow's runtime starts in the child
PRELOAD = ["numpy", "tensorflow", "keras"]


forked_children = script_children_fixture(SCRIPT, "tensorflow", PRELOAD, crashkit, sys.modules[__name__])


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), *extra]


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _differing(ref, got):
    a, b = _load(ref), _load(got)
    assert set(b) <= set(a), sorted(set(b) - set(a))
    return [k for k in b if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]


def _run(cmd):
    rep = run_to_completion(cmd, total_steps=10**6, kills=0, rng=random.Random(0), env=ENV, timeout=120)
    assert "DONE" in rep.final_output, rep.final_output[-3000:]
    return rep.final_output


def test_sigkill_in_the_second_fit_then_the_script_again_or_without_its_first_fit(tmp_path):
    """Recompiled with a lower learning rate between the fits, a new callback in each. (a) SIGKILL inside
    fit 2 after one of its checkpoints, then the whole script until it finishes: bit-identical to the
    script without keepalive, both Histories included. (b) a kill right after fit 2's first commit, then
    the script with fit 1 commented out: fit 2 resumes (not skipped as "fit 1 had completed"), bit-
    identical. (c) control: the same re-run with fit 2's learning rate changed cannot be recognised;
    it is skipped by its position, said with both plans' differences, and the result differs."""
    ref_out = _run(_cmd(tmp_path / "ref", tmp_path / "ref.npz", "--plain"))
    first, total = (int(s) for s in re.findall(r"^FIT_END \d (\d+)$", ref_out, re.M))
    assert (first, total) == (2 * CHILD_SPE, 5 * CHILD_SPE)

    seed = next(s for s in range(1000) if random.Random(s).randint(1, total) > first + CHILD_SPE)
    report = run_to_completion(_cmd(tmp_path / "a", tmp_path / "a.npz"), total_steps=total, kills=1,
                               rng=random.Random(seed), run_dir=str(tmp_path / "a"), env=ENV, timeout=120,
                               kill_after_commit=first + CHILD_SPE)
    assert report.kills == 1 and report.trials[0].killed_after_step > first + CHILD_SPE
    out = report.final_output
    assert "fit 1 of run 'a' had completed before the restart (the checkpoint is in fit 2): skipped" in out, out
    assert not _differing(tmp_path / "ref.npz", tmp_path / "a.npz")
    assert len(_load(tmp_path / "a.npz")) == len(_load(tmp_path / "ref.npz"))

    killed = subprocess.run(_cmd(tmp_path / "b", tmp_path / "unused.npz", "--die-at", str(first + CHILD_SPE + 1)),
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 9 and f"COMMITTED {first + CHILD_SPE}" in killed.stdout, killed.stdout[-3000:]
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    out = _run(_cmd(tmp_path / "b", tmp_path / "b.npz", "--fits", "2"))
    assert f"at the end of epoch 2, step {first + CHILD_SPE}" in out and "skipped" not in out, out
    assert not _differing(tmp_path / "ref.npz", tmp_path / "b.npz")
    assert "history.2.loss" in _load(tmp_path / "b.npz")

    out = _run(_cmd(tmp_path / "c", tmp_path / "c.npz", "--fits", "2", "--lr2", "0.005"))
    assert ("fit 1 of run 'c' had completed before the restart (the checkpoint is in fit 2): skipped, the newest "
            "weights loaded. Its plan differs from this code's (epochs 2 -> 3, optimizer.learning_rate 0.01 -> "
            "0.005), and so does fit 2's (optimizer.learning_rate 0.003 -> 0.005): if this is fit 2 (the fits "
            "before it left out), set its epochs and learning rate as before to resume it; to train this fit "
            "anew, use another path or run=") in out, out
    assert _differing(tmp_path / "ref.npz", tmp_path / "c.npz")

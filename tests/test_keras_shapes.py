"""Keras 3 as people use it: models without known input shapes, the running
metrics of a resumed epoch, tf.data / generator inputs, a second fit (transfer learning) and
steps_per_execution / CSVLogger. The SIGKILL tests run tests/scripts/keras_shapes_train.py and compare
every model and optimizer variable, each fit's History and the counters with an uninterrupted run."""
import os
import random
import re
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
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402
from keepalive.callbacks.keras import DriveCheckpoint, ResumableData  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_shapes_train.py")
ENV = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
           KEEPALIVE_PROGRESS="0")
SPE = 12  # steps per epoch of the child: 120 samples, batches of 10


def _preload(argv, env):
    """The children fork from a server per Keras backend that has imported Keras and its backend (most
    of a child's CPU time); the backend's runtime starts in the child."""
    backend = env.get("KERAS_BACKEND", "tensorflow")
    return backend, ["numpy", backend, "keras"], ""


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(_preload, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), *extra]


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_same(ref, got):
    a, b = _load(ref), _load(got)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    assert not differ, {k: (a[k], b[k]) if k.startswith(("history", "counters")) else "" for k in differ[:4]}
    assert any(k.startswith("history.") for k in a) and any(k.startswith("optimizer.") for k in a)


def _reference(tmp_path, env, *extra):
    rep = run_to_completion(_cmd(tmp_path / "ref", tmp_path / "ref.npz", *extra), total_steps=10**6,
                            kills=0, rng=random.Random(0), env=env, timeout=120)
    assert "DONE" in rep.final_output, rep.final_output[-3000:]
    stage_ends = [int(s) for s in re.findall(r"^STAGE_END \d+ (\d+)$", rep.final_output, re.M)]
    return tmp_path / "ref.npz", stage_ends


def _crash(tmp_path, env, total, kills, seed, *extra, mid_epoch_of=None):
    report = run_to_completion(_cmd(tmp_path / "crash", tmp_path / "crash.npz", *extra), total_steps=total,
                               kills=kills, rng=random.Random(seed), run_dir=str(tmp_path / "crash"),
                               env=env, timeout=120, mid_epoch_of=mid_epoch_of)
    assert report.kills == kills and "DONE" in report.final_output, report.final_output[-3000:]
    return report


def _first_kill_seed(low, high, lo_kill):
    """A seed whose first kill (crashkit draws randint(1, high)) lands after step ``lo_kill``."""
    return next(s for s in range(1000) if random.Random(s).randint(low, high) > lo_kill)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_unbuilt_model_resumes_mid_epoch_with_its_running_metrics(tmp_path, backend):
    """Items 1 and 2: a subclassed model (no input shape until its first batch) trains with
    DriveCheckpoint, and SIGKILLs inside epochs resume bit-exactly: weights, optimizer, and the History
    of the resumed epochs (the epoch's running loss / accuracy restored, so EarlyStopping and
    ReduceLROnPlateau monitoring the training accuracy decide as in the uninterrupted run)."""
    if backend == "torch":
        pytest.importorskip("torch")
    env = dict(ENV, KERAS_BACKEND=backend)
    extra = ["--model", "subclassed", "--epochs", "3", "--every", "5"]
    ref, (total,) = _reference(tmp_path, env, *extra)
    report = _crash(tmp_path, env, total, 2, 7, *extra, mid_epoch_of=SPE)
    _assert_same(ref, tmp_path / "crash.npz")
    resumed = [t.resumed_step for t in report.trials[1:] if t.resumed_step]
    assert any(r % SPE for r in resumed), f"no resume inside an epoch: {resumed}"
    print(f"\n{backend}: kills after steps {[t.killed_after_step for t in report.trials[:-1]]}, "
          f"resumed at {resumed}; weights, optimizer and History bit-identical")


def test_second_fit_is_a_new_stage_and_a_kill_in_it_resumes(tmp_path):
    """Item 4 (with items 1 and 5): a Sequential without keras.Input, first layer frozen, fit(epochs=2);
    unfrozen, recompiled, fit(epochs=3) with steps_per_execution=2 and a CSVLogger(append=False). A
    SIGKILL in the second fit, then the whole script again: the first fit is skipped as completed, the
    second resumes; both Histories, the weights, the optimizer, the counters and the CSV file are those
    of the uninterrupted run."""
    extra = ["--model", "sequential", "--epochs", "2,3", "--every", "5", "--spe", "2"]
    ref, stage_ends = _reference(tmp_path, ENV, *extra, "--csv", str(tmp_path / "ref.csv"))
    first, total = stage_ends
    seed = _first_kill_seed(1, total, first)
    report = _crash(tmp_path, ENV, total, 1, seed, *extra, "--csv", str(tmp_path / "crash.csv"))
    assert report.trials[0].killed_after_step > first
    _assert_same(ref, tmp_path / "crash.npz")
    out = report.final_output
    if report.trials[1].resumed_step > first:  # the restart resumed inside the second fit
        assert "fit 1 of run 'crash' had completed before the restart" in out, out[-3000:]
    else:  # the second fit had not saved yet: the first one's end state, then the second fit anew
        assert "run 'crash' already completed 2 epoch(s) of 2" in out, out[-3000:]
    assert (tmp_path / "crash.csv").read_text() == (tmp_path / "ref.csv").read_text()
    print(f"\nstages: first fit ends at step {first}; kills after steps "
          f"{[t.killed_after_step for t in report.trials[:-1]]}, resumed at "
          f"{[t.resumed_step for t in report.trials[1:]]}; bit-identical incl. both Histories and the CSV")


# ------------------------------------------------------------------------------ in-process tests
N, BATCH = 60, 10


def _data():
    rs = np.random.RandomState(3)
    return rs.normal(size=(N, 6)).astype("float32"), rs.randint(0, 3, size=(N,)).astype("int32")


def _model(spe=1):
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    m.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], steps_per_execution=spe)
    return m


def test_tf_data_and_generators_say_once_that_they_resume_inexactly(tmp_path, capsys):
    """Item 3: exactness is impossible there; the start of fit says so once, with the fix."""
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=1).batch(BATCH)
    m = _model()
    ckpt = DriveCheckpoint(tmp_path / "tfdata", quiet=True)
    m.fit(ds, epochs=1, verbose=0, callbacks=[ckpt])
    m.fit(ds, epochs=2, verbose=0, callbacks=[ckpt])  # a second fit (stage): not said again
    err = capsys.readouterr().err
    assert err.count("this fit reads a tf.data.Dataset") == 1, err
    assert ("its data order will differ from an uninterrupted run's, so the resume is not bit-exact. "
            "For an exact resume (also inside an epoch), pass NumPy arrays or a PyDataset wrapped in "
            "keepalive.callbacks.keras.ResumableData(x, y, batch_size=...)") in err

    def batches():
        while True:
            for i in range(0, N, BATCH):
                yield x[i:i + BATCH], y[i:i + BATCH]

    _model().fit(batches(), steps_per_epoch=N // BATCH, epochs=1, verbose=0,
                 callbacks=[DriveCheckpoint(tmp_path / "gen", quiet=True)])
    err = capsys.readouterr().err
    assert "this fit reads a Python generator" in err and "ResumableData" in err
    _model().fit(ResumableData(x, y, batch_size=BATCH), epochs=1, verbose=0,
                 callbacks=[DriveCheckpoint(tmp_path / "rd", quiet=True)])
    assert "not bit-exact" not in capsys.readouterr().err


def test_steps_per_execution_counts_optimizer_steps(tmp_path):
    """Item 5: with steps_per_execution=4 (6 batches per epoch: executions of 4 and 2) the counters are
    those of steps_per_execution=1, and every=N counts optimizer steps."""
    x, y = _data()
    got = {}
    for spe in (1, 4):
        m = _model(spe)
        ckpt = DriveCheckpoint(tmp_path / f"spe{spe}", every=4, keep=None, quiet=True)
        m.fit(ResumableData(x, y, batch_size=BATCH, seed=2), epochs=3, verbose=0, callbacks=[ckpt])
        assert ckpt.step == int(m.optimizer.iterations.numpy()) == 3 * N // BATCH
        saved = CheckpointStore(str(tmp_path / f"spe{spe}")).list()
        got[spe] = (dict(ckpt.counters), [(i.step, i.epoch) for i in saved])
    assert got[1][0] == got[4][0] == {"epoch": 3, "step": 18, "batch": 0, "samples": 3 * N}
    assert got[1][1] == [(4, 0), (8, 1), (12, 2), (16, 2), (18, 3)]
    # boundaries only after each execution (steps 4, 6, 10, 12, 16, 18): a save once 4 optimizer
    # steps (not 4 executions) have run since the last one
    assert got[4][1] == [(4, 0), (10, 1), (16, 2), (18, 3)]


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.at = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize("append", [False, True])
def test_csv_logger_file_continues_after_a_resume(tmp_path, append):
    """Item 5: CSVLogger truncates its file at the start of fit (append=False) or keeps lines of epochs
    that run again (append=True); after a resume its file holds exactly the uninterrupted run's lines,
    even when the file itself was lost (a new VM)."""
    x, y = _data()
    ref_csv, csv = tmp_path / "ref.csv", tmp_path / "run.csv"
    _model().fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                 callbacks=[DriveCheckpoint(tmp_path / "ref", quiet=True), keras.callbacks.CSVLogger(str(ref_csv))])
    with pytest.raises(RuntimeError, match="simulated crash"):
        _model().fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                     callbacks=[keras.callbacks.CSVLogger(str(csv), append=append),
                                DriveCheckpoint(tmp_path / "run", quiet=True), _Crash(3)])
    if append:
        csv.unlink()  # the resume happens on a new machine
    h = _model().fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                     callbacks=[keras.callbacks.CSVLogger(str(csv), append=append),
                                DriveCheckpoint(tmp_path / "run", quiet=True)])
    assert h.epoch == [0, 1, 2, 3]
    assert csv.read_text() == ref_csv.read_text()

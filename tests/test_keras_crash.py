"""The heart of the Keras adapter: SIGKILL a real ``model.fit`` (dropout, BatchNorm, shuffle=True, Adam,
ReduceLROnPlateau, EarlyStopping) at random moments, re-run the same script until it finishes, and
compare every model and optimizer variable bit for bit with a run that was never interrupted.

The scenarios run on the TensorFlow and on the JAX backend (KERAS_BACKEND per child; Colab's TPU
runtimes are JAX-first). Then the same kill schedule with Keras' own ``BackupAndRestore``, to show what it
loses."""
import os
import random
import shutil
import sys
import tempfile

import numpy as np
import pytest

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_train.py")
EPOCHS, SAMPLES, BATCH = 4, 320, 16
STEPS_PER_EPOCH = -(-SAMPLES // BATCH)
STEPS = EPOCHS * STEPS_PER_EPOCH
#: the JAX children compile the same functions: XLA's persistent compilation cache, shared by this
#: module's children, compiles each once. The cached executable is the one a compile makes (its results
#: bit-identical), so every comparison stands.
JAX_CACHE = tempfile.mkdtemp(prefix="keepalive-tests-jax-cache-")
ENV = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
           TF_ENABLE_ONEDNN_OPTS="0", KEEPALIVE_PROGRESS="0",
           JAX_COMPILATION_CACHE_DIR=JAX_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), "--batch", str(BATCH), *extra]


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _strip(key):
    """'model.3.sequential/dense/kernel' -> 'model.3' (names carry per-process counters)."""
    return ".".join(key.split(".")[:2])


def _diff(a, b):
    """Keys that differ and the largest |difference| over the model variables."""
    wa = {_strip(k): v for k, v in _load(a).items()}
    wb = {_strip(k): v for k, v in _load(b).items()}
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not np.array_equal(wa[k], wb[k])]
    max_diff = max((float(np.max(np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64))))
                    for k in wa if k.startswith("model.") and wa[k].dtype.kind == "f"), default=0.0)
    return differ, max_diff


def _assert_same(a, b):
    differ, max_diff = _diff(a, b)
    assert not differ, f"{len(differ)} variables differ (e.g. {differ[:3]}); max |diff| {max_diff:g}"


_REFS = {}


def _preload(argv, env):
    """The children fork from a server per Keras backend that has imported Keras and its backend (most
    of a child's CPU time, some 30 children here); the backend's runtime starts in the child."""
    backend = env.get("KERAS_BACKEND", "tensorflow")
    # keras.utils.set_random_seed, which each child calls, imports TensorFlow when it is installed, on
    # every backend: about 1 s of CPU a child (a third of a small JAX one), paid once in the server
    return backend, ["numpy", backend, "keras", "tensorflow"], ""


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(_preload, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()
        shutil.rmtree(JAX_CACHE, ignore_errors=True)


def _env(backend):
    return dict(ENV, KERAS_BACKEND=backend)


def _reference(tmp_path_factory, data, backend="tensorflow"):
    """An uninterrupted run (one per data mode and backend, shared by the tests of this module)."""
    if (data, backend) not in _REFS:
        d = tmp_path_factory.mktemp(f"ref-{data}-{backend}")
        every = "epoch" if data == "arrays" else "7"
        rep = run_to_completion(_cmd(d / "run", d / "ref.npz", "--data", data, "--every", every),
                                total_steps=STEPS, kills=0, rng=random.Random(0), env=_env(backend))
        assert "DONE" in rep.final_output, rep.final_output[-2000:]
        _REFS[data, backend] = d / "ref.npz"
    return _REFS[data, backend]


def _redone(report):
    return [p.killed_after_step - (c.resumed_step or 0)
            for p, c in zip(report.trials, report.trials[1:]) if p.killed_after_step]


@pytest.mark.parametrize("backend,data,every,kills", [
    ("tensorflow", "arrays", "epoch", 3), ("tensorflow", "resumable", "7", 4),
    ("jax", "arrays", "epoch", 2)])  # JAX mid-epoch: tests/test_keras_position.py (fashion_mnist_cnn)
def test_sigkill_resume_is_bit_exact(tmp_path, tmp_path_factory, backend, data, every, kills):
    pytest.importorskip(backend)
    ref = _reference(tmp_path_factory, data, backend)
    report = run_to_completion(_cmd(tmp_path / "crash", tmp_path / "crash.npz", "--data", data,
                                    "--every", every),
                               total_steps=STEPS, kills=kills, rng=random.Random(2024 + len(data)),
                               run_dir=str(tmp_path / "crash"), env=_env(backend), timeout=180)
    assert report.kills == kills
    assert "DONE" in report.final_output
    _assert_same(ref, tmp_path / "crash.npz")
    # every restart after a commit resumed, and lost at most one save interval plus the write that
    # was in flight
    interval = STEPS_PER_EPOCH if every == "epoch" else int(every)
    for prev, cur in zip(report.trials, report.trials[1:]):
        if prev.killed_after_step and prev.last_committed:
            assert cur.resumed_step is not None, "a restart did not resume"
            assert prev.killed_after_step - cur.resumed_step <= 2 * interval, (prev, cur)
    # the History of the finished run lists every epoch although they ran in several processes
    assert f"HISTORY {list(range(EPOCHS))}" in report.final_output
    print(f"\nkeras {backend} {data} every={every}: {report.kills} kills survived at steps "
          f"{[t.killed_after_step for t in report.trials if t.killed_after_step]}, resumed at "
          f"{[t.resumed_step for t in report.trials[1:]]}, steps redone per kill {_redone(report)}, "
          f"final variables bit-identical to the uninterrupted run")


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_detects_divergence(tmp_path, tmp_path_factory, backend):
    """The comparison can fail: the same training with another seed ends elsewhere."""
    pytest.importorskip(backend)
    ref = _reference(tmp_path_factory, "arrays", backend)
    rep = run_to_completion(_cmd(tmp_path / "other", tmp_path / "other.npz", "--seed", "99"),
                            total_steps=STEPS, kills=0, rng=random.Random(0), env=_env(backend))
    assert "DONE" in rep.final_output
    with pytest.raises(AssertionError):
        _assert_same(ref, tmp_path / "other.npz")


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_keepalive_is_transparent(tmp_path, tmp_path_factory, backend):
    """Issue 21: with no kill, the training with DriveCheckpoint (every epoch) is the same script without
    keepalive, bit for bit: plain arrays with shuffle=True, Dropout, BatchNormalization, Adam,
    ReduceLROnPlateau. The control that this comparison catches another seed: test_detects_divergence."""
    pytest.importorskip(backend)
    ref = _reference(tmp_path_factory, "arrays", backend)
    rep = run_to_completion(_cmd(tmp_path / "plain", tmp_path / "plain.npz", "--callback", "none"),
                            total_steps=STEPS, kills=0, rng=random.Random(0), env=_env(backend))
    assert "DONE" in rep.final_output
    _assert_same(ref, tmp_path / "plain.npz")


def test_backup_and_restore_loses_state(tmp_path, tmp_path_factory):
    """Keras' BackupAndRestore (with double_checkpoint=True, its safest setting) under the same kind
    of kills. It restores weights, optimizer and the epoch, but not the Dropout seed-generator states
    nor ReduceLROnPlateau / EarlyStopping, and a half-done epoch runs again from batch 0. Its writes
    are not atomic: a kill during one can tear the slot (with the default single slot the restart
    then fails on a truncated .h5). Figures are printed; what is asserted is only
    what always holds: after any real resume the final variables differ from the uninterrupted run."""
    ref = _reference(tmp_path_factory, "arrays")
    kills = 3  # the kill schedule of the arrays crash test above (same rng seed)
    run = tmp_path / "bnr"
    cmd = _cmd(run, tmp_path / "bnr.npz", "--callback", "backup")
    torn = None
    try:
        report = run_to_completion(cmd, total_steps=STEPS, kills=kills,
                                   rng=random.Random(2024 + len("arrays")), env=ENV, timeout=180)
    except AssertionError as exc:  # a restart died on BackupAndRestore's torn checkpoint
        if "truncated" not in str(exc) and "Unable to" not in str(exc) and "OSError" not in str(exc):
            raise
        torn = str(exc).strip().splitlines()[-1]
        shutil.rmtree(run, ignore_errors=True)  # the user's only way out: delete it, start over
        report = run_to_completion(cmd, total_steps=STEPS, kills=0, rng=random.Random(0), env=ENV)
    assert "DONE" in report.final_output
    differ, max_diff = _diff(ref, tmp_path / "bnr.npz")
    if torn:
        print(f"\nBackupAndRestore: a kill tore its single checkpoint; the restart failed with "
              f"'{torn}'; after deleting it the run started over (all progress lost)")
        return
    redone = _redone(report)
    resumed = [t.resumed_step for t in report.trials[1:]]
    print(f"\nBackupAndRestore: {report.kills} kills at steps "
          f"{[t.killed_after_step for t in report.trials if t.killed_after_step]}, resumed at {resumed}, "
          f"steps redone {redone} ({sum(redone) / STEPS_PER_EPOCH:.2f} epochs in all), "
          f"{len(differ)} of {len(_load(ref))} variables differ from the uninterrupted run, "
          f"max |weight diff| {max_diff:.3g}; epochs in its History: "
          f"{report.final_output.split('HISTORY ')[1].splitlines()[0]}")
    if any(r for r in resumed):
        assert differ, "BackupAndRestore resumed yet ended bit-identical"


def test_torch_backend_sigkill_resume_is_bit_exact(tmp_path):
    """Keras 3 on its torch backend (Dropout draws from torch's global generator there, and every
    pass over the data creates a torch DataLoader that draws a seed from it too)."""
    pytest.importorskip("torch")
    env = dict(ENV, KERAS_BACKEND="torch")
    extra = ["--data", "resumable", "--every", "7"]
    ref = run_to_completion(_cmd(tmp_path / "ref", tmp_path / "ref.npz", *extra), total_steps=STEPS,
                            kills=0, rng=random.Random(0), env=env, timeout=180)
    assert "DONE" in ref.final_output, ref.final_output[-2000:]
    report = run_to_completion(_cmd(tmp_path / "crash", tmp_path / "crash.npz", *extra),
                               total_steps=STEPS, kills=2, rng=random.Random(11),
                               run_dir=str(tmp_path / "crash"), env=env, timeout=180)
    assert report.kills == 2 and "DONE" in report.final_output
    _assert_same(tmp_path / "ref.npz", tmp_path / "crash.npz")
    kills = [t.killed_after_step for t in report.trials if t.killed_after_step]
    print(f"\nkeras torch backend: kills at {kills}, "
          f"resumed at {[t.resumed_step for t in report.trials[1:]]}, bit-identical")

"""Issue 21, Keras: a ``fit(steps_per_epoch=...)`` shorter than a pass over its data keeps ONE iterator
across epochs; a resumed run continues that pass at the saved batch (SIGKILL, re-run, final variables
bit-identical to an uninterrupted run) on the TensorFlow and the JAX backend, for arrays, a PyDataset,
a repeated tf.data pipeline and the ``fashion_mnist_cnn`` workload (the Colab TPU tutorial's CNN). The
negative control kills the same run at the same step with the pass positioning switched off: the
resumed epochs then see other batches and the variables differ.

Transparency: with DriveCheckpoint and no kill, the final variables equal the same script without
keepalive, bit for bit (steps_per_epoch with shuffle and dropout; a deterministic tf.data pipeline).
In-process: which inputs are told (once, at the first save) that they cannot resume exactly, and which
are not."""
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_position_train.py")
#: the JAX children compile the same functions (the fashion CNN's train step: ~8 s of CPU each): XLA's
#: persistent compilation cache, shared by this module's children, compiles each once. The cached
#: executable is the one a compile makes (its results bit-identical), so every comparison stands.
JAX_CACHE = tempfile.mkdtemp(prefix="keepalive-tests-jax-cache-")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0", KEEPALIVE_PROGRESS="0",
           JAX_COMPILATION_CACHE_DIR=JAX_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
#: the checkpoint the resume starts from: the end of epoch 1 of steps_per_epoch=3, six batches into a pass
#: of 10 (fashion: 8) batches; the resumed epoch 2 trains batches 6-8 of the pass (fashion: 6-7, where
#: Keras ends the epoch early as the pass runs out)
COMMIT = 6


def _preload(argv, env):
    """The children fork from a server per Keras backend that has imported Keras and its backend (most
    of a child's CPU time, 17 children here); the backend's runtime starts in the child. A fork that
    SIGKILLs itself ends by that signal as an interpreter does."""
    backend = env.get("KERAS_BACKEND", "tensorflow")
    # keras.utils.set_random_seed, which each child calls, imports TensorFlow when it is installed, on
    # every backend: about 1 s of CPU a child (a third of a small JAX one), paid once in the server
    return backend, ["numpy", backend, "keras", "tensorflow"], ""


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(_preload, quick_exit=True)
    forking = ForkingSubprocess(pool)
    try:
        with forking.installed_in(crashkit), forking.installed_in(sys.modules[__name__]):
            yield pool
    finally:
        pool.close()
        shutil.rmtree(JAX_CACHE, ignore_errors=True)


def _env(backend):
    return dict(ENV, KERAS_BACKEND=backend)


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), *extra]


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _differ(a, b):
    wa, wb = _load(a), _load(b)
    assert wa.keys() == wb.keys()
    return [k for k in wa if wa[k].shape != wb[k].shape or not np.array_equal(wa[k], wb[k])]


def _run(tmp, name, backend, *extra, total=10**6):
    rep = run_to_completion(_cmd(tmp / name, tmp / f"{name}.npz", *extra), total_steps=total, kills=0,
                            rng=random.Random(0), env=_env(backend), timeout=240)
    assert "DONE" in rep.final_output, rep.final_output[-3000:]
    return tmp / f"{name}.npz"


def _crash(tmp, name, backend, *extra):
    """The child SIGKILLs itself at step COMMIT + 1 (its checkpoints committed: the newest is the end of
    epoch 1, six batches into the pass); the re-run resumes there and finishes."""
    cmd = _cmd(tmp / name, tmp / f"{name}.npz", *extra)
    first = subprocess.run(cmd + ["--die-at", str(COMMIT + 1)], env=_env(backend), capture_output=True,
                           text=True, timeout=240)
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"COMMITTED {COMMIT}" in first.stdout, first.stdout[-3000:]
    rep = run_to_completion(cmd, total_steps=10**6, kills=0, rng=random.Random(0), env=_env(backend),
                            timeout=240)
    assert "DONE" in rep.final_output, rep.final_output[-3000:]
    assert rep.trials[0].resumed_step == COMMIT, rep.final_output[-3000:]
    return tmp / f"{name}.npz"


@pytest.mark.parametrize("backend,data,control", [
    ("tensorflow", "arrays", True), ("jax", "fashion", False), ("jax", "pydataset", False),
    ("tensorflow", "tfdata", False)])  # JAX arrays: the fashion_mnist_cnn workload's; JAX's control:
# test_keras_crash.py::test_detects_divergence[jax]
def test_steps_per_epoch_pass_resumes_exactly(tmp_path, backend, data, control):
    """SIGKILL after the checkpoint of epoch 1 (six batches into the pass), re-run: the resumed epoch 2
    continues the pass at batch 6 (not a new pass), and the final weights are bit-identical. With
    ``control``: the same kill with the positioning off differs (the test can fail), and the run
    without keepalive equals the uninterrupted one (transparency)."""
    extra = ["--data", data, "--epochs", "3"]
    ref = _run(tmp_path, "ref", backend, *extra)
    got = _crash(tmp_path, "crash", backend, *extra)
    differ = _differ(ref, got)
    assert not differ, f"{len(differ)} variables differ after the resume (e.g. {differ[:3]})"
    if control:
        bad = _crash(tmp_path, "nopos", backend, *extra, "--no-position")
        assert _differ(ref, bad), "restarting the pass changed nothing: the crash test cannot fail"
        plain = _run(tmp_path, "plain", backend, *extra, "--callback", "none")
        assert not _differ(ref, plain), "DriveCheckpoint changed an uninterrupted training"
    print(f"\n{backend} {data} steps_per_epoch=3: killed after step {COMMIT}+, resumed 6 batches into the "
          f"pass, bit-identical" + ("; without positioning it differs; no keepalive = keepalive" if control else ""))


def test_deterministic_tf_data_is_transparent(tmp_path):
    """No kill, a tf.data pipeline without shuffle or random ops (no warning either): the training with
    DriveCheckpoint is the training without it, bit for bit. (Arrays with shuffle=True and dropout:
    test_keras_crash.py::test_keepalive_is_transparent, with its control.)"""
    extra = ["--data", "fixed", "--spe", "0"]
    ours = _run(tmp_path, "ours", "tensorflow", *extra)
    plain = _run(tmp_path, "plain", "tensorflow", *extra, "--callback", "none")
    differ = _differ(ours, plain)
    assert not differ, f"{len(differ)} variables differ with keepalive added (e.g. {differ[:3]})"


# ------------------------------------------------------------------------------ in-process: told or not
@pytest.fixture()
def tf_keras():
    if keras.backend.backend() != "tensorflow":  # pragma: no cover - this part runs TF in-process
        pytest.skip("the in-process tests need KERAS_BACKEND=tensorflow")
    import tensorflow as tf

    return tf


def _model(seed=5):
    if seed is not None:
        keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    m.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def _xy():
    rs = np.random.RandomState(3)
    return rs.normal(size=(60, 6)).astype("float32"), rs.randint(0, 3, size=(60,)).astype("int32")


def test_what_is_told_at_the_first_save(tmp_path, capsys, tf_keras):
    """A deterministic tf.data pipeline gets no "not bit-exact" warning (it resumes exactly); a tf.data
    pipeline with a random map() and steps_per_epoch is told once; unseeded shuffle=True over arrays on
    TensorFlow (most notebooks) is told once, at the first save."""
    from keepalive.callbacks._keras_data import tf_dataset_kind
    from keepalive.callbacks.keras import DriveCheckpoint

    tf = tf_keras
    x, y = _xy()
    base = tf.data.Dataset.from_tensor_slices((x, y))
    assert tf_dataset_kind(base.map(lambda a, b: (a * 2, b)).batch(10).prefetch(2)) == "fixed"
    assert tf_dataset_kind(base.shuffle(60, seed=1, reshuffle_each_iteration=False).batch(10)) == "fixed"
    assert tf_dataset_kind(base.shuffle(60, seed=1).batch(10).repeat()) == "stream"
    noisy = tf.autograph.experimental.do_not_convert(lambda a, b: (a + tf.random.uniform(()), b))
    from tensorflow.python.framework import config as tf_config

    # another test file of this process may have enabled op determinism: unseeded random ops (the
    # noisy map's, even when only traced) refuse to run under it
    was = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    try:
        tf.random.set_seed(None)  # no global seed: TensorFlow's kernels draw theirs
        assert tf_dataset_kind(base.map(noisy).batch(10)) == "random"
        assert tf_dataset_kind(base.shuffle(60).batch(10)) == "random"

        _model(None).fit(base.batch(10).prefetch(2), epochs=2, verbose=0,
                         callbacks=[DriveCheckpoint(tmp_path / "fixed", quiet=True)])
        assert "not bit-exact" not in capsys.readouterr().err

        rand = base.map(noisy).batch(10).repeat()
        ckpt = DriveCheckpoint(tmp_path / "rand", quiet=True)
        _model(None).fit(rand, steps_per_epoch=4, epochs=2, verbose=0, callbacks=[ckpt])
        err = capsys.readouterr().err
        assert err.count("this fit reads a tf.data.Dataset whose order is drawn inside TensorFlow") == 1, err

        ckpt = DriveCheckpoint(tmp_path / "unseeded", quiet=True)
        m = _model(None)
        tf.random.set_seed(None)
        m.fit(x, y, batch_size=10, epochs=3, shuffle=True, verbose=0, callbacks=[ckpt])
        err = capsys.readouterr().err
        assert err.count("without a global seed") == 1 and "keras.utils.set_random_seed" in err, err
    finally:
        if was:
            tf.config.experimental.enable_op_determinism()

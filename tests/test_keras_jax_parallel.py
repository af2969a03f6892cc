"""Keras 3 on the JAX backend with ``keras.distribution.DataParallel`` over 8 host devices (the
Kaggle v5e-8 TPU shape, on CPU through ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
keepalive's Keras ``DriveCheckpoint`` is transparent and exact after a kill there too.

The child (tests/scripts/keras_parallel_train.py) replicates a small Dropout / Adam model over the
8 devices and fits ``ResumableData`` with ``DriveCheckpoint(every=4)`` (epochs of 6 steps, so the
saves land inside epochs). SIGKILLed after a checkpoint inside an epoch and re-run until done, it
ends with every model and optimizer variable and the fit's History bit-identical to an uninterrupted
run. With no kill, a fit of NumPy arrays with keepalive equals the same script without it. The negative control
kills the same way but drops the saved position inside the epoch on resume (the resumed epoch starts
at its first batch): the result differs, so the comparison can fail.
"""
import os
import random
import sys

import numpy as np
import pytest

pytest.importorskip("keras")
pytest.importorskip("jax")

import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_parallel_train.py")
EPOCHS, SAMPLES, BATCH = 3, 192, 32
STEPS_PER_EPOCH = SAMPLES // BATCH
STEPS = EPOCHS * STEPS_PER_EPOCH
ENV = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=8",
           TF_CPP_MIN_LOG_LEVEL="3", KEEPALIVE_PROGRESS="0")


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), "--batch", str(BATCH), "--every", "4", *extra]


def _preload(argv, env):
    """The children fork from one server that has imported NumPy, JAX and Keras (most of a child's
    CPU time); JAX's runtime, with its 8 host devices, starts in each child."""
    return "jax-dp", ["numpy", "jax", "keras"], ""


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(_preload, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _diff(a, b):
    """The arrays that differ (variables and History) and the largest |difference| among them."""
    wa, wb = _load(a), _load(b)
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not np.array_equal(wa[k], wb[k])]
    return differ, max((float(np.max(np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64))))
                        for k in differ), default=0.0)


def _run(tmp_path, name, *extra, kills=0, seed=0):
    rep = run_to_completion(_cmd(tmp_path / name, tmp_path / f"{name}.npz", *extra), total_steps=STEPS,
                            kills=kills, rng=random.Random(seed), run_dir=str(tmp_path / name), env=ENV,
                            timeout=240, mid_epoch_of=STEPS_PER_EPOCH if kills else None)
    assert rep.kills == kills and "DONE" in rep.final_output, rep.final_output[-3000:]
    assert "SHARDING NamedSharding devices=8" in rep.final_output  # the variables live on 8 devices
    return rep, tmp_path / f"{name}.npz"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with DriveCheckpoint (shared by the tests of this module)."""
    return _run(tmp_path_factory.mktemp("ref"), "ref")[1]


def test_transparent_under_data_parallel(tmp_path):
    """With no kill, the run with keepalive equals the same script without it, bit for bit (NumPy
    arrays with Keras' own shuffle: ResumableData is keepalive's, a script without it has none)."""
    _, ours = _run(tmp_path, "ours", "--data", "arrays")
    _, plain = _run(tmp_path, "plain", "--data", "arrays", "--callback", "none")
    differ, max_diff = _diff(ours, plain)
    assert not differ, f"keepalive changed an uninterrupted training: {differ[:4]}, max |diff| {max_diff:g}"


def test_sigkill_mid_epoch_resume_is_bit_exact(tmp_path, reference):
    """Killed after a checkpoint inside an epoch (and once more at random), re-run until done: every
    variable, the optimizer's state and the History equal the uninterrupted run's."""
    rep, crashed = _run(tmp_path, "crash", kills=2, seed=3)
    resumed = [t.resumed_step for t in rep.trials[1:]]
    assert resumed[0] is not None and resumed[0] % STEPS_PER_EPOCH, rep.trials  # resumed inside an epoch
    differ, max_diff = _diff(reference, crashed)
    assert not differ, f"{len(differ)} arrays differ (e.g. {differ[:4]}); max |diff| {max_diff:g}"
    print(f"\nkeras jax DataParallel(8): kills after steps {[t.killed_after_step for t in rep.trials[:-1]]}, "
          f"resumed at {resumed}, bit-identical")


def test_control_without_the_data_position_differs(tmp_path, reference):
    """The comparison can fail: the same kill, resumed with the epoch's position dropped."""
    rep, crashed = _run(tmp_path, "control", "--no-position", kills=1, seed=3)
    assert rep.trials[1].resumed_step % STEPS_PER_EPOCH, rep.trials
    differ, max_diff = _diff(reference, crashed)
    assert differ, "resumed without its data position, yet bit-identical"
    print(f"\ncontrol (position dropped, resumed at step {rep.trials[1].resumed_step}): {len(differ)} arrays "
          f"differ, max |diff| {max_diff:.3g}")

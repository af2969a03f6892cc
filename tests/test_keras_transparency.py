"""Keras 3 on the JAX backend (the TPU runtimes' default), a PyDataset that augments with NumPy's global
generator and a model built at the first step: adding ``DriveCheckpoint`` changes nothing in the
training, bit for bit. keepalive looks at one batch of the input to build the model before the first
step (a checkpoint is loaded into variables that exist); the user's ``__getitem__`` draws noise then,
so keepalive puts every global generator back after that look. Negative control: without putting
them back, the training differs. Each run is a child process of tests/scripts/keras_peek_train.py."""
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("keras")
pytest.importorskip("jax")

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_peek_train.py")
ENV = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", KEEPALIVE_PROGRESS="0",
           JAX_PLATFORMS="cpu")


def _train(tmp, name, *extra):
    out = tmp / f"{name}.npz"
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *extra], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def without(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"), "plain")


def _differing(a, b):
    return sorted(k for k in a if k != "calls" and not np.array_equal(a[k], b[k]))


def test_an_augmenting_pydataset_trains_the_same_with_keepalive(tmp_path, without):
    got = _train(tmp_path, "with", "--run", str(tmp_path / "run"))
    assert _differing(without, got) == []
    # the look at one batch is one more call of __getitem__, and nothing else
    assert int(got["calls"]) == int(without["calls"]) + 1


def test_control_the_look_without_putting_the_generators_back_differs(tmp_path, without):
    got = _train(tmp_path, "control", "--run", str(tmp_path / "run"), "--control")
    assert _differing(without, got), "the control trained the same: the test could not fail"

"""JAX / Flax trainings killed mid-epoch and resumed: bit-identical to a run without keepalive.

Each test runs tests/scripts/jax_train.py (a top-level loop, as a notebook cell or script has it) in
child processes: a run without keepalive (the reference), the same with keepalive and no kill
(transparency), runs that SIGKILL themselves at planned batches (right after the first checkpoint, in the
middle of an epoch) and re-runs that resume; the final weights, optimizer state, metrics, the loop's key
and the logged history must equal the reference's array for array. Each has a negative control: the
piece of keepalive that makes the resume exact switched off gives a different result.

Shapes: the Flax NNX MNIST tutorial's (a CNN with dropout through ``nnx.Rngs``, ``nnx.Optimizer``,
``nnx.MultiMetric``, a Grain ``DataLoader`` with shuffle); a Linen ``TrainState`` fed by a torch
``DataLoader`` with the loop's PRNG key a top-level variable; the NNX shape on 8 host devices with a
data-parallel mesh.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Dict, List

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "jax_train.py")
#: the plain run, then the same with keepalive, in one interpreter (each a fresh __main__: the loop at its top level)
TWICE = ("import runpy, sys\n"
         "for argv in {argvs!r}:\n"
         "    sys.argv = argv\n"
         "    runpy.run_path(argv[0], run_name='__main__')\n")
EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
#: the children compile the same train steps again and again (each shape's, every run): XLA's persistent
#: compilation cache, shared by this module's children, compiles each once. The cached executable is the
#: one a compile makes (its results bit-identical), so every comparison stands.
#: Removed when the test process ends. (Not for tests/test_jax_notice.py's children, which take _env:
#: they compile little that another child compiled, and filling the cache cost them more CPU than it saved.)
JAX_CACHE = tempfile.mkdtemp(prefix="keepalive-tests-jax-cache-")
atexit.register(shutil.rmtree, JAX_CACHE, True)
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": JAX_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _env(extra: Dict[str, str]) -> Dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)


def _run(args: List[str], *, killed: bool = False, env: Dict[str, str] = {}) -> str:  # noqa: B006 - read only
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=_env({**CACHE_ENV, **env}), timeout=300)
    output = proc.stdout + proc.stderr
    expected = -signal.SIGKILL if killed else 0
    assert proc.returncode == expected, f"ended {proc.returncode}, not {expected}:\n{output[-3000:]}"
    return output


def _plain_and_with(tmp_path, shape: str, env: Dict[str, str] = {}) -> None:  # noqa: B006 - read only
    """``plain.npz`` (no keepalive) and ``with.npz`` (keepalive, no kill), in one interpreter."""
    argvs = [[SCRIPT, "--shape", shape, "--out", str(tmp_path / "plain.npz"), "--plain"],
             [SCRIPT, "--shape", shape, "--out", str(tmp_path / "with.npz"), "--run", str(tmp_path / "transparent")]]
    proc = subprocess.run([sys.executable, "-c", TWICE.format(argvs=argvs)], capture_output=True, text=True,
                          env=_env({**CACHE_ENV, **env}), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _load(path) -> Dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _max_delta(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    """The largest difference of two results' arrays of the same shape (a history of another length:
    infinite)."""
    assert sorted(a) == sorted(b)
    if any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max(initial=0)) for k in a)


def _weights_delta(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    """:func:`_max_delta` of the trained state's floating-point arrays (no history, no key data)."""
    def floats(d: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        return {k: v for k, v in d.items() if v.dtype.kind == "f" and not k.startswith("history/")}
    return _max_delta(floats(a), floats(b))


def _same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not np.array_equal(a[k], b[k])]
    assert not differ, f"{len(differ)} arrays differ, e.g. {differ[:3]} (max |delta| {_max_delta(a, b)})"


def test_nnx_mnist_shape_killed_after_first_checkpoint_and_mid_epoch(tmp_path):
    """Flax NNX, Grain loader: killed right after the first checkpoint (step 4, inside epoch 0) and
    again inside epoch 1 (step 9, one step after its newest checkpoint); the third run ends exactly as
    an uninterrupted run without keepalive. Control: the Grain position not put back."""
    _plain_and_with(tmp_path, "nnx")
    plain = _load(tmp_path / "plain.npz")
    _same(plain, _load(tmp_path / "with.npz"))  # transparent
    run, out = tmp_path / "run", str(tmp_path / "res.npz")
    base = ["--shape", "nnx", "--run", str(run), "--out", out]
    _run([*base, "--kill-at", "0:4"], killed=True)
    second = _run([*base, "--kill-at", "1:3"], killed=True)
    assert "in epoch 0 after 4 batches, step 4" in second
    shutil.copytree(run, tmp_path / "control")
    third = _run(base)
    assert "in epoch 1 after 2 batches, step 8" in third
    _same(plain, _load(out))
    assert plain["history/h"].shape == (2, 3)  # loss and accuracy of each epoch: logged across the kills
    # (the script's other control, --control no-rngs, differs too: max |delta| 0.043 when measured)
    ctl_out = str(tmp_path / "control.npz")
    _run(["--shape", "nnx", "--run", str(tmp_path / "control"), "--out", ctl_out, "--control", "no-data-state"])
    delta = _weights_delta(plain, _load(ctl_out))
    print(f"control no-data-state: max |delta| of the weights {delta:.3g}")
    assert delta > 0


def test_linen_train_state_torch_loader_killed_mid_epoch(tmp_path):
    """A Linen TrainState handed over with ckpt.update(state), a torch DataLoader(shuffle=True), the
    loop's PRNG key ``rng`` split every step at the top level: killed inside epoch 1, resumed exact.
    Control: the loop's variables not kept (``rng`` starts again from the code's value)."""
    _plain_and_with(tmp_path, "linen")
    plain = _load(tmp_path / "plain.npz")
    _same(plain, _load(tmp_path / "with.npz"))
    run, out = tmp_path / "run", str(tmp_path / "res.npz")
    base = ["--shape", "linen", "--run", str(run), "--out", out]
    _run([*base, "--kill-at", "1:3"], killed=True)
    shutil.copytree(run, tmp_path / "control")
    resumed = _run(base)
    assert "in epoch 1 after 2 batches, step 8" in resumed
    _same(plain, _load(out))
    ctl_out = str(tmp_path / "control.npz")
    _run(["--shape", "linen", "--run", str(tmp_path / "control"), "--out", ctl_out, "--control", "no-loop-vars"])
    delta = _weights_delta(plain, _load(ctl_out))
    print(f"control no-loop-vars: max |delta| of the weights {delta:.3g}")
    assert delta > 0


def test_nnx_data_parallel_mesh_on_8_host_devices_killed_mid_epoch(tmp_path):
    """The NNX shape on a data-parallel mesh of 8 host devices (batches sharded on 'data', state
    replicated): transparent, and killed inside epoch 1, resumed exact with the state on its mesh."""
    _plain_and_with(tmp_path, "mesh", EIGHT)
    plain = _load(tmp_path / "plain.npz")
    _same(plain, _load(tmp_path / "with.npz"))
    run, out = tmp_path / "run", str(tmp_path / "res.npz")
    base = ["--shape", "mesh", "--run", str(run), "--out", out]
    _run([*base, "--kill-at", "1:3"], killed=True, env=EIGHT)
    resumed = _run(base, env=EIGHT)
    assert "in epoch 1 after 2 batches, step 8" in resumed
    _same(plain, _load(out))


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")

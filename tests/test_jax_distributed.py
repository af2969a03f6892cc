"""A 2-process ``jax.distributed`` training (127.0.0.1, CPU, a 4-device global mesh), its sharded state
through Orbax inside keepalive's checkpoints: one process SIGKILLed mid-epoch, both re-run, resumed
bit-identical to an uninterrupted 2-process run without keepalive; with keepalive and no kill, the
same (transparent); a resume that puts the checkpoint's arrays back nowhere differs (negative control).

The script (tests/scripts/jax_dist_train.py) trains an NNX MLP whose weights and Adam moments are
sharded over both processes' devices (no process holds them whole): they go through Orbax, the rest
(counters, random states, the data position) through keepalive's own files, one manifest for both.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np
import pytest

from servers import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "jax_dist_train.py")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")


def _pair(run: str, out: str, *extra: str, killed: bool = False, stopped: bool = False) -> List[str]:
    """Both processes of one training; their outputs. ``killed``: process 1 SIGKILLs itself, process 0
    (then failed by JAX's coordination service, or stuck in a collective) is ended here by its PID.
    ``stopped``: process 1 got a SIGTERM (it ends with the signal's status after the save), process 0
    stopped with it (with that status, or 0)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, SCRIPT, run, out, "--process", str(i), "--port", str(port), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
             for i in (0, 1)]
    try:
        outputs = [""] * 2
        outputs[1] = procs[1].communicate(timeout=120)[0]
        if killed:
            assert procs[1].returncode == -signal.SIGKILL, outputs[1][-3000:]
            deadline = time.monotonic() + 5
            while procs[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if procs[0].poll() is None:
                procs[0].kill()
        outputs[0] = procs[0].communicate(timeout=120)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if stopped:
        terminated = (-signal.SIGTERM, 128 + signal.SIGTERM)
        assert procs[1].returncode in terminated and procs[0].returncode in (0, *terminated), outputs
        assert not any("DONE" in text for text in outputs), outputs  # every process stopped
    elif not killed:
        for proc, text in zip(procs, outputs):
            assert proc.returncode == 0 and "DONE" in text, text[-3000:]
    return outputs


def _load(path: str) -> Dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not np.array_equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} arrays differ: {different}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Dict[str, np.ndarray]:
    """The final weights and optimizer state of the 2-process run without keepalive."""
    where = tmp_path_factory.mktemp("plain")
    _pair(str(where / "run"), str(where / "plain.npz"), "--mode", "plain")
    out = _load(str(where / "plain.npz"))
    assert len(out) == 14  # 4 weights, 8 Adam moments, the Adam count and the step
    return out


def test_two_processes_killed_one_resume_exact_through_orbax(tmp_path, reference):
    run = str(tmp_path / "run")

    _pair(str(tmp_path / "transparent"), str(tmp_path / "with.npz"))
    _same(reference, _load(str(tmp_path / "with.npz")))

    _pair(run, str(tmp_path / "killed.npz"), "--kill-at", "8", killed=True)  # mid-epoch 2 (5 batches each)
    checkpoints = sorted(glob.glob(os.path.join(run, "ckpt-*", "MANIFEST.json")))
    assert checkpoints, "no checkpoint committed before the kill"
    manifest = json.load(open(checkpoints[-1]))
    names = [entry["name"] for entry in manifest["files"]]
    assert "tensors.safetensors" in names and any(n.startswith("orbax/ocdbt.process_1/") for n in names), names
    shutil.copytree(run, str(tmp_path / "control"))

    outputs = _pair(run, str(tmp_path / "resumed.npz"))
    assert "RESUMED True" in outputs[0] and "RESUMED True" in outputs[1]
    _same(reference, _load(str(tmp_path / "resumed.npz")))

    _pair(str(tmp_path / "control"), str(tmp_path / "control.npz"), "--control")
    control = _load(str(tmp_path / "control.npz"))
    assert any(not np.array_equal(reference[k], control[k]) for k in reference), \
        "the negative control (no array put back) gave the reference's result: the test cannot fail"


def test_sigterm_on_one_process_saves_the_same_step_on_both_which_stop_and_resume_exact(tmp_path, reference):
    """A preemption reaches one host: every process saves the same step (one checkpoint, both processes'
    shards in it) and stops; the re-run is bit-identical to an uninterrupted run."""
    run = str(tmp_path / "run")
    _pair(run, str(tmp_path / "stopped.npz"), "--term-at", "7", "--every", "100", stopped=True)
    manifests = [json.load(open(m)) for m in glob.glob(os.path.join(run, "ckpt-*", "MANIFEST.json"))]
    assert [m["step"] for m in manifests] == [7]  # every=100 never fires: the signal's save alone
    assert manifests[0]["metadata"]["reason"] == "SIGTERM received"
    assert any(e["name"].startswith("orbax/ocdbt.process_1/") for e in manifests[0]["files"])
    outputs = _pair(run, str(tmp_path / "resumed.npz"), "--every", "100")
    assert "RESUMED True STEP 15" in outputs[0]
    _same(reference, _load(str(tmp_path / "resumed.npz")))


def test_process_group_checks_through_the_coordination_service(tmp_path):
    """keepalive's ProcessGroup under jax.distributed: active, ranks, a check-in both reach, a run folder
    both see; a folder each process has its own copy of is refused on both, a save reached by one
    process only is said there, naming the other."""
    outputs = _pair(str(tmp_path), str(tmp_path / "unused.npz"), "--mode", "group")
    for rank, text in enumerate(outputs):
        assert f"GROUP True {rank} 2" in text and "SHARED shared" in text, text[-2000:]
        assert "OWN the run folder is not shared between the ranks" in text, text[-2000:]
    assert "MISUSE save() was called on rank 1 only: rank 0 did not call it within 1 s" in outputs[1], outputs[1]

"""Lightning Fabric on 2 processes (gloo, CPU): what ``fabric.setup`` and ``fabric.setup_dataloaders``
return goes to keepalive's torch ``DriveCheckpoint`` as it is (tests/scripts/fabric_train.py):

* with keepalive and no kill, both ranks end bit-identical to the same script without keepalive;
* rank 1 SIGKILLed in epoch 1 (before step 17, the save of step 15 committed), the job killed, a new
  job started: it resumes at step 15 and both ranks end bit-identical to the uninterrupted run;
* negative control: the same resume with the loader's recorded ``iter()`` count dropped (Fabric then
  sets epoch 0 on the ``DistributedSampler`` for the resumed epoch 1) ends different.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
if importlib.util.find_spec("lightning") is None:  # pragma: no cover - imported by the children only
    pytest.skip("lightning is not installed", allow_module_level=True)

from crashkit import assert_differs, assert_same  # noqa: E402
from torchrunkit import LIGHTNING_CHILD_SETUP, ROOT, TorchrunJob, finish, forked_ranks, killed  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "fabric_train.py")
KILL = "1:17:15"
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")
#: lightning imports torchvision: the test machine's shim (tests/shims)
ENV = {"PYTHONPATH": os.path.join(HERE, "shims")}


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    """torchrun's agent and ranks fork from a server that has imported torch and Fabric, with the ranks'
    PYTHONPATH (TorchrunJob's: this checkout, then ENV's)."""
    pythonpath = os.pathsep.join(p for p in (ROOT, ENV["PYTHONPATH"], os.environ.get("PYTHONPATH", "")) if p)
    with forked_ranks(["torch", "torch.distributed", "torch.utils.data", "lightning.fabric"], pythonpath,
                      LIGHTNING_CHILD_SETUP):
        yield


def finals(job: TorchrunJob) -> List[Dict[str, "torch.Tensor"]]:
    return [torch.load(os.path.join(job.out_dir, f"final.{r}.pt")) for r in (0, 1)]


def test_fabric_objects_two_processes_transparent_and_exact_after_a_kill_mid_epoch(tmp_path):
    plain = TorchrunJob(tmp_path, "plain", SCRIPT, env=dict(ENV, FAB_PLAIN="1"))
    ref = TorchrunJob(tmp_path, "ref", SCRIPT, env=ENV)
    crash = TorchrunJob(tmp_path, "crash", SCRIPT, env=dict(ENV, FAB_KILL=KILL))
    try:
        first = killed(crash, 1)
        ref_text = finish(ref)
        finish(plain)
    finally:
        for job in (plain, ref, crash):
            job.stop()
    assert "KILL rank 1 before step 17" in first and "DONE" not in first, first[-4000:]
    reference = finals(ref)
    for rank, (with_ka, without) in enumerate(zip(reference, finals(plain))):
        assert_same(without, with_ka, f"rank {rank} with keepalive vs without")

    control_dir = str(tmp_path / "control-run")
    shutil.copytree(crash.run_dir, control_dir)
    again = TorchrunJob(tmp_path, "again", SCRIPT, run_dir=crash.run_dir, env=ENV)
    control = TorchrunJob(tmp_path, "control", SCRIPT, run_dir=control_dir, env=dict(ENV, FAB_CONTROL="no-counters"))
    try:
        second = finish(again)
        controlled = finish(control)
    finally:
        again.stop()
        control.stop()
    for text in (second, controlled):
        assert [int(s) for s in RESUME_RE.findall(text)] == [15], text[-4000:]
    for text in (ref_text, first, second):
        assert "epoch ends only" not in text and "not bit-exact" not in text, text[-4000:]
    resumed = finals(again)
    for rank in (0, 1):
        assert_same(reference[rank], resumed[rank], f"rank {rank} resumed vs uninterrupted")
    assert_differs(reference[0], finals(control)[0])

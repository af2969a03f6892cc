"""Accelerate's prepared loader on 2 processes (issue 21): a mid-epoch resume replays its shuffle.

``accelerator.prepare(DataLoader(ds, shuffle=True))`` on 2 gloo processes gives a ``DataLoaderShard``
(not a DataLoader: it poses as one and iterates the one it wraps, one batch ahead) whose
``RandomSampler`` draws from a generator Accelerate owns and broadcasts from rank 0 at each ``iter()``,
and which counts its epochs itself. The training (tests/scripts/accel_train.py, as Accelerate users
write it) runs under ``torchrun --nproc_per_node 2``:

* with keepalive and no kill, both ranks end bit-identical to the same script without keepalive;
* rank 1 SIGKILLed in epoch 1 (its 5th step, the save of step 15 committed), the whole torchrun job
  killed, and a new job started: both ranks end bit-identical to the uninterrupted run;
* negative control: the same resume with the generator states and sampler counters that keepalive
  recorded at the epoch's ``iter()`` dropped (the shuffle of the resumed epoch is then another one) ends
  different, so the comparison can fail.

A new job rather than ``--max-restarts`` (tests/test_accelerate.py restarts with it). Jobs run in their
own process sessions and are stopped by their process group.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("accelerate")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from crashkit import assert_differs, assert_same  # noqa: E402
from torchrunkit import TorchrunJob, finish, forked_ranks, killed  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "accel_train.py")
KILL = "1:17:15"  # rank 1, before step 17 (epoch 1: steps 13-24), once the save of step 15 is committed
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    """torchrun's agent and ranks fork from a server that has imported what the ranks import first."""
    with forked_ranks(["torch", "torch.distributed", "torch.utils.data", "accelerate", "accelerate.utils"]):
        yield


def finals(job: TorchrunJob) -> List[Dict[str, "torch.Tensor"]]:
    return [torch.load(os.path.join(job.out_dir, f"final.{r}.pt")) for r in (0, 1)]


def test_prepared_loader_two_processes_transparent_and_exact_after_a_kill_mid_epoch(tmp_path):
    # the three first jobs are independent: run them side by side
    plain = TorchrunJob(tmp_path, "plain", SCRIPT, env={"ACCEL_PLAIN": "1"})
    ref = TorchrunJob(tmp_path, "ref", SCRIPT)
    crash = TorchrunJob(tmp_path, "crash", SCRIPT, env={"ACCEL_KILL": KILL})
    try:
        first = killed(crash, int(KILL.split(":")[0]))
        ref_text = finish(ref)
        finish(plain)
    finally:
        for job in (plain, ref, crash):
            job.stop()
    # (the victim waited for the save of step 15 on the store; the resumes below start there)
    assert "KILL rank 1 before step 17" in first and "DONE" not in first, first[-4000:]
    reference = finals(ref)
    assert_same(reference[0], reference[1], "the replicas")  # DDP keeps them equal
    for rank, (with_ka, without) in enumerate(zip(reference, finals(plain))):
        assert_same(without, with_ka, f"rank {rank} with keepalive vs without")

    # the negative control resumes a copy of the same killed run
    control_dir = str(tmp_path / "control-run")
    shutil.copytree(crash.run_dir, control_dir)
    again = TorchrunJob(tmp_path, "again", SCRIPT, run_dir=crash.run_dir)
    control = TorchrunJob(tmp_path, "control", SCRIPT, run_dir=control_dir,
                          env={"ACCEL_CONTROL": "no-replay"})
    try:
        second = finish(again)
        controlled = finish(control)
    finally:
        again.stop()
        control.stop()
    for text in (second, controlled):
        assert [int(s) for s in RESUME_RE.findall(text)] == [15], text[-4000:]  # said by rank 0
    for text in (ref_text, first, second):
        assert "epoch ends only" not in text and "not bit-exact" not in text, text[-4000:]
        assert "not bit-identical" not in text and "another random state" not in text, text[-4000:]
    resumed = finals(again)
    for rank in (0, 1):
        assert_same(reference[rank], resumed[rank], f"rank {rank} resumed vs uninterrupted")
    assert_differs(reference[0], finals(control)[0])

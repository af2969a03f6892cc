"""Torchrun restarts with the process group created by the framework, not by keepalive: the
restart-safe rendezvous that ``import keepalive`` installs (keepalive/rendezvous.py).

* two torchrun agents of one process each on 127.0.0.1 (what two machines do: ``--nnodes=2``, one c10d
  rendezvous, a shared run folder), the group created by torch's own ``dist.init_process_group``, by
  Accelerate's ``Accelerator(cpu=True)``, by accelerate's ``PartialState`` (what the HF Trainer makes) or
  by Lightning Fabric's DDP strategy; the worker of ONE node SIGKILLs itself after a commit; both
  agents restart their workers (only the failed node's ``TORCHELASTIC_RESTART_COUNT`` moves, the trap
  of a prefix named by it); the job resumes at the committed step and ends bit-identical on both ranks
  to an uninterrupted run without keepalive;
* one agent of two processes, the group made by ``Accelerator()``, a rank SIGKILLed: it resumes.

Every job runs under a hard timeout (agents stopped by their process group). Negative control, seen
while this was built and left out of the suite because it is a race: with keepalive imported only
after the group exists, a restarted attempt can read the dead attempt's peer address ("Gloo
connectFullMesh failed ... Connection refused") and fail attempt after attempt, or pass when the new
peer's address lands first. The store-level control (torch's own handler hands a new attempt the old
keys) is in tests/test_rendezvous.py.

The training is tests/scripts/multinode_train.py.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torchrunkit import MultiNodeJob, TorchrunJob, forked_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "multinode_train.py")
TOTAL = 24  # 2 epochs of 12 steps per rank
KILL = "1:8:6"  # rank 1 dies before step 8, once step 6's checkpoint is committed
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")
#: a job that hangs is stopped after this (a restart costs a few seconds; a hang costs them all)
JOB_TIMEOUT = 240.0


@pytest.fixture(scope="module", autouse=True)
def agents_forked():
    """torchrun's agents fork from a server that has imported torch; the ranks stay fresh interpreters
    (what their imports do, keepalive's before torch's, is this file's subject)."""
    with forked_ranks(["torch"], ranks=False):
        yield


def finals(out_dir: str) -> List[Dict[str, "torch.Tensor"]]:
    return [torch.load(os.path.join(out_dir, f"final.{r}.pt")) for r in (0, 1)]


def same_weights(a: Dict[str, "torch.Tensor"], b: Dict[str, "torch.Tensor"]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted two-process run without keepalive: the final weights of both ranks."""
    job = TorchrunJob(tmp_path_factory.mktemp("mn"), "reference", SCRIPT, env={"MN_PLAIN": "1"})
    try:
        assert job.wait(JOB_TIMEOUT) == 0, job.text()
    finally:
        job.stop()
    weights = finals(job.out_dir)
    assert same_weights(weights[0], weights[1])
    return weights


def assert_resumed_exactly(text: str, out_dir: str, reference) -> None:
    assert "KILL rank 1 before step 8" in text, text
    resumed = [int(s) for s in RESUME_RE.findall(text)]
    assert resumed and resumed[0] >= 6, text  # at or after the commit made before the kill
    assert f"DONE rank 0 step {TOTAL}" in text and f"DONE rank 1 step {TOTAL}" in text, text
    weights = finals(out_dir)
    for rank in (0, 1):
        assert same_weights(weights[rank], reference[rank]), f"rank {rank} differs from the reference"


#: who creates the group: torch, Accelerate, the HF Trainer (its TrainingArguments make accelerate's
#: PartialState) and Lightning (Fabric's DDP strategy, the Trainer's code path)
@pytest.mark.parametrize("init", ["torch", "accelerate", "partialstate", "fabric"])
def test_two_agents_restart_after_one_nodes_worker_is_killed(tmp_path, reference, init):
    env = {"MN_INIT": init, "MN_KILL": KILL, "MN_SURVIVOR_WAITS": "1"}
    if init == "fabric":  # lightning imports torchvision: the test machine's shim (tests/shims)
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "shims"), os.path.dirname(HERE),
                                             os.path.join(HERE, "scripts")])
    job = MultiNodeJob(tmp_path, f"two-nodes-{init}", SCRIPT, env=env)
    codes = job.wait(JOB_TIMEOUT)
    text = job.text()
    assert codes == [0, 0], f"agents' exit codes {codes} (None: still running after {JOB_TIMEOUT} s):\n{text}"
    # both nodes' workers started again; only the failed node's agent counted a restart
    counts = sorted(re.findall(r"^\[node \d\] START rank \d start 1 restart_count (\d+)$", text, re.M))
    assert counts == ["0", "1"], text
    assert_resumed_exactly(text, job.out_dir, reference)


def test_one_agent_restart_with_accelerates_group(tmp_path, reference):
    job = TorchrunJob(tmp_path, "one-node-accelerate", SCRIPT, restarts=2,
                      env={"MN_INIT": "accelerate", "MN_KILL": KILL})
    try:
        assert job.wait(JOB_TIMEOUT) == 0, job.text()
    finally:
        job.stop()
    assert "START rank 1 start 1 restart_count 1" in job.text(), job.text()
    assert_resumed_exactly(job.text(), job.out_dir, reference)

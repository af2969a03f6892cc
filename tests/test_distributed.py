"""DDP: the same DriveCheckpoint under ``torchrun --nproc_per_node=2`` (gloo, CPU).

* ranks SIGKILLed at random moments (inside saves too), the job restarted by torchrun's elastic agent
  each time: the final weights of every rank are bit-identical to an uninterrupted run; every
  checkpoint that verifies holds every rank's part; a resume never goes back past a committed save;
* a negative control (every rank resumes with rank 0's part) differs: the per-rank state matters;
* SIGTERM reaching one rank: one global save, then every rank stops;
* 2 -> 1 processes: loads, warns that the run is not bit-identical, continues by global sample.

The training is tests/scripts/ddp_train.py. Processes are started here and stopped by their PIDs.
"""
from __future__ import annotations

import os
import random
import re
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from keepalive import distributed as kd  # noqa: E402
from keepalive.resume import read_state  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402
from servers import free_port  # noqa: E402  (tests/servers.py)
from torchrunkit import TorchrunJob, forked_ranks, kill_ranks_at_random, python_command  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "ddp_train.py")
EPOCHS, STEPS_PER_EPOCH = 3, 12  # 96 samples, batch 4, 2 ranks
TOTAL = EPOCHS * STEPS_PER_EPOCH
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got


# ------------------------------------------------------------------------------- in-process parts
def test_localize_takes_own_part_and_reshards_by_global_sample():
    tree = {"objects": {"m": 1}, "rng": "r0", "data": {"position": 8},
            kd.RANKS_KEY: [{"rng": "r0", "data": {"position": 8}}, {"rng": "r1", "data": {"position": 8}}]}
    same, note = kd.localize(tree, 1, 2)
    assert note is None and same["rng"] == "r1" and kd.RANKS_KEY not in same
    one, note = kd.localize(tree, 0, 1)
    assert note and "2 process(es), this run has 1" in note and "not bit-identical" in note
    assert one["data"]["position"] == 16 and one["data"]["resharded"]["global_sample"] == 16


def test_no_process_group_is_a_group_of_one():
    group = kd.ProcessGroup()
    assert not group.active and group.rank == 0 and group.world_size == 1 and group.is_main
    agreed = group.agree(True, False, None)
    assert agreed.save and not agreed.stop and agreed.signal is None
    assert group.gather({"x": 1}) == [{"x": 1}]


# ----------------------------------------------------------------------------------- torchrun jobs
@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    """The ranks (and the notebook launch's process) fork from a server that has imported torch."""
    with forked_ranks(["torch", "torch.distributed", "torch.utils.data", "torch.multiprocessing"]):
        yield


class Job(TorchrunJob):
    """One ``torchrun --nproc_per_node=2`` job of the DDP script (or the notebook-style launch, or
    one plain process)."""

    def __init__(self, tmp, name: str, **kwargs):
        super().__init__(tmp, name, SCRIPT, **kwargs)

    def command(self, nproc: int, restarts: int) -> List[str]:
        if nproc == -2:  # the notebook launch: torch.multiprocessing.start_processes, 2 processes
            return [*python_command(SCRIPT), "--spawn", str(free_port()), self.run_dir, self.out_dir]
        if not nproc:  # one plain process, no process group
            return [*python_command(SCRIPT), self.run_dir, self.out_dir]
        return super().command(nproc, restarts)

    def finals(self) -> List[Dict[str, "torch.Tensor"]]:
        return [torch.load(os.path.join(self.out_dir, f"final.{r}.pt")) for r in (0, 1)]


def same_weights(a: Dict[str, "torch.Tensor"], b: Dict[str, "torch.Tensor"]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted two-rank run's final weights."""
    job = Job(tmp_path_factory.mktemp("ddp"), "reference")
    try:
        assert job.wait() == 0, job.text()
    finally:
        job.stop()
    finals = job.finals()
    assert same_weights(finals[0], finals[1])  # DDP keeps the replicas equal
    return finals


def committed_parts(run_dir: str) -> List[int]:
    """For every checkpoint of the run that verifies: how many ranks' parts it holds."""
    store = CheckpointStore(run_dir)
    parts = []
    for info in store.list():
        if store.verify(info).valid:
            state = read_state(info, store)
            parts.append(len(state.get(kd.RANKS_KEY) or []))
    return parts


def test_ranks_killed_at_random_resume_bit_exactly(tmp_path, reference):
    rng = random.Random(int(os.environ.get("KEEPALIVE_TEST_SEED", "16")))
    kills = 4
    job = Job(tmp_path, "killed", restarts=kills + 3,
              env={"DDP_SLOW_WRITE": "0.08", "DDP_STEP_SLEEP": "0.05", "DDP_KEEP": "0"})
    log, _ = kill_ranks_at_random(job, rng, kills, (0.2, 1.0), RESUME_RE)
    assert len(log) >= 3, f"only {len(log)} kills landed:\n{job.text()}"
    finals = job.finals()
    for rank in (0, 1):
        assert same_weights(finals[rank], reference[rank]), f"rank {rank} differs from the reference"
    # no checkpoint that verifies lacks a rank's part (keep=None: all of them are still there)
    parts = committed_parts(job.run_dir)
    assert parts and all(n == 2 for n in parts), parts


def test_with_keepalive_and_no_kill_equals_the_loop_without_it(tmp_path, reference):
    """The DDP tutorial loop (DistributedSampler + set_epoch, dropout) without keepalive ends with the
    reference's weights on both ranks; control: another dropout seed does not."""
    for name, env, same in (("plain", {"DDP_PLAIN": "1"}, True),
                            ("plain-other-seed", {"DDP_PLAIN": "1", "DDP_SEED": "4321"}, False)):
        job = Job(tmp_path, name, env=env)
        try:
            assert job.wait() == 0, job.text()
        finally:
            job.stop()
        finals = job.finals()
        for rank in (0, 1):
            assert same_weights(finals[rank], reference[rank]) is same, (name, rank)


def test_negative_control_rank0_state_for_all_ranks_differs(tmp_path, reference):
    job = Job(tmp_path, "broken", restarts=1, env={"DDP_SELF_KILL": "1:10", "DDP_BROKEN_RANKS": "1"})
    try:
        assert job.wait() == 0, job.text()
    finally:
        job.stop()
    assert RESUME_RE.search(job.text()), job.text()
    finals = job.finals()
    assert not same_weights(finals[0], reference[0]), "the control should differ: the test is blind"


def test_sigterm_on_one_rank_saves_once_then_all_stop_and_two_to_one_resume(tmp_path):
    job = Job(tmp_path, "term", env={"DDP_SIGTERM": "1:16", "DDP_EVERY": "100"})
    try:
        code = job.wait()
    finally:
        job.stop()
    text = job.text()
    assert code != 0 and "DONE" not in text, text  # every rank stopped
    assert "SIGTERM: saved in epoch 1 after 4 batches, step 16" in text, text
    store = CheckpointStore(job.run_dir)
    infos = store.list()
    assert [i.step for i in infos] == [16], [i.name for i in infos]  # one global save
    assert infos[0].manifest["metadata"]["reason"] == "SIGTERM received"
    assert infos[0].manifest["metadata"]["world_size"] == 2
    assert committed_parts(job.run_dir) == [2]

    # the same run resumed by one process: loads, says why it is not bit-exact, continues by
    # global sample (epoch 1 had 4 batches x 4 samples x 2 ranks = 32 samples done: 16 batches left)
    one = Job(tmp_path, "one", nproc=0, run_dir=job.run_dir)
    try:
        assert one.wait() == 0, one.text()
    finally:
        one.stop()
    text = one.text()
    assert "written by 2 process(es), this run has 1" in text and "not bit-identical" in text, text
    assert "resuming run" in text and "step 16" in text, text
    assert f"DONE rank 0 step {16 + 16 + STEPS_PER_EPOCH * 2}" in text, text


def test_notebook_launch_start_processes_resumes_when_the_cell_runs_again(tmp_path, reference):
    """The README's notebook recipe: a cell starts two processes with
    ``torch.multiprocessing.start_processes``; one is killed (the cell fails); running the cell again
    resumes, and the result is bit-identical to the uninterrupted torchrun job."""
    first = Job(tmp_path, "cell", nproc=-2, env={"DDP_SELF_KILL": "1:10"})
    try:
        assert first.wait() != 0, first.text()
    finally:
        first.stop()
    again = Job(tmp_path, "cell", nproc=-2, run_dir=first.run_dir)
    try:
        assert again.wait() == 0, again.text()
    finally:
        again.stop()
    assert RESUME_RE.search(again.text()), again.text()
    finals = again.finals()
    for rank in (0, 1):
        assert same_weights(finals[rank], reference[rank]), f"rank {rank} differs from the reference"


def test_deadline_on_one_rank_saves_once_and_stops_every_rank(tmp_path):
    job = Job(tmp_path, "deadline", env={"DDP_DEADLINE": "1:20", "DDP_EVERY": "100"})
    try:
        assert job.wait() != 0, job.text()  # stopped, not finished: the ranks exit 143 (EXIT_STOPPED)
    finally:
        job.stop()
    text = job.text()
    assert "STOPPED rank 0 step 20 exit 143" in text and "STOPPED rank 1 step 20 exit 143" in text, text
    assert "exitcode  : 143" in text and "DONE" not in text, text
    assert "stopping before the session ends: saved in epoch 1 after 8 batches, step 20" in text, text
    infos = CheckpointStore(job.run_dir).list()
    assert [i.step for i in infos] == [20], [i.name for i in infos]
    assert "another rank" in infos[0].manifest["metadata"]["reason"]  # rank 1's deadline, rank 0 wrote
    assert committed_parts(job.run_dir) == [2]

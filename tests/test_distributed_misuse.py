"""Distributed programs that use keepalive wrongly get one clear line, on time, and no hang:

* a save called on rank 0 only (the other rank exits, or waits in ``dist.barrier()``);
* ranks with different numbers of batches per epoch (no DistributedSampler): found at the first
  boundary, said by every rank, before DDP's gradient all-reduce mixes with keepalive's collective;
* run folders that are not shared between the ranks: refused at the first save;
* a SIGTERM save says why the ranks exit with 143; a rank that torchrun's agent stops after a peer
  died does not claim that it is "saving at the end of this step" (control: announced, it does);
* a warning every rank finds is said once (rank 0), a rank's own problem by that rank.

Every job runs under a hard timeout (``TorchrunJob.wait``). The jobs are started together at the
module's start (each is two ranks and an agent, mostly waiting), so the file takes as long as its
slowest job. The programs are tests/scripts/misuse_train.py.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Tuple

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from keepalive.store import CheckpointStore  # noqa: E402
from torchrunkit import TorchrunJob, forked_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "misuse_train.py")
TIMEOUT = 240.0  # seconds: a hang fails the test; every job here ends in far less


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    """torchrun's agent and ranks fork from a server that has imported what the ranks import first."""
    with forked_ranks(["torch", "torch.distributed", "torch.utils.data"]):
        yield

SAVE_HOW_TO = ("Call it on every rank, not inside `if rank == 0:`: keepalive gathers every rank's part of the "
               "state (its random state, its data position) and rank 0 alone writes the checkpoint")
UNEVEN = ("keepalive.distributed.DistributedMisuseError: the ranks have different numbers of batches per epoch "
          "(rank 0: 7; rank 1: 6): a rank with more batches would wait forever in a collective (DDP's gradient "
          "all-reduce) that the others never enter. Give the loader a DistributedSampler "
          "(torch.utils.data.distributed.DistributedSampler(dataset): every rank gets as many samples; "
          "drop_last=True drops the uneven tail instead of repeating samples) rather than splitting the data by "
          "rank yourself, or cut every rank's shard to the same number of batches; stopping every rank here")
SAVING_NOW = "SIGTERM received; saving at the end of this step, or now"

#: name -> (MISUSE, extra environment)
PROGRAMS: Dict[str, Tuple[str, Dict[str, str]]] = {
    "save-exit": ("save-on-rank0", {}),
    "save-barrier": ("save-on-rank0-barrier", {"MISUSE_CHECK_IN": "3"}),
    "uneven": ("uneven", {}),
    "folders": ("folders", {}),
    "sigterm": ("sigterm", {}),
    "teardown": ("teardown", {}),
    "teardown-control": ("teardown", {"MISUSE_ANNOUNCE_ALWAYS": "1"}),
    "warn": ("warn", {}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every program's job, started at once; each test waits for its own."""
    tmp = tmp_path_factory.mktemp("misuse")
    started = {name: TorchrunJob(tmp, name, SCRIPT, env=dict(extra, MISUSE=misuse))
               for name, (misuse, extra) in PROGRAMS.items()}
    try:
        yield started
    finally:
        for job in started.values():
            job.stop()


def finished(jobs, name: str) -> Tuple[int, str]:
    job = jobs[name]
    code = job.wait(TIMEOUT)  # an AssertionError with the output when it hangs
    return code, job.text()


def keepalive_errors(text: str) -> Dict[int, str]:
    """Per rank, the DistributedMisuseError line its traceback ended with."""
    return {int(rank): line for rank, line in
            re.findall(r"^\[rank(\d)\]: (keepalive\.distributed\.DistributedMisuseError: .*)$", text, re.M)}


def test_a_save_called_on_rank_0_only_is_told_in_one_line(jobs):
    code, text = finished(jobs, "save-exit")  # rank 1 exits without calling save()
    assert code != 0, text
    assert keepalive_errors(text) == {0: "keepalive.distributed.DistributedMisuseError: save() was called on "
                                         f"rank 0 only: rank 1 ended without calling it. {SAVE_HOW_TO}"}, text
    assert "Connection closed by peer" not in text, text

    code, text = finished(jobs, "save-barrier")  # rank 1 waits in dist.barrier(): said after the check-in time
    assert code != 0, text
    assert keepalive_errors(text) == {0: "keepalive.distributed.DistributedMisuseError: save() was called on "
                                         f"rank 0 only: rank 1 did not call it within 3 s. {SAVE_HOW_TO}"}, text


def test_ranks_with_different_numbers_of_batches_are_told_on_every_rank_at_the_first_boundary(jobs):
    code, text = finished(jobs, "uneven")
    assert code != 0, text
    assert keepalive_errors(text) == {0: UNEVEN, 1: UNEVEN}, text
    assert "EnforceNotMet" not in text and "STEP" not in text, text
    assert not CheckpointStore(jobs["uneven"].run_dir).list()  # found before anything was saved


def test_run_folders_not_shared_between_ranks_are_refused_at_the_first_save(jobs):
    code, text = finished(jobs, "folders")
    assert code != 0, text
    run = jobs["folders"].run_dir
    line = ("keepalive.distributed.DistributedMisuseError: the run folder is not shared between the ranks: rank 0 "
            f"writes checkpoints to {run}/rank0, which rank 1 cannot read through its own run folder (rank 1's is "
            f"{run}/rank1: FileNotFoundError); a restart there would find no checkpoint or another one. Give every "
            "rank the same run folder on storage every node mounts (a network file system, a bucket URL), not a "
            "node's local disk")
    assert keepalive_errors(text) == {0: line, 1: line}, text
    assert not CheckpointStore(os.path.join(run, "rank0")).list()  # refused before the first checkpoint
    assert not [n for n in os.listdir(os.path.join(run, "rank0")) if n.startswith(".keepalive-shared")]


def test_a_sigterm_save_says_why_the_ranks_exit_with_143(jobs):
    code, text = finished(jobs, "sigterm")
    assert code != 0, text
    run = jobs["sigterm"].run_dir
    assert (f"keepalive: SIGTERM: saved in epoch 0 after 5 batches, step 5 to {run}; exiting with code 143 "
            "(stopped by SIGTERM), not 0: the program did not run to its end, and only a failed exit makes "
            "torchrun --max-restarts or a job scheduler start it again, which resumes from this checkpoint\n") in text
    # both ranks stop after the one global save (the agent may stop the second before it exits itself)
    assert "exitcode  : 143" in text and "DONE" not in text, text
    assert [i.step for i in CheckpointStore(run).list()] == [3, 5]
    assert SAVING_NOW not in text, text  # said once saved, by rank 0


def test_a_rank_stopped_by_torchrun_after_a_peer_died_does_not_announce_a_save(jobs):
    code, text = finished(jobs, "teardown")
    assert code != 0 and "Sending process" in text and "closing signal SIGTERM" in text, text
    assert SAVING_NOW not in text, text
    code, text = finished(jobs, "teardown-control")  # the control: announced, it says so (wrongly)
    assert code != 0 and SAVING_NOW in text, text


def test_warnings_are_said_by_rank_0_and_a_ranks_own_by_that_rank(jobs):
    code, text = finished(jobs, "warn")
    assert code == 0, text
    assert text.count("keepalive: warning: every rank finds this\n") == 1, text
    assert text.count("keepalive: warning: rank 1: only rank 1 finds this\n") == 1, text

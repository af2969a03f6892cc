"""FSDP2 / DTensor state through torch.distributed.checkpoint, under ``torchrun
--nproc_per_node=2`` (gloo, CPU). The training is tests/scripts/fsdp_train.py (``fully_shard``,
AdamW, dropout, a shuffled DistributedSampler).

* ranks SIGKILLed at random moments (inside saves too: shard writes are slowed), the job restarted by
  torchrun's elastic agent: the final full weights (gathered from the shards) are bit-identical to an
  uninterrupted run; every checkpoint that verifies names every rank's shard file;
* a negative control (the sharded state is not restored on resume) differs;
* one rank killed while writing its shard: that save leaves a folder without manifest, every
  checkpoint ``keepalive verify`` calls valid has all shards, a flipped byte in a shard makes the
  resume fall back to the older checkpoint (saying so), and a missing shard makes one invalid;
* one rank's shard write failing (ENOSPC): no manifest for that save, one line saying so (rank 0
  names the rank), training goes on and the next saves commit;
* SIGTERM reaching one rank: one global save (both shards), every rank stops; the run resumes and ends
  bit-identical;
* to s3:// (moto): through the spool and its uploader; a new machine resumes from the bucket;
* 2 -> 1 processes: DCP reshards the model and optimizer, the message says it is not bit-identical.

Processes are started here and stopped by their PIDs / their own session.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

from keepalive.store import MANIFEST, CheckpointStore  # noqa: E402
from torchrunkit import TorchrunJob, forked_ranks, kill_ranks_at_random  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "fsdp_train.py")
ROOT = os.path.dirname(HERE)
STEPS_PER_EPOCH = 12  # 96 samples, batch 4, 2 ranks
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got


#: what every rank imports before its training (forked from a server that has: tests/torchrunkit.py)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.utils.data"]


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    with forked_ranks(PRELOAD):
        yield


class Job(TorchrunJob):
    """One ``torchrun --nproc_per_node=N`` job of the FSDP2 script."""

    def __init__(self, tmp, name: str, **kwargs):
        super().__init__(tmp, name, SCRIPT, **kwargs)

    def final(self) -> Dict[str, "torch.Tensor"]:
        return torch.load(os.path.join(self.out_dir, "final.pt"))


def run_job(tmp, name: str, **kwargs) -> Job:
    job = Job(tmp, name, **kwargs)
    try:
        job.wait()
    finally:
        job.stop()
    return job


def until_torn_down(job: Job, timeout: float = 150.0) -> None:
    """Until the job ends, or until rank 0 has said that the save its peer died in failed (so nothing
    it does later can commit that save) and torchrun has begun to stop the job for the dead rank: the
    survivor may then wait in keepalive's check-in for the dead peer, ignoring torchrun's SIGTERM (a
    preemption notice, deferred to a save), until torchrun SIGKILLs it 30 s later; that wait tells
    nothing here, the caller stops the job at once."""
    deadline = time.monotonic() + timeout
    while job.proc.poll() is None:
        text = job.text()
        if "sharded checkpoint write to" in text and "closing signal SIGTERM" in text:
            return
        assert time.monotonic() < deadline, f"the job did not end in {timeout} s:\n{text}"
        time.sleep(0.05)


def same_weights(a: Dict[str, "torch.Tensor"], b: Dict[str, "torch.Tensor"]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def shard_names(info) -> List[str]:
    return sorted(f["name"] for f in info.manifest["files"] if f["name"].endswith(".distcp"))


def valid_checkpoints(run_dir: str) -> list:
    store = CheckpointStore(run_dir)
    return [info for info in store.list() if store.verify(info).valid]


@pytest.fixture(scope="module")
def reference_job(tmp_path_factory) -> Job:
    """The uninterrupted two-rank run."""
    job = run_job(tmp_path_factory.mktemp("fsdp"), "reference")
    assert job.proc.returncode == 0, job.text()
    return job


@pytest.fixture(scope="module")
def reference(reference_job):
    """The uninterrupted two-rank run's final full weights."""
    return reference_job.final()


def test_the_sharded_model_and_optimizer_count_as_registered(reference_job):
    # saved through DCP rather than among the objects of rank 0's tensors, they are still registered:
    # a warning that the training changed them "and they are not in the checkpoint" would be noise
    assert "changed during the training" not in reference_job.text(), reference_job.text()


def test_close_joins_the_side_groups_threads(reference_job):
    # ckpt.close() destroys the gloo group keepalive's background writes use, so its threads end
    # there: left alive into interpreter exit, they aborted a finished job now and then (SIGABRT,
    # "terminate called without an active exception"; keepalive/dcp.py ShardedObjects.close).
    # Without that, the count stays the same (7 -> 7 here); with it, 3 threads fewer.
    counts = re.findall(r"THREADS rank (\d) (\d+) -> (\d+)", reference_job.text())
    assert sorted(r for r, _, _ in counts) == ["0", "1"], reference_job.text()
    for rank, before, after in counts:
        assert int(after) < int(before), f"rank {rank}: {before} native threads before close(), {after} after"


def test_ranks_killed_at_random_resume_bit_exactly(tmp_path, reference):
    rng = random.Random(int(os.environ.get("KEEPALIVE_TEST_SEED", "16")))
    kills = 3
    job = Job(tmp_path, "killed", restarts=kills + 3,
              env={"FSDP_SLOW_SHARD": "0.1", "FSDP_STEP_SLEEP": "0.05", "FSDP_KEEP": "0"})
    log, _ = kill_ranks_at_random(job, rng, kills, (0.2, 1.2), RESUME_RE)
    assert len(log) >= 2, f"only {len(log)} kills landed:\n{job.text()}"
    assert same_weights(job.final(), reference), "the resumed FSDP2 run differs from the reference"
    infos = valid_checkpoints(job.run_dir)
    assert infos and all(shard_names(i) == ["__0_0.distcp", "__1_0.distcp"] for i in infos)
    assert all(".metadata" in {f["name"] for f in i.manifest["files"]} for i in infos)


def test_negative_control_without_the_sharded_state_differs(tmp_path, reference):
    job = run_job(tmp_path, "broken", restarts=1, env={"FSDP_SELF_KILL": "1:10", "FSDP_BROKEN": "1"})
    assert job.proc.returncode == 0, job.text()
    assert RESUME_RE.search(job.text()), job.text()
    assert not same_weights(job.final(), reference), "the control should differ: the test is blind"


def test_rank_killed_while_writing_its_shard_leaves_no_valid_checkpoint_without_it(tmp_path):
    # rank 1 SIGKILLs itself inside its 3rd shard file (the save at step 9), no restart
    job = Job(tmp_path, "inshard", env={"FSDP_KILL_IN_SHARD": "1:3", "FSDP_SLOW_SHARD": "0.05"})
    try:
        until_torn_down(job)
    finally:
        job.stop()
    text = job.text()
    assert job.proc.returncode != 0 and "COMMITTED 6" in text and "COMMITTED 9" not in text, text
    names = sorted(n for n in os.listdir(job.run_dir) if n.startswith("ckpt-"))
    torn = [n for n in names if not os.path.exists(os.path.join(job.run_dir, n, MANIFEST))]
    assert torn and all(n.startswith("ckpt-0000000009-") for n in torn), names
    infos = valid_checkpoints(job.run_dir)
    assert [i.step for i in infos] == [3, 6]
    assert all(shard_names(i) == ["__0_0.distcp", "__1_0.distcp"] for i in infos)
    cli = [sys.executable, "-m", "keepalive", "verify", job.run_dir]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60)
    said = done.stdout + done.stderr
    assert [line.split("/")[-1] for line in said.splitlines() if line.startswith("OK ")] == [
        i.name for i in infos], said  # the two committed ones are OK, the torn one is not
    assert re.search(r"BAD .*ckpt-0000000009-\w+: no manifest", said), said
    # ls and status say how many processes wrote the run and that its state is in DCP shards
    listed = subprocess.run([sys.executable, "-m", "keepalive", "ls", job.run_dir], capture_output=True,
                            text=True, cwd=ROOT, timeout=60).stdout
    assert len(re.findall(r"unverified \(2 ranks, DCP shards\)", listed)) == 2, listed
    status = [sys.executable, "-m", "keepalive", "status", "--dir", str(tmp_path)]
    shown = subprocess.run(status, capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    assert re.search(r"inshard-run: 2 checkpoint\(s\), newest step 6, 0 epoch\(s\) done, 2 ranks, DCP shards",
                     shown), shown
    report = json.loads(subprocess.run(status + ["--json"], capture_output=True, text=True, cwd=ROOT,
                                       timeout=60).stdout)
    [run] = [r for r in report["runs"] if r["run"] == "inshard-run"]
    assert run["world_size"] == 2 and run["sharded"] == "dcp", run
    # a flipped byte in a shard of the newest: the resume falls back to the older one and says why
    shard = os.path.join(infos[-1].path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    again = run_job(tmp_path, "again", run_dir=job.run_dir, env={"FSDP_EPOCHS": "1"})
    said_again = again.text()
    assert again.proc.returncode == 0, said_again
    assert re.search(r"__0_0\.distcp fails its xxh3_64 checksum", said_again), said_again
    assert [int(s) for s in RESUME_RE.findall(said_again)] == [3], said_again
    # a shard missing from a committed checkpoint: verify calls it invalid, naming the file
    os.remove(os.path.join(valid_checkpoints(job.run_dir)[-1].path, "__1_0.distcp"))
    done = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0 and "__1_0.distcp is missing" in done.stdout + done.stderr, done.stdout


def test_one_rank_failing_to_write_its_shard_commits_nothing_says_so_and_trains_on(tmp_path, reference):
    # rank 1's 3rd shard file (the save at step 9) fails with ENOSPC; rank 0 wrote its shard
    job = run_job(tmp_path, "enospc", env={"FSDP_FAIL_SHARD": "1:3"})
    text = job.text()
    assert job.proc.returncode == 0, text
    committed = [int(m) for m in re.findall(r"^COMMITTED (\d+)$", text, re.M)]
    assert 9 not in committed and 6 in committed and 12 in committed, text
    # said once, on one line, by rank 0 for both ranks, naming the failed rank; the run goes on
    said = [line for line in text.splitlines() if "sharded checkpoint write to" in line]
    assert len(said) == 1 and "Traceback" not in text, text
    assert re.search(r"ShardWriteError: rank 1: OSError: \[Errno 28\] No space left .*no manifest written for "
                     r"step 9\).*training goes on", said[0]), said
    assert all(i.step != 9 for i in valid_checkpoints(job.run_dir))
    assert same_weights(job.final(), reference)


def test_to_a_bucket_through_the_spool_then_resumed_on_a_new_machine_from_the_bucket(tmp_path, reference):
    """s3:// (moto on 127.0.0.1): the shards go to this machine's spool, whose uploader sends each
    committed checkpoint on, manifest last; a rank dies; the spool is deleted (a new VM); the job
    resumes from the bucket (DCP reads the shards through fsspec) and ends bit-identical."""
    from servers import S3Server

    with S3Server() as s3:
        env = {"FSDP_STORAGE_OPTIONS": json.dumps(s3.storage_options), "KEEPALIVE_SPOOL": str(tmp_path / "spool"),
               "FSDP_EVERY": "4", "FSDP_KEEP": "0"}
        url = s3.url("fsdp-run")
        first = run_job(tmp_path, "first", run_dir=url, env=dict(env, FSDP_SELF_KILL="1:22"))
        assert first.proc.returncode != 0, first.text()
        store = CheckpointStore(url, storage_options=s3.storage_options)
        uploaded = [i for i in store.list() if store.verify(i).valid]
        assert uploaded and all(shard_names(i) == ["__0_0.distcp", "__1_0.distcp"] for i in uploaded), uploaded
        newest = max(i.step for i in uploaded)
        shutil.rmtree(tmp_path / "spool")  # a new machine: only the bucket is left
        second = run_job(tmp_path, "second", run_dir=url, env=env)
        text = second.text()
        assert second.proc.returncode == 0, text
        resumed = [int(m) for m in RESUME_RE.findall(text)]
        assert resumed == [newest] and newest >= 4, (newest, text)
        assert same_weights(second.final(), reference)


def test_sigterm_on_one_rank_saves_once_globally_then_all_stop_and_the_run_resumes_bit_exactly(tmp_path, reference):
    job = run_job(tmp_path, "term", env={"FSDP_SIGTERM": "1:16", "FSDP_EVERY": "100"})
    text = job.text()
    assert job.proc.returncode != 0 and "DONE" not in text, text  # every rank stopped
    assert "SIGTERM: saved in epoch 1 after 4 batches, step 16" in text, text
    infos = CheckpointStore(job.run_dir).list()
    assert [i.step for i in infos] == [16] and infos[0].manifest["metadata"]["reason"] == "SIGTERM received"
    assert shard_names(infos[0]) == ["__0_0.distcp", "__1_0.distcp"]
    again = run_job(tmp_path, "again", run_dir=job.run_dir, env={"FSDP_EVERY": "100"})
    assert again.proc.returncode == 0 and RESUME_RE.findall(again.text()) == ["16"], again.text()
    assert same_weights(again.final(), reference)


def test_two_to_one_process_reshards_and_says_so(tmp_path):
    # saves every 4 steps run in the background; the one at step 20 waits for the commit of 16
    first = run_job(tmp_path, "two", env={"FSDP_SELF_KILL": "1:21", "FSDP_EVERY": "4"})
    committed = [int(m) for m in re.findall(r"^COMMITTED (\d+)$", first.text(), re.M)]
    assert first.proc.returncode != 0 and max(committed) in (16, 20), first.text()
    saved = max(committed)
    one = run_job(tmp_path, "one", nproc=1, run_dir=first.run_dir)
    text = one.text()
    assert one.proc.returncode == 0, text
    assert "written by 2 process(es), this run has 1" in text and "not bit-identical" in text, text
    assert re.search(rf"resuming run .* step {saved}\b", text), text
    # epoch 1 (from step 12) had (saved - 12) batches x 4 samples x 2 ranks done; one process takes
    # the remaining samples of its 96 in batches of 4, then a whole epoch of 24 batches
    left = (96 - (saved - 12) * 8) // 4
    assert f"DONE rank 0 step {saved + left + 24}" in text, text

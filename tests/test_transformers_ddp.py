"""The Hugging Face ``Trainer`` on two processes (``torchrun --nproc_per_node=2``, gloo, CPU): checkpoints inside
epochs, one global commit, each rank resumed at its place in its shard of the batches.

The training is tests/scripts/hf_ddp.py: a tiny BERT from a config (random weights, dropout), random masking
while batches are made, accumulation 2, the Trainer creating the process group and accelerate sharding the
shuffled batches (``BatchSamplerShard``); 6 optimizer steps per epoch, 3 epochs.

* the positioned sampler yields, on every rank and in every epoch, exactly the batches accelerate's
  ``BatchSamplerShard`` gives that rank (drop_last, split_batches, the batches repeated to even the ranks out),
  and starts a resumed epoch at any of them;
* transparency: keepalive saving at every step, no kill, both ranks bit-identical to the run without it, and
  nothing said about epoch ends; one of its checkpoints inside an epoch, resumed on one process: refused in
  one line before anything loads;
* a random rank SIGKILLed inside an epoch, then inside a save, each job run again until done: both ranks'
  weights, optimizer states and log histories bit-identical to the run without keepalive; a resume lands inside
  an epoch (not at an epoch end);
* the same with two loader workers per rank making (masking) the batches;
* negative control: after the restart rank 1 reads rank 0's shard: the result differs.

A new ``torchrun`` job per kill (torchrun's own ``--max-restarts`` is another file's subject). Processes are
started here and stopped by their PIDs.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
accelerate_data = pytest.importorskip("accelerate.data_loader")

from hfkit import TORCHVISION_OPS  # noqa: E402
from keepalive.callbacks import _hf_data  # noqa: E402
from servers import free_port  # noqa: E402  (tests/servers.py)
from torchrunkit import forked_ranks, python_command, rank_entry, rank_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "hf_ddp.py")
STEPS_PER_EPOCH, TOTAL, EVERY = 6, 18, 2  # EVERY: the script's default save interval
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got
TIMEOUT = 240.0
#: the ranks' environment and what they import first: they fork from a server that has (tests/torchrunkit.py)
PYTHONPATH = os.pathsep.join([os.path.join(HERE, "scripts"), ROOT, os.path.join(HERE, "shims"),
                              os.environ.get("PYTHONPATH", "")])
RANK_ENV = {"KEEPALIVE_PROGRESS": "0", "TOKENIZERS_PARALLELISM": "false"}
PRELOAD = ["torch", "torch.distributed", "numpy", "transformers", "transformers.trainer", "transformers.training_args",
           "transformers.trainer_callback", "transformers.data.data_collator", "transformers.models.bert.modeling_bert",
           "tokenizers", "accelerate", "accelerate.data_loader"]


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    with forked_ranks(PRELOAD, PYTHONPATH, setup=TORCHVISION_OPS, env=RANK_ENV):
        yield


# ------------------------------------------------------------------------------------- in-process part
@pytest.mark.parametrize("n,batch,world,drop_last,split", [
    (88, 4, 2, False, False), (44, 4, 2, False, False), (45, 4, 3, False, False), (7, 4, 2, False, False),
    (45, 4, 3, True, False), (46, 4, 2, False, True), (45, 3, 2, False, False)])
def test_positioned_shard_yields_accelerates_batches_and_starts_anywhere(n, batch, world, drop_last, split):
    for rank in range(world):
        shard = {"num_processes": world, "process_index": rank, "split_batches": split, "even_batches": True}
        ours = _hf_data.PositionedBatchSampler(n, batch, drop_last, "seedable", 42, shard)
        theirs_inner = accelerate_data.SeedableRandomSampler(data_source=range(n), data_seed=42)
        theirs = accelerate_data.BatchSamplerShard(torch.utils.data.BatchSampler(theirs_inner, batch, drop_last),
                                                   num_processes=world, process_index=rank, split_batches=split)
        for epoch in (0, 1, 2):
            ours.set_epoch(epoch)
            theirs_inner.set_epoch(epoch)
            expected = list(theirs)
            assert list(ours) == expected and len(ours) == len(theirs) == len(expected), (rank, epoch)
            for start in (1, len(expected) - 1):
                ours.set_epoch(epoch)
                ours.start = ours.placeholders = start
                got = list(ours)
                assert all(isinstance(b, list) and not b for b in got[:start]) and got[start:] == expected[start:]


def test_uneven_shards_are_not_positioned():
    """``even_batches=False``: the ranks may train different numbers of steps (no common boundaries)."""
    loader = torch.utils.data.DataLoader(range(10), batch_size=4, shuffle=True)
    shard = accelerate_data.BatchSamplerShard(loader.batch_sampler, num_processes=2, process_index=0,
                                              even_batches=False)
    object.__setattr__(loader, "batch_sampler", shard)
    sampler, why = _hf_data.install(loader, 42)
    assert sampler is None and why == "several processes with even_batches=False: checkpoints at epoch ends only"


# ----------------------------------------------------------------------------------------- torchrun jobs
class Job:
    """One ``torchrun --nproc_per_node=2 hf_ddp.py`` job (no restarts), in its own process session."""

    def __init__(self, tmp, name: str, attempt: int = 0, nproc: int = 2, run_dir: Optional[str] = None,
                 **env: str):
        self.run_dir, self.out_dir = run_dir or str(tmp / f"{name}-run"), str(tmp / f"{name}-out")
        self.attempt = attempt
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **RANK_ENV, HFDDP_ATTEMPT=str(attempt),
                        PYTHONPATH=PYTHONPATH, **rank_env(), **env)
        cmd = [*python_command("-m"), "torch.distributed.run", f"--nproc_per_node={nproc}", "--max-restarts=0",
               "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               *rank_entry(SCRIPT), self.run_dir, self.out_dir]
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: List[str] = []
        self.seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            with self.seen:
                self.lines.append(line)
                self.seen.notify_all()
        self.proc.stdout.close()
        with self.seen:
            self.seen.notify_all()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, after: int = 0) -> Optional[Tuple[int, re.Match]]:
        """The first line from ``after`` on that matches (its index and match); None if the job ended first."""
        deadline = time.monotonic() + TIMEOUT
        regex = re.compile(pattern)
        i = after
        with self.seen:
            while True:
                while i < len(self.lines):
                    found = regex.search(self.lines[i])
                    if found:
                        return i, found
                    i += 1
                if self.proc.poll() is not None and self.proc.stdout is not None and self.proc.stdout.closed:
                    return None
                if time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"no line matching {pattern!r} in {TIMEOUT} s:\n{self.text()}")
                self.seen.wait(0.5)

    def pid(self, rank: int) -> int:
        path = os.path.join(self.out_dir, f"pid.{self.attempt}.{rank}")
        return int(open(path).read())

    def wait(self) -> int:
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job did not finish in {TIMEOUT} s:\n{self.text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session (start_new_session), by id
            self.proc.wait()

    def finals(self) -> List[Dict[str, object]]:
        return [torch.load(os.path.join(self.out_dir, f"final.{r}.pt")) for r in (0, 1)]


def run_job(tmp, name: str, **env: str) -> Job:
    job = Job(tmp, name, **env)
    try:
        assert job.wait() == 0, job.text()
    finally:
        job.stop()
    return job


def same(a: Dict[str, object], b: Dict[str, object]) -> bool:
    wa, wb = a["weights"], b["weights"]
    oa, ob = a["optimizer"], b["optimizer"]
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # type: ignore[union-attr,index]
            and oa.keys() == ob.keys()  # type: ignore[union-attr]
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])  # type: ignore[index]
            and a["logs"] == b["logs"] and a["step"] == b["step"] == TOTAL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The two ranks' final state of the run without keepalive."""
    job = run_job(tmp_path_factory.mktemp("hfddp"), "plain", HFDDP_MODE="plain")
    return job.finals()


def kill_and_rerun(tmp, name: str, kills: List[str], rng: random.Random, **env: str) -> Tuple[Job, List[tuple]]:
    """Run the job; in attempt ``a`` SIGKILL a random rank at the moment ``kills[a]`` names (``"mid-epoch"``: right
    after a commit inside an epoch, later than where the attempt resumed; ``"mid-save"``: while a checkpoint's files
    are written), then run a new job on the same run folder, until one ends. Returns the last job and, per kill,
    ``(rank, moment, step resumed at before it)``."""
    log: List[tuple] = []
    attempt = 0
    while True:
        job = Job(tmp, name, attempt=attempt, **env)
        try:
            if attempt < len(kills):
                start = job.wait_for(r"^ATTEMPT \d+$")
                assert start is not None, job.text()
                resumed = RESUME_RE.search(job.text())
                low = int(resumed.group(1)) if resumed else 0
                moment = kills[attempt]
                if moment == "mid-epoch":
                    inside = [s for s in range(low + 1, TOTAL - 1) if s % STEPS_PER_EPOCH and not s % EVERY]
                    step = rng.choice(inside)
                    found = job.wait_for(rf"^COMMITTED {step}$", start[0])
                else:
                    found = job.wait_for(r"^WRITING ", start[0])
                assert found is not None, job.text()
                victim = rng.choice((0, 1))
                os.kill(job.pid(victim), signal.SIGKILL)
                torn = [n for n in os.listdir(job.run_dir) if n.startswith("ckpt-")
                        and not os.path.exists(os.path.join(job.run_dir, n, "MANIFEST.json"))]
                log.append((victim, found[1].group(0), low, len(torn)))
                code = job.wait()
                assert code != 0, f"the job went on after rank {victim} was killed:\n{job.text()}"
            else:
                assert job.wait() == 0, job.text()
                print("kills (rank, at, resumed before, folders without manifest):", log)
                return job, log
        finally:
            job.stop()
        attempt += 1


@pytest.mark.slow
def test_with_keepalive_and_no_kill_equals_the_trainer_without_it(tmp_path, reference):
    job = run_job(tmp_path, "transparent", HFDDP_EVERY="1")
    text = job.text()
    assert len(re.findall(r"^COMMITTED \d+$", text, re.M)) >= TOTAL - 1, text  # a save at (nearly) every step
    assert "epoch ends only" not in text and "several processes" not in text, text
    for rank, final in enumerate(job.finals()):
        assert same(final, reference[rank]), f"rank {rank} differs from the run without keepalive"
    # the run on one process, from a checkpoint inside an epoch: refused before anything loads, in one line
    inside = os.path.join(str(tmp_path), "inside-run")
    shutil.copytree(job.run_dir, inside)
    for name in os.listdir(inside):
        if name.startswith("ckpt-") and int(name.split("-")[1]) > 8:
            shutil.rmtree(os.path.join(inside, name))
    one = Job(tmp_path, "one", nproc=1, run_dir=inside)
    try:
        assert one.wait() != 0, one.text()
    finally:
        one.stop()
    assert ("inside epoch 1 of a training on 2 process(es), where each one's batches are its shard of the "
            "epoch; this one runs on 1. Nothing was loaded. Launch it on 2 process(es) to continue the run, or "
            "start a new run (path or run=).") in one.text(), one.text()


@pytest.mark.slow
def test_random_rank_killed_mid_epoch_and_mid_save_resumes_bit_exactly(tmp_path, reference):
    rng = random.Random(int(os.environ.get("KEEPALIVE_TEST_SEED", "23")))
    job, log = kill_and_rerun(tmp_path, "killed", ["mid-epoch", "mid-save"], rng,
                              HFDDP_SLOW_WRITE="0.05", HFDDP_STEP_SLEEP="0.05")
    assert len(log) == 2, log
    resumed = [int(s) for s in RESUME_RE.findall(job.text())]
    assert resumed and resumed[-1] % STEPS_PER_EPOCH, f"the last resume is not inside an epoch: {resumed}"
    assert "11 batches per epoch" in job.text(), job.text()
    for rank, final in enumerate(job.finals()):
        assert same(final, reference[rank]), f"rank {rank} differs from the run without keepalive ({log})"


@pytest.mark.slow
def test_workers_make_the_batches_random_rank_killed_mid_epoch_resumes_bit_exactly(tmp_path):
    """Two loader workers per rank mask the batches: each worker's random state travels with its batches and
    the resumed epoch's workers start from the saved ones (per rank)."""
    reference = run_job(tmp_path, "plain-workers", HFDDP_MODE="plain", HFDDP_WORKERS="2").finals()
    job, log = kill_and_rerun(tmp_path, "workers", ["mid-epoch"], random.Random(7), HFDDP_WORKERS="2")
    resumed = [int(s) for s in RESUME_RE.findall(job.text())]
    assert resumed and resumed[-1] % STEPS_PER_EPOCH, f"the resume is not inside an epoch: {resumed}"
    for rank, final in enumerate(job.finals()):
        assert same(final, reference[rank]), f"rank {rank} differs from the run without keepalive ({log})"


@pytest.mark.slow
def test_negative_control_rank_one_in_rank_zeros_shard_differs(tmp_path, reference):
    job, _ = kill_and_rerun(tmp_path, "broken", ["mid-epoch"], random.Random(5), HFDDP_MODE="broken")
    assert RESUME_RE.search(job.text()), job.text()
    assert not same(job.finals()[1], reference[1]), "the control should differ: the test is blind"

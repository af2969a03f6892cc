"""Lightning ``Trainer(strategy="ddp", devices=2)`` with the Lightning DriveCheckpoint on 2 gloo processes.

The fit (tests/scripts/lightning_ddp.py, as Lightning users write it: ``DistributedSampler`` added by
Lightning, dropout, noise from each rank's own RNG in the dataset, validation inside the epoch, a per-step
LR schedule) runs under ``torchrun --nproc_per_node=2``; Lightning detects torchrun's environment and
creates the process group itself:

* with keepalive and no kill, both ranks end bit-identical to the same fit without keepalive;
* rank 1 SIGKILLed inside epoch 1 (the save of step 15 committed), the whole job killed, a new job
  started: both ranks end bit-identical to the fit without keepalive (a mid-epoch resume);
* negative controls on a copy of the same killed run: a resume without the saved data position, and
  one where every rank takes rank 0's random state and data position, end different;
* a random rank sent SIGTERM: one save by all ranks, said once; then a random rank SIGKILLed at random
  steps and inside saves (slow writes; a kill as soon as a
  checkpoint folder has no manifest yet), a new job after each kill: every resume starts at or after
  the last commit before the kill, and both ranks end bit-identical to the fit without keepalive;
* the notebook's launch (``strategy="ddp_notebook"``: the training processes forked from the notebook's)
  resumes exactly after a rank kill (the model Lightning hands back to the notebook), with a control;
* sharded strategies and ``ddp_spawn`` are refused in one line.

A new job per kill rather than ``--max-restarts``: a restarted attempt of a job whose process group
Lightning created can hang on the previous attempt's rendezvous keys. Jobs run in their own process
sessions and are stopped by their process group.
"""
from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import sys
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "shims")


def _load_torchvision_shim():
    """The CUDA torchvision of this test machine needs its op schemas defined before it is imported
    (lightning imports it): the test-only shim of tests/shims, loaded under a private name."""
    spec = importlib.util.spec_from_file_location("_keepalive_tv_shim", os.path.join(SHIMS, "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
_load_torchvision_shim()
pl = pytest.importorskip("lightning.pytorch")

from crashkit import assert_differs, assert_same  # noqa: E402
from keepalive.callbacks import lightning as ka_lightning  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402
from torchrunkit import CLIENT, LIGHTNING_CHILD_SETUP, TorchrunJob, alive, finish, forked_ranks, killed, rank_env  # noqa: E402

SCRIPT = os.path.join(HERE, "scripts", "lightning_ddp.py")
#: the children import lightning (torchvision: the shim) and the scripts' helpers
PYTHONPATH = os.pathsep.join([SHIMS, os.path.join(HERE, "scripts"), os.path.dirname(HERE)])
KILL = "1:17:15"  # rank 1, before step 17 (epoch 1: steps 13-24), once the save of step 15 is committed
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got
TOTAL = 36  # 3 epochs of 12 steps


#: what every rank imports first (forked from a server that has: tests/torchrunkit.py)
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning.pytorch.loggers", "torch.utils.data"]


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    with forked_ranks(PRELOAD, PYTHONPATH, LIGHTNING_CHILD_SETUP):
        yield


class Job(TorchrunJob):
    """A torchrun job of the Lightning DDP script, its children with the shims on their path."""

    def command(self, nproc: int, restarts: int) -> List[str]:
        return ["env", f"PYTHONPATH={PYTHONPATH}", *super().command(nproc, restarts)]


def job(tmp, name: str, env: Optional[Dict[str, str]] = None, run_dir: Optional[str] = None) -> Job:
    return Job(tmp, name, SCRIPT, env=dict(env or {}, KEEPALIVE_PROGRESS="0"), run_dir=run_dir)


def finals(j: TorchrunJob) -> List[Dict[str, "torch.Tensor"]]:
    return [torch.load(os.path.join(j.out_dir, f"final.{r}.pt")) for r in (0, 1)]


class Reference:
    """The same fit without keepalive, started at once and waited for when its result is first needed
    (it runs beside the first test's jobs): both ranks' final weights and optimizer states."""

    def __init__(self, tmp):
        self.job = job(tmp, "plain", {"LDDP_PLAIN": "1"})
        self._finals: Optional[List[Dict[str, "torch.Tensor"]]] = None

    def __getitem__(self, rank: int) -> Dict[str, "torch.Tensor"]:
        if self._finals is None:
            finish(self.job)
            self._finals = finals(self.job)
            assert_same(self._finals[0], self._finals[1], "the replicas")  # DDP keeps them equal
        return self._finals[rank]

    def csv(self) -> str:
        self[0]
        return csv_log(self.job)


@pytest.fixture(scope="module")
def without_keepalive(tmp_path_factory):
    reference = Reference(tmp_path_factory.mktemp("lddp"))
    yield reference
    reference.job.stop()


@pytest.mark.slow  # 2-process jobs, two rounds
def test_ddp_transparent_and_exact_after_a_rank_kill_mid_epoch(tmp_path, without_keepalive):
    ref = job(tmp_path, "ref")
    crash = job(tmp_path, "crash", {"LDDP_KILL": KILL})
    try:
        first = killed(crash, int(KILL.split(":")[0]))
        ref_text = finish(ref)
    finally:
        ref.stop()
        crash.stop()
    assert "KILL rank 1 before step 17" in first and "DONE" not in first, first[-4000:]
    for rank, with_ka in enumerate(finals(ref)):
        assert_same(without_keepalive[rank], with_ka, f"rank {rank} with keepalive vs without")

    # the negative controls resume copies of the same killed run
    controls = {}
    for control in ("no-position", "rank0-parts"):
        controls[control] = str(tmp_path / f"{control}-run")
        shutil.copytree(crash.run_dir, controls[control])
    again = job(tmp_path, "again", run_dir=crash.run_dir)
    broken = [job(tmp_path, name, {"LDDP_CONTROL": name}, run_dir=run) for name, run in controls.items()]
    try:
        second = finish(again)
        broken_texts = [finish(b) for b in broken]
    finally:
        for j in [again, *broken]:
            j.stop()
    for text in (second, *broken_texts):
        # said by rank 0 only, inside epoch 1 (the position in each rank's shard)
        assert [int(s) for s in RESUME_RE.findall(text)] == [15], text[-4000:]
        assert "in epoch 1 after 3 batches" in text, text[-4000:]
    for text in (ref_text, first, second):
        assert "epoch ends only" not in text and "not bit-exact" not in text, text[-4000:]
        assert "not bit-identical" not in text, text[-4000:]
    for text in (ref_text, second):  # (in the killed job, rank 0 may see its peer's socket close)
        assert "Traceback" not in text, text[-4000:]
    resumed = finals(again)
    for rank in (0, 1):
        assert_same(without_keepalive[rank], resumed[rank], f"rank {rank} resumed vs without keepalive")
    for b in broken:
        assert_differs(without_keepalive[1], finals(b)[1])
    # the CSV log too: the epoch's self.log accumulators are each rank's own (synced at the epoch end)
    assert csv_log(ref) == csv_log(again) == without_keepalive.csv()


@pytest.mark.slow  # five 2-process jobs one after the other
def test_sigterm_and_random_rank_kills_inside_saves_then_a_new_job_resume_exactly(tmp_path, without_keepalive):
    """A SIGTERM to a random rank; then in each job a random rank SIGKILLed once the fit passed a
    random step (later for each job), or (every other job) at the first save after it, as soon as its
    checkpoint folder exists without a manifest (a kill inside a save); then the whole job killed and
    a new one started on the same run folder, until one finishes."""
    rng = random.Random(int(os.environ.get("KEEPALIVE_TEST_SEED", "23")))
    run_dir = str(tmp_path / "run")
    env = {"LDDP_SLOW_WRITE": "0.05", "LDDP_STEP_SLEEP": "0.03"}
    # first a SIGTERM to a random rank (a preemption): one save, by all ranks, at the next boundary
    victim, term_at = rng.choice((0, 1)), rng.randint(3, 9)
    term = job(tmp_path, "sigterm", dict(env, LDDP_SIGTERM=f"{victim}:{term_at}"), run_dir=run_dir)
    try:
        assert term.wait(240) != 0  # 143: torchrun (--max-restarts) or a scheduler starts it again
    finally:
        term.stop()
    saved = re.findall(r"^keepalive: SIGTERM: saved .*?step (\d+) to ", term.text(), re.M)
    assert len(saved) == 1 and term_at <= int(saved[0]) <= term_at + 1, term.text()[-4000:]  # said by rank 0
    log = [(victim, f"SIGTERM after step {term_at}", [], _newest_committed(run_dir), [])]
    assert log[0][3] == int(saved[0]), log
    for attempt, target in enumerate(sorted(rng.sample(range(term_at + 3, 32), 3))):
        before = _saving(run_dir)  # torn folders of earlier kills
        j = job(tmp_path, f"attempt{attempt}", env, run_dir=run_dir)
        mid_save = attempt % 2 == 0
        victim = rng.choice((0, 1))
        try:
            deadline = time.monotonic() + 240
            while j.proc.poll() is None and time.monotonic() < deadline:
                step = max((int(s) for s in re.findall(r"^STEP (\d+)$", j.text(), re.M)), default=0)
                if step >= target and (not mid_save or _saving(run_dir) - before):
                    break
                time.sleep(0.005)
            assert j.proc.poll() is None, f"attempt {attempt} ended before its kill:\n{j.text()[-6000:]}"
            pid = int(open(os.path.join(j.out_dir, f"pid.0.{victim}")).read())
            os.kill(pid, 9)
            torn = sorted(_saving(run_dir) - before)
            while alive(pid):
                time.sleep(0.01)
        finally:
            j.stop()
        resumed = [int(s) for s in RESUME_RE.findall(j.text())]
        when = f"{'first save after ' if mid_save else ''}step {target}"
        log.append((victim, when, torn, _newest_committed(run_dir), resumed))
    last = job(tmp_path, "last", env, run_dir=run_dir)
    text = finish(last)
    resumed_at = [int(s) for s in RESUME_RE.findall(text)]
    print("kills (rank, when, checkpoint folders without manifest, newest commit after the job, resumed at):", log,
          "last job resumed at:", resumed_at)
    assert any(torn for _, _, torn, _, _ in log), log  # at least one kill landed inside a save
    assert len(log) == 4 and all(r for *_, r in log[1:]), log  # each job after the SIGTERM resumed
    # no job goes back past a checkpoint committed before it started (the surviving rank 0 may still
    # commit the save its peer died in, after the kill: then the next job starts there)
    starts = [r[0] if r else 0 for *_, r in log[1:]] + resumed_at
    for (_, _, _, committed, _), start in zip(log, starts):
        assert start >= (committed or 0), (log, resumed_at)
    assert "not bit-identical" not in text and "epoch ends only" not in text, text[-4000:]
    for rank, resumed in enumerate(finals(last)):
        assert_same(without_keepalive[rank], resumed, f"rank {rank} after {len(log)} kills vs without keepalive")
    assert csv_log(last) == without_keepalive.csv()


class NotebookJob(Job):
    """The same fit launched as from a notebook: ``strategy="ddp_notebook"``, one Python process whose
    fit forks the two training processes."""

    def command(self, nproc: int, restarts: int) -> List[str]:
        # the notebook's process forked too (its fit forks the two training processes from it)
        return ["env", f"PYTHONPATH={PYTHONPATH}", *(f"{k}={v}" for k, v in rank_env().items()), sys.executable,
                *(["-S", CLIENT] if rank_env() else []), SCRIPT, self.run_dir, self.out_dir]


def notebook_job(tmp, name: str, env: Optional[Dict[str, str]] = None, run_dir: Optional[str] = None) -> Job:
    return NotebookJob(tmp, name, SCRIPT, env=dict(env or {}, KEEPALIVE_PROGRESS="0", LDDP_STRATEGY="ddp_notebook"),
                       run_dir=run_dir)


def test_ddp_notebook_forked_processes_resume_exactly_after_a_rank_kill(tmp_path, without_keepalive):
    crash = notebook_job(tmp_path, "nb-crash", {"LDDP_KILL": KILL})
    try:
        assert crash.wait(240) != 0  # Lightning's launcher raises: process 1 terminated with SIGKILL
    finally:
        crash.stop()
    assert "KILL rank 1 before step 17" in crash.text() and "DONE" not in crash.text(), crash.text()[-4000:]
    control_dir = str(tmp_path / "nb-control-run")
    shutil.copytree(crash.run_dir, control_dir)
    again = notebook_job(tmp_path, "nb-again", run_dir=crash.run_dir)  # the cell run again
    control = notebook_job(tmp_path, "nb-control", {"LDDP_CONTROL": "rank0-parts"}, run_dir=control_dir)
    try:
        texts = [finish(again), finish(control)]
    finally:
        again.stop()
        control.stop()
    for text in texts:
        assert [int(s) for s in RESUME_RE.findall(text)] == [15], text[-4000:]
    reference = {k: v for k, v in without_keepalive[0].items() if k.startswith("model.")}

    def model(j: Job) -> Dict[str, "torch.Tensor"]:
        return torch.load(os.path.join(j.out_dir, "final.notebook.pt"))

    assert_same(reference, model(again), "the notebook's model after the resume vs without keepalive")
    assert_differs(reference, model(control))
    assert csv_log(again) == without_keepalive.csv()


def _newest_committed(run_dir: str) -> Optional[int]:
    """The step of the run's newest checkpoint that verifies (None: none)."""
    store = CheckpointStore(run_dir)
    return max((info.step for info in store.list() if store.verify(info).valid), default=None)


def csv_log(j: TorchrunJob) -> str:
    """The fit's CSV log (Lightning's CSVLogger, written by rank 0)."""
    with open(os.path.join(j.run_dir + "-logs", "lightning_logs", "version_0", "metrics.csv")) as f:
        return f.read()


def _saving(run_dir: str) -> set:
    """Checkpoint folders that have no manifest (yet: a save in progress)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return set()
    return {n for n in names if n.startswith("ckpt-") and not os.path.exists(os.path.join(run_dir, n, "MANIFEST.json"))}


# ------------------------------------------------------------------------------- refused strategies
@pytest.mark.parametrize("strategy, says", [
    (lambda: pl.strategies.FSDPStrategy(), "FSDPStrategy shards the model over the 2 processes"),
    (lambda: pl.strategies.DDPStrategy(start_method="spawn"), "DDPStrategy(start_method='spawn')"),
])
def test_strategies_it_cannot_save_are_refused_in_one_line(strategy, says):
    trainer = SimpleNamespace(world_size=2, strategy=strategy())
    with pytest.raises(RuntimeError) as err:
        ka_lightning._check_strategy(trainer)
    message = str(err.value)
    assert says in message and "\n" not in message, message
    assert 'use strategy="ddp"' in message, message


def test_ddp_ddp_notebook_and_one_device_are_accepted():
    ka_lightning._check_strategy(SimpleNamespace(world_size=2, strategy=pl.strategies.DDPStrategy()))
    ka_lightning._check_strategy(SimpleNamespace(world_size=2, strategy=pl.strategies.DDPStrategy(start_method="fork")))
    ka_lightning._check_strategy(SimpleNamespace(world_size=1, strategy=pl.strategies.FSDPStrategy()))

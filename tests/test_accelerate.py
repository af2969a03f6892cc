"""Accelerate as its users write it, on 2 gloo processes (CPU), every prepared object registered as it is.

tests/scripts/accel_prepared.py: ``Accelerator(cpu=True, gradient_accumulation_steps=4)`` creates the
process group itself; ``DriveCheckpoint(run, model=model, optimizer=opt, scheduler=sched)`` takes the
DDP model, the ``AcceleratedOptimizer`` and the ``AcceleratedScheduler`` that ``accelerator.prepare``
returned, ``ckpt.batches(dl)`` the prepared loader; the step runs inside ``accelerator.accumulate``;
dropout and noise from the global RNG in the dataset.

* ``torchrun --max-restarts=4`` with a ``DataLoaderShard`` (4 epochs, ``rng_types=["torch", "generator"]``):
  with keepalive and no kill, both ranks end bit-identical to the same script without keepalive; then a
  random rank SIGKILLed (up to) 3 times at random moments (writes slowed so that kills land inside
  saves), torchrun restarting the workers each time: both ranks bit-identical to the uninterrupted run.
* ``dispatch_batches=True`` (a ``DataLoaderDispatcher``: rank 0 reads every rank's batches), restarted
  by ``notebook_launcher(..., max_restarts=1)`` (what a notebook cell runs; the elastic agent in the
  launching process): rank 1 SIGKILLs itself between two accumulation micro-batches, once a checkpoint
  is committed; the restarted workers resume by themselves, bit-identical to the uninterrupted run.
  Negative control: the same kill with the micro-batches counted as steps (the optimizer not handed to
  keepalive, as a loop stepping an unregistered optimizer would be) ends different.

Jobs run in their own process sessions and are stopped by their process group.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("accelerate")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from crashkit import assert_differs, assert_same  # noqa: E402
from servers import free_port  # noqa: E402
from torchrunkit import ROOT, TorchrunJob, forked_ranks, kill_ranks_at_random  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "accel_prepared.py")
RESUME_RE = re.compile(r"resuming run .*? step (\d+)")  # the first: the line also says how far the last session got
#: what must never be said of these runs: they resume exactly
INEXACT = ("epoch ends only", "not bit-exact", "not bit-identical", "another random state", "differ")


@pytest.fixture(scope="module", autouse=True)
def ranks_forked():
    """torchrun's agent and ranks fork from a server that has imported what the ranks import first."""
    with forked_ranks(["torch", "torch.distributed", "torch.utils.data", "accelerate", "accelerate.utils"]):
        yield


def finals(out_dir: str) -> List[Dict[str, "torch.Tensor"]]:
    return [torch.load(os.path.join(out_dir, f"final.{r}.pt")) for r in (0, 1)]


def finish(job: TorchrunJob, timeout: float = 300.0) -> str:
    try:
        assert job.wait(timeout) == 0, job.text()[-6000:]
    finally:
        job.stop()
    return job.text()


def exact(text: str) -> None:
    for words in INEXACT:
        assert words not in text, text[-4000:]


class NotebookLaunch:
    """``python accel_prepared.py --notebook RUN OUT``: ``notebook_launcher`` in a process of its own
    session (a notebook's kernel), output collected by a thread."""

    def __init__(self, tmp, name: str, *, env: Dict[str, str], run_dir: str = ""):
        self.run_dir = run_dir or str(tmp / f"{name}-run")
        self.out_dir = str(tmp / f"{name}-out")
        full = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ACCEL_PORT=str(free_port()),
                    PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--notebook", self.run_dir, self.out_dir],
                                     env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.output: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.output.append(line)

    def text(self) -> str:
        return "".join(self.output)

    def finish(self, timeout: float = 300.0) -> str:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)  # our own session (start_new_session), by id
                self.proc.wait()
        assert rc == 0, f"rc {rc}:\n{self.text()[-6000:]}"
        return self.text()


@pytest.fixture
def accelerator():
    """An ``Accelerator(cpu=True, gradient_accumulation_steps=3)`` in this process (one process), whose
    process-wide state is dropped afterwards (Accelerate keeps it in class attributes)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True, gradient_accumulation_steps=3)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_prepared_objects_one_process_count_optimizer_steps_and_resume_into_raw_ones(tmp_path, accelerator):
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint
    from keepalive.store import CheckpointStore

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model, opt, sched = build()
    model, opt, dl, sched = accelerator.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True), sched)
    run = str(tmp_path / "run")
    # the AcceleratedOptimizer raised AttributeError '_optimizer_step_post_hooks' here
    ckpt = DriveCheckpoint(run, model=model, optimizer=opt, scheduler=sched, every=1, keep=None, quiet=True)
    for _ in ckpt.epochs(1):
        for x, y in ckpt.batches(dl):
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
    ckpt.close()
    # 10 micro-batches: steps after the 3rd, 6th, 9th and (the loader's end) the 10th; a save at each
    # step, none between two micro-batches of an accumulation
    assert ckpt.step == 4
    assert {info.step for info in CheckpointStore(run).list()} == {1, 2, 3, 4}

    raw_model, raw_opt, raw_sched = build()  # the same run resumed with the objects not prepared
    again = DriveCheckpoint(run, model=raw_model, optimizer=raw_opt, scheduler=raw_sched, quiet=True)
    assert again.resume() and again.step == 4
    assert_same(model.state_dict(), raw_model.state_dict(), "the model")
    assert_same(opt.state_dict()["state"], raw_opt.state_dict()["state"], "the optimizer")
    assert raw_sched.state_dict() == sched.state_dict()
    again.close()


def test_a_dispatcher_that_completes_an_uneven_last_batch_is_told(accelerator):
    """With 2 processes, ``DataLoaderDispatcher`` completes an epoch's last batch, when its samples do not
    split evenly, with the first samples of the batch the iteration began with: a resumed epoch begins
    with another batch. The position is kept; the inexactness is what the first mid-epoch save says."""
    import types

    from accelerate.data_loader import DataLoaderDispatcher
    from torch.utils.data import TensorDataset

    from keepalive.callbacks._torch_replay import LoaderReplay

    said = {}
    for n in (120, 121, 122):  # batches of 4, two read per batch of a rank: 121 leaves 1 sample (uneven)
        loader = DataLoaderDispatcher(TensorDataset(torch.randn(n, 2)), batch_size=4, shuffle=True)
        loader.__dict__["state"] = types.SimpleNamespace(num_processes=2, process_index=0)  # rank 0 of 2
        replay = LoaderReplay(loader)
        assert replay.mid_epoch and replay.dispatch is not None and replay.dispatch.base_batches == 2
        said[n] = replay.inexact
    assert said[120] == said[122] == ""
    assert said[121] == (
        "the DataLoaderDispatcher (dispatch_batches=True) completes each epoch's last, uneven batch with "
        "samples of the epoch's first batch, and a resumed epoch's first batch is another one: from a "
        "mid-epoch checkpoint that last batch differs from an uninterrupted run's. Make the dataset's "
        "length a multiple of batch_size x processes, or pass drop_last=True, for an exact resume")


@pytest.mark.slow  # several 2-process jobs one after the other
def test_prepared_objects_torchrun_restarts_after_random_rank_kills_bit_identical(tmp_path):
    # 16 steps: room for 3 kills and their restarts; rng_types with "torch": Accelerate also sends rank 0's
    # global torch RNG to every rank at each iter() (the default, "generator", is tests/test_accelerate_data.py's)
    epochs = {"ACCEL_EPOCHS": "4", "ACCEL_RNG_TYPES": "torch,generator"}
    plain = TorchrunJob(tmp_path, "plain", SCRIPT, env=dict(epochs, ACCEL_PLAIN="1"))
    ref = TorchrunJob(tmp_path, "ref", SCRIPT, env=epochs)
    try:
        ref_text = finish(ref)
        finish(plain)
    finally:
        plain.stop()
        ref.stop()
    reference = finals(ref.out_dir)
    assert_same(reference[0], reference[1], "the replicas")
    for rank, (with_ka, without) in enumerate(zip(reference, finals(plain.out_dir))):
        assert_same(without, with_ka, f"rank {rank} with keepalive vs without")  # transparent
    exact(ref_text)
    assert "DONE rank 0 step 16" in ref_text, ref_text[-4000:]  # optimizer steps, not the 60 micro-batches

    rng = random.Random(int(os.environ.get("KEEPALIVE_TEST_SEED", "23")))
    crash = TorchrunJob(tmp_path, "crash", SCRIPT, restarts=4,
                        env=dict(epochs, ACCEL_SLOW_WRITE="0.05", ACCEL_STEP_SLEEP="0.03", ACCEL_EVERY="1"))
    log, resumed = kill_ranks_at_random(crash, rng, 3, (0.3, 1.2), RESUME_RE)
    text = crash.text()
    # (a last kill may come too late under load: the job has finished)
    assert len(log) >= 2 and len(resumed) >= 2 and max(resumed) > 0, (log, resumed, text[-4000:])
    exact(text)
    for rank, got in enumerate(finals(crash.out_dir)):
        assert_same(reference[rank], got, f"rank {rank} after {len(log)} kills vs uninterrupted")


@pytest.mark.slow  # several 2-process jobs one after the other
def test_dispatched_loader_notebook_launcher_kill_between_accumulation_micro_batches(tmp_path):
    dispatch = {"ACCEL_DISPATCH": "1"}
    kill = dict(dispatch, ACCEL_SELF_KILL="1:6", ACCEL_RESTARTS="1")  # after step 6: in epoch 1 (steps 5-8)
    plain = NotebookLaunch(tmp_path, "plain", env=dict(dispatch, ACCEL_PLAIN="1"))
    crash = NotebookLaunch(tmp_path, "crash", env=kill)
    plain.finish()
    text = crash.finish()
    control = NotebookLaunch(tmp_path, "control", env=dict(kill, ACCEL_CONTROL="no-accumulation-count"))
    control.finish()
    assert "KILL rank 1 between two accumulation micro-batches after step" in text, text[-4000:]
    assert [int(s) for s in RESUME_RE.findall(text)] == [6], text[-4000:]  # said once, by rank 0
    exact(text)
    reference = finals(plain.out_dir)
    assert_same(reference[0], reference[1], "the replicas")
    for rank, got in enumerate(finals(crash.out_dir)):
        assert_same(reference[rank], got, f"rank {rank} resumed vs uninterrupted")
    assert_differs(reference[0], finals(control.out_dir)[0])

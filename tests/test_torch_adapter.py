"""The torch DriveCheckpoint's contract, beyond the SIGKILL crash test: mid-epoch resume variants,
shape mismatches, interrupts, SIGTERM, the session deadline, IterableDataset, schedules."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from forkserver import script_children_fixture
from keepalive import CheckpointStore, StateMismatchError
from keepalive.callbacks.torch import DriveCheckpoint

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torch_train.py")
#: the script's children fork from a server that has imported torch (tests/forkserver.py)
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data", "safetensors.torch"]


forked_children = script_children_fixture(SCRIPT, "torch", PRELOAD, sys.modules[__name__])


def make(seed=0, hidden=16, out=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, out))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return model, opt, sched


def data(n=50):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def train(path, loader, epochs=3, stop_after=None, **kw):
    model, opt, sched = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, scheduler=sched, quiet=True, **kw)
    done = 0
    for _ in ckpt.epochs(epochs):
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if stop_after is not None and done >= stop_after:
                ckpt.flush()
                ckpt.close()
                return model, ckpt
        sched.step()
    ckpt.close()
    return model, ckpt


@pytest.mark.parametrize("shuffle,drop_last,batch", [(True, False, 8), (False, False, 8), (True, True, 7)])
def test_mid_epoch_resume_matches_uninterrupted(tmp_path, shuffle, drop_last, batch):
    loader = DataLoader(data(), batch_size=batch, shuffle=shuffle, drop_last=drop_last)
    ref, _ = train(tmp_path / "ref", loader)
    # stop at an every-3-steps boundary in the middle of epoch 1, then resume with fresh objects
    # (leaving the loop body skips that step's boundary: 8 steps counted, newest checkpoint at 6)
    _, first = train(tmp_path / "run", loader, stop_after=9, every=3)
    assert first.step == 8
    torch.manual_seed(999)  # a new process would have other RNG states: the checkpoint restores them
    resumed, ckpt = train(tmp_path / "run", loader, every=3)
    assert ckpt.core.resumed_from.step == 6
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_shape_mismatch_names_parameter_and_changes_nothing(tmp_path):
    loader = DataLoader(data(), batch_size=10)
    train(tmp_path / "run", loader, epochs=1)
    model, opt, sched = make(seed=5, out=4)  # last layer 16 -> 4 instead of 16 -> 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, scheduler=sched, quiet=True)
    with pytest.raises(StateMismatchError) as err:
        ckpt.resume()
    msg = str(err.value)
    assert "'2.weight'" in msg and "(3, 16)" in msg and "(4, 16)" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}
    ckpt.close()


def test_unregistered_object_in_checkpoint_is_a_clear_error(tmp_path):
    loader = DataLoader(data(), batch_size=10)
    model, opt, _ = make()
    c = DriveCheckpoint(tmp_path / "run", model=model, quiet=True)
    for _ in c.epochs(1):
        for _ in c.batches(loader):
            pass
    c.close()
    c2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    with pytest.raises(StateMismatchError, match="no state for \\['optimizer'\\]"):
        c2.resume()
    c2.close()


@pytest.fixture
def python_sigint():
    """SIGINT as in a script or a kernel (Python's handler raises KeyboardInterrupt); a pytest-xdist
    worker ignores it. The worker's own handler is put back afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_keyboard_interrupt_saves_at_step_boundary_then_reraises(tmp_path, python_sigint):
    loader = DataLoader(data(), batch_size=5, shuffle=True)
    model, opt, sched = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    steps = 0
    with pytest.raises(KeyboardInterrupt):
        for _ in ckpt.epochs(3):
            for x, y in ckpt.batches(loader):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if steps == 6:
                    os.kill(os.getpid(), signal.SIGINT)  # "Interrupt kernel" in the middle of a step
                opt.step()  # ... the step still completes
                steps += 1
    assert steps == 7
    ckpt.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    newest = CheckpointStore(tmp_path / "run").newest_valid()
    assert newest.step == 7 and newest.manifest["metadata"]["reason"] == "SIGINT received"


def _run(args, env=None, **kw):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


def test_sigterm_saves_the_current_step_and_exits(tmp_path):
    proc = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "run"), "--out", str(tmp_path / "o.st"),
                             "--hidden", "32", "--sleep", "0.05", "--every", "epoch"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = None
    for line in proc.stdout:
        if line.startswith("STEP "):
            last = int(line.split()[1])
            if last == 12:
                proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    newest = CheckpointStore(tmp_path / "run").newest_valid()
    assert newest.step == last == 12  # zero optimizer steps lost


def test_deadline_stops_before_cutoff_and_resumes_bit_exact(tmp_path):
    """A session budget of a few seconds (counted from the start of training, so that a slow start
    on a loaded machine cannot eat it) ends the run early with its last step saved."""
    common = ["--hidden", "64", "--sleep", "0.1", "--margin", "1s"]
    ref = _run([str(tmp_path / "ref"), "--out", str(tmp_path / "ref.st"), *common])
    assert ref.returncode == 0, ref.stdout + ref.stderr
    first = _run([str(tmp_path / "run"), "--out", str(tmp_path / "run.st"), *common, "--budget", "3s"])
    out = first.stdout + first.stderr
    assert first.returncode == 143, out  # keepalive's "stopped, continue me" exit (EXIT_STOPPED)
    assert "stopping before the session ends" in out
    remaining = float(re.search(r"STOPPED remaining (-?[0-9.]+)", out).group(1))
    assert remaining > 0, f"ran past the deadline by {-remaining:.2f} s"
    last_step = max(int(m) for m in re.findall(r"^STEP (\d+)", first.stdout, re.M))
    assert last_step < 57  # it really stopped early
    newest = CheckpointStore(tmp_path / "run").newest_valid()
    assert newest.step == last_step  # zero optimizer steps lost
    assert newest.manifest["metadata"]["reason"].startswith("deadline")
    # a fresh session (no budget) resumes and finishes, bit-exact
    second = _run([str(tmp_path / "run"), "--out", str(tmp_path / "run.st"), *common])
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"step {last_step}" in second.stdout
    a, b = load_file(tmp_path / "ref.st"), load_file(tmp_path / "run.st")
    assert all(torch.equal(a[k], b[k]) for k in a)


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            yield torch.randn(8, generator=g), torch.randint(0, 3, (), generator=g)


def test_iterable_dataset_checkpoints_at_epoch_ends_only(tmp_path, caplog):
    loader = DataLoader(Stream(), batch_size=4)
    model, opt, _ = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, keep=None, quiet=True)
    with caplog.at_level("WARNING"):
        for _ in ckpt.epochs(2):
            for x, y in ckpt.batches(loader):
                pass
    ckpt.close()
    assert "IterableDataset" in caplog.text
    steps = [c.step for c in CheckpointStore(tmp_path / "run").list()]
    assert steps == [5, 10]


def test_duration_schedule_retention_and_manual_save(tmp_path):
    loader = DataLoader(data(), batch_size=5)
    model, opt, _ = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every="0.05s", keep=2, quiet=True)
    for _ in ckpt.epochs(1):
        for _ in ckpt.batches(loader):
            time.sleep(0.03)
    ckpt.extras["best"] = 0.5
    ckpt.core.counters["step"] += 1
    ckpt.save(sync=True)
    ckpt.close()
    listed = CheckpointStore(tmp_path / "run").list()
    assert len(listed) == 2  # keep=2 after several duration-triggered saves
    c2 = DriveCheckpoint(tmp_path / "run", model=make()[0], quiet=True)
    c2.register("optimizer", torch.optim.SGD(c2.objects["model"].parameters(), lr=0.1, momentum=0.9))
    assert c2.resume() and c2.extras["best"] == 0.5 and c2.step == 11
    c2.close()


def test_register_rejects_objects_without_state_dict(tmp_path):
    with pytest.raises(TypeError, match="extras"):
        DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), thing=object(), quiet=True)


def test_importing_keepalive_stays_light():
    code = ("import sys, keepalive, keepalive.core, keepalive.cli; "
            "print(sorted(m for m in ('torch','tensorflow','fastai','keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_second_session_on_a_run_is_refused_at_start_unless_takeover(tmp_path):
    from keepalive import LeaseLostError, RunLockedError

    loader = DataLoader(data(), batch_size=10)
    m1, o1, _ = make()
    first = DriveCheckpoint(tmp_path / "run", model=m1, optimizer=o1, quiet=True)
    it = first.epochs(3)
    next(it)  # the first session is training
    m2, o2, _ = make()
    second = DriveCheckpoint(tmp_path / "run", model=m2, optimizer=o2, quiet=True)
    with pytest.raises(RunLockedError, match="takeover=True"):
        next(second.epochs(3))  # refused before any training happens
    third = DriveCheckpoint(tmp_path / "run", model=m2, optimizer=o2, takeover=True, quiet=True)
    next(third.epochs(3))
    for _ in first.batches(loader):
        pass
    next(it)  # epoch end: the first session's save is written in the background ...
    with pytest.raises(LeaseLostError, match="taken over"):  # ... and refused at commit
        first.flush()
    it.close()
    third.close()
    assert CheckpointStore(tmp_path / "run").list() == []  # nothing written by the loser

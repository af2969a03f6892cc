"""The end of a training, as the core handles it for every adapter, and what a resume line says.

* The last step is written once: with ``every=N`` dividing the training's steps, the save the schedule
  owes at the last batch is made by the end-of-training save right after it (``finished``), not
  before it too; where the core cannot tell the last batch (a one-epoch training), the earlier copy of
  the same step is superseded, so ``keep=2`` still keeps the checkpoint before. Controls: without the
  superseding, two folders of the last step remain and the one before is dropped.
* A SIGKILL in the final validation, after the last batch whose save waits for the end of training:
  the re-run redoes the steps since the newest checkpoint and ends bit-identical to the same training
  without keepalive. Control: a training one step short differs.
* The index of runs holds absolute paths (a relative one named another folder in another process).
* Positions in the user's numbering: ``in epoch 1 after 40 batches``; the steps a resume redoes
  are said as what they are (the last writer got at least that far), not as a count from a heartbeat.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from keepalive import store as store_module  # noqa: E402
from keepalive.boundary import BatchEnd, BoundaryState, Due, EpochEnd, OptimizerStep, transition  # noqa: E402
from keepalive.runs import RUN_INDEX, position, read_run_index, record_run, resuming_line  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 64 samples in batches of 16: 4 batches (steps) per epoch
TRAIN = textwrap.dedent("""
    import os, sys, torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.set_num_threads(1)
    mode, run, epochs, every, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

    def build():
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
        loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(16, 3))
        return loader, model, torch.optim.Adam(model.parameters(), lr=0.01)

    def step(model, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def validate(model, epoch):
        model.eval()
        sys.stdout.write(f"VALIDATING {epoch}\\n")  # one write per line: the writer thread prints too
        with torch.no_grad():
            model(torch.rand(8, 6))
        model.train()

    if mode == "plain":  # the same training without keepalive, and (control) one step short
        for short in (False, True):
            loader, model, opt = build()
            for epoch in range(epochs):
                for i, (x, y) in enumerate(loader):
                    if short and epoch == epochs - 1 and i == len(loader) - 1:
                        break
                    step(model, opt, x, y)
                validate(model, epoch)
            torch.save(model.state_dict(), out + (".short" if short else ""))
    else:
        from keepalive.callbacks.torch import DriveCheckpoint
        loader, model, opt = build()
        ckpt = DriveCheckpoint(run, model=model, optimizer=opt, every=every, keep=2)
        ckpt.core.on_commit.append(lambda r: sys.stdout.write(  # one write: the writer thread's
            f"COMMITTED {r.info.step} {r.info.manifest['metadata']['finished']}\\n"))
        for epoch in ckpt.epochs(epochs):
            for x, y in ckpt.batches(loader):
                step(model, opt, x, y)
                sys.stdout.write(f"STEP {ckpt.step + 1}\\n")
            validate(model, epoch)
        assert ckpt.finished
        torch.save(model.state_dict(), out)
    sys.stdout.write("DONE\\n")
""")


def train(tmp_path, mode: str, *, epochs: int = 3, every: int = 2, kill_at: str = "", after: str = "") -> str:
    """Run the training child; with ``kill_at``, SIGKILL it when it prints that line (once it printed
    the line ``after``). Its output."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", KEEPALIVE_PROGRESS="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", TRAIN, mode, str(tmp_path / "run"), str(epochs), str(every),
           str(tmp_path / f"{mode}.pt")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if kill_at and kill_at in {ln.strip() for ln in lines} and after in {ln.strip() for ln in lines}:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    out = "".join(lines)
    if not kill_at:
        assert proc.returncode == 0 and "DONE" in out, out
    return out


def commits(out: str):
    return [(int(line.split()[1]), line.split()[2] == "True") for line in out.splitlines()
            if line.startswith("COMMITTED")]


def folders(run_dir) -> list:
    return [(info.step, bool(info.manifest["metadata"]["finished"])) for info in CheckpointStore(run_dir).list()]


def same(a, b) -> bool:
    wa, wb = torch.load(a), torch.load(b)
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_last_step_is_written_once_and_a_kill_before_it_resumes_bit_exactly(tmp_path):
    train(tmp_path, "plain")
    # SIGKILL in the final validation, after the last batch: its save waited for the end of training
    out = train(tmp_path, "keepalive", kill_at="VALIDATING 2", after="COMMITTED 10 False")
    assert commits(out) == [(2, False), (4, False), (6, False), (8, False), (10, False)], out
    out = train(tmp_path, "keepalive")
    assert "resuming run 'run'" in out and "in epoch 2 after 2 batches, step 10" in out, out
    assert commits(out) == [(12, True)], out  # written once, by the end of training
    assert folders(tmp_path / "run") == [(10, False), (12, True)]
    assert same(tmp_path / "keepalive.pt", tmp_path / "plain.pt")
    # control: the comparison sees the steps at stake (the training one step short differs)
    assert not same(tmp_path / "plain.pt.short", tmp_path / "plain.pt")


def test_a_one_epoch_training_supersedes_the_scheduled_copy_of_its_last_step(tmp_path, monkeypatch):
    """One epoch: its length is unknown until it ends, so the schedule's save of the last step is
    made, then the end's; the earlier copy goes, and keep=2 keeps the checkpoint before."""
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 6)), batch_size=16)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, keep=2, quiet=True)
    written = []
    ckpt.core.on_commit.append(lambda r: written.append((r.info.step, r.info.manifest["metadata"]["finished"])))
    for _ in ckpt.epochs(1):
        for (x,) in ckpt.batches(loader):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert written == [(2, False), (4, False), (4, True)]
    assert folders(tmp_path / "run") == [(2, False), (4, True)]
    # control: without the superseding, retention keeps both copies of step 4 and drops step 2
    store = CheckpointStore(tmp_path / "ctl", keep=2)
    monkeypatch.setattr(store_module, "_finished", lambda info: False)
    for step, finished in ((2, False), (4, False), (4, True)):
        store.commit({"a.bin": b"x"}, step=step, epoch=0, metadata={"finished": finished})
    store.close()
    assert folders(tmp_path / "ctl") == [(4, False), (4, True)]


def test_the_last_batch_owes_its_save_to_the_end_of_training():
    """The state machine: a save due at the last batch waits for the end of training (one save,
    finished); a stop or a signal there acts at once; were it not the last batch, the next pays it."""
    s = BoundaryState()
    s, _ = transition(s, OptimizerStep(0))
    s, d = transition(s, BatchEnd(last=True, due=Due(save="every 1 steps")))
    assert not d and s.pending.save == "every 1 steps"
    s, d = transition(s, EpochEnd(last=True))
    assert (d.save, d.finished, s.pending.save) == (True, True, None)
    # a stop at the last batch is not put off
    s = BoundaryState()
    s, _ = transition(s, OptimizerStep(0))
    s, d = transition(s, BatchEnd(last=True, due=Due(save="deadline", stop="deadline")))
    assert d.save and d.stop
    # a wrong guess: another batch came, and paid what was owed
    s = BoundaryState()
    s, _ = transition(s, OptimizerStep(0))
    s, d = transition(s, BatchEnd(last=True, due=Due(save="every 1 steps")))
    s, _ = transition(s, OptimizerStep(0))
    s, d = transition(s, BatchEnd())
    assert d.save and d.reason == "every 1 steps" and s.counters.step == 2


def test_the_index_of_runs_holds_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    index = tmp_path / "index"
    assert record_run("runs/x", str(index))
    assert list(read_run_index(str(index))) == [str(tmp_path / "runs" / "x")]
    # an index an older keepalive wrote with a relative path reads as the folder below this one
    older = tmp_path / "older"
    older.mkdir()
    entries = [{"url": "runs/y", "run": "y", "opened": time.time(), "host": "h"}]
    body = json.dumps(entries, sort_keys=True).encode()
    (older / RUN_INDEX).write_bytes(json.dumps({"format": "keepalive-run-index", "runs": entries,
                                                "checksum": store_module.checksum_bytes(body)}).encode())
    assert list(read_run_index(str(older))) == [str(tmp_path / "runs" / "y")]


def test_positions_and_the_resume_line_in_the_users_numbering():
    assert position({"epoch": 1, "batch": 40, "step": 140}) == "in epoch 1 after 40 batches, step 140"
    assert position({"epoch": 2, "batch": 0, "step": 200}) == "at the end of epoch 1, step 200"
    info = SimpleNamespace(name="ckpt-0000000140-ab", created=time.time() - 5, manifest={"metadata": {}})
    line = resuming_line("r", info, {"epoch": 1, "batch": 40, "step": 140}, {"step": 170})
    assert line.startswith("resuming run 'r' from ckpt-0000000140-ab: in epoch 1 after 40 batches, "
                           "step 140, saved "), line
    assert line.endswith("; the last session got to step 170 or further: the steps after 140 are redone"), line


def test_a_spooled_run_is_given_back_when_its_loop_ends(tmp_path, monkeypatch):
    """Through the local spool (a remote or Drive destination): once the loop has ended and the
    uploads are done, neither the spool nor the destination is held by the idle process."""
    from keepalive.callbacks.torch import DriveCheckpoint

    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
    ckpt = DriveCheckpoint(tmp_path / "dest", model=model, optimizer=opt, spool=True, quiet=True)
    for _ in ckpt.epochs(2):
        for (x,) in ckpt.batches(loader):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    from keepalive.spool import uploader as uploader_module

    uploaders = uploader_module.UPLOADERS.values()  # this test's, and any an earlier test left running
    dest = CheckpointStore(tmp_path / "dest")
    end = time.monotonic() + 30
    while not (dest.lease.read() or {}).get("released") and time.monotonic() < end:
        time.sleep(0.05)  # the uploader gives the destination back after its last upload
    states = [(u.spool.folder, u.dest.url, u.exited, u.fatal, u.last_error, len(u.pending()),
               u._thread is not None and u._thread.is_alive()) for u in uploaders]
    assert (dest.lease.read() or {}).get("released"), (dest.lease.read(), states)
    assert [i.step for i in dest.list()][-1] == 8
    leases = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "spool") for f in fs if f == "LEASE.json"]
    assert leases and all(json.load(open(p)).get("released") for p in leases), leases

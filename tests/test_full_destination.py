"""Ends that do not hang: a destination that fills up, flushes that wait once, torn folders removed.

A real full destination: a 60 MiB tmpfs mounted for the test (root, or CAP_SYS_ADMIN: skipped with
the reason where the mount is refused) as the run folder of a torch training through the local spool,
with a state of 24 MiB, so the third upload hits ENOSPC. The end of training does not wait for
uploads that cannot succeed (it used to wait ``flush_timeout``, 120 s) and says where the checkpoints
are; the folders the failed uploads left are removed after the next successful upload once the mount
has room again, so ``keepalive verify`` of the finished run exits 0 (the control, with that cleanup
turned off, exits 1). Without a mount: a committed folder is never removed, a live writer's folder
is kept, two flushes in a row wait once, the count says what is waited for, the resume line says
where the checkpoint came from."""
from __future__ import annotations

import json
import os
import subprocess
import time
import types

import pytest
import torch

import faultyfs
from keepalive import cli
from keepalive import spool as spool_mod
from keepalive.runs import read_from
from keepalive.spool import flushing, torn
from keepalive.spool import uploader as uploader_mod
from keepalive.store import MANIFEST, CheckpointStore, RetryPolicy

EPOCHS = 6


@pytest.fixture(autouse=True)
def quick(tmp_path, monkeypatch):
    """A private spool; backoffs short enough that freed space is seen at once; uploaders stopped."""
    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))
    for name in ("KEEPALIVE_SPOOL_MODE", "KEEPALIVE_SPOOL_MAX", "KEEPALIVE_FLUSH_TIMEOUT", "KEEPALIVE_PROGRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(uploader_mod, "BACKOFF_MAX", 0.3)
    monkeypatch.setattr(uploader_mod, "IDLE_POLL", 0.3)
    control = tmp_path / "control.json"
    monkeypatch.setenv(faultyfs.CONTROL_ENV, str(control))
    faultyfs.write_control(str(control))
    yield control
    spool_mod.UPLOADERS.stop_all(timeout=10)


@pytest.fixture
def small_disk(tmp_path):
    """A 60 MiB tmpfs; ``grow()`` gives it room (a remount: the same device, so the same mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused ({done.stderr.strip() or done.returncode}): this test needs "
                    "root or CAP_SYS_ADMIN")

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=400m", str(mnt)], check=True)

    try:
        yield types.SimpleNamespace(path=mnt, grow=grow)
    finally:
        spool_mod.UPLOADERS.stop_all(timeout=10)  # nothing may hold a file there when it goes
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def torn_at(path) -> list:
    return sorted(d for d in os.listdir(path) if d.startswith("ckpt-")
                  and not os.path.exists(os.path.join(path, d, MANIFEST)))


def wait_for(predicate, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def train_into(dest):
    """A torch training of EPOCHS epochs (a 24 MiB state saved at each epoch's end), flushed at each
    epoch's start (each save meets the destination before the next one, whatever this machine's
    speed); returns (the checkpointer, seconds the end of training took, seconds close() took)."""
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 3072)  # 24 MiB of weights: two checkpoints fit in 60 MiB, not three
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2048)), batch_size=4)
    ckpt = DriveCheckpoint(str(dest), model=model, optimizer=opt, spool=True, quiet=True)
    last = time.monotonic()
    for epoch in ckpt.epochs(EPOCHS):
        if epoch:
            ckpt.flush()
        for (x,) in ckpt.batches(loader):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        last = time.monotonic()
    ended = time.monotonic() - last  # the last save, then the end-of-training flush
    t0 = time.monotonic()
    ckpt.close()  # a second flush: it must not wait again
    return ckpt, ended, time.monotonic() - t0


@pytest.mark.parametrize("cleanup", [True, False], ids=["cleanup", "control-without-cleanup"])
def test_a_full_destination_does_not_hold_the_end_and_verify_passes(small_disk, capsys, monkeypatch, cleanup):
    dest = small_disk.path / "run"
    if not cleanup:
        monkeypatch.setattr(torn.TornFolders, "remove", lambda self: [])
    ckpt, ended, closed = train_into(dest)
    err = capsys.readouterr().err
    spool = ckpt.core.spooled.folder
    assert "No space left on device" in err or "ENOSPC" in err, err
    # one line says that it does not wait, where the checkpoints are and how they get there later
    said = [line for line in err.splitlines() if "not waiting for the upload of" in line]
    assert len(said) == 1 and spool in said[0] and f"keepalive sync {dest}" in said[0], err
    assert "waiting up to" not in err
    assert ended < 8.0 and closed < 2.0, (ended, closed)  # flush_timeout is 120 s
    assert torn_at(dest), os.listdir(dest)  # what the failed uploads left: verify names them
    assert cli.main(["verify", str(dest)]) == 1
    capsys.readouterr()

    small_disk.grow()  # room again: the uploader, still retrying, uploads what matters
    wait_for(lambda: not ckpt.core.spooled.pending(), what="the uploads after the space was freed")
    wait_for(lambda: (CheckpointStore(dest).lease.read() or {}).get("released"), what="the lease back")
    left = torn_at(dest)
    code = cli.main(["verify", str(dest)])
    out = capsys.readouterr()
    with capsys.disabled():
        print(f"\nfull destination ({'cleanup' if cleanup else 'control'}): end of training {ended:.2f} s, "
              f"close() {closed:.2f} s, torn folders left {len(left)}, verify exit {code}")
    if cleanup:
        assert left == [] and code == 0, (left, out)
        # the resume line says where the copy it read lies: this machine's copy of the newest upload
        from keepalive.callbacks.torch import DriveCheckpoint

        model = torch.nn.Linear(2048, 3072)
        again = DriveCheckpoint(str(dest), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                spool=True)
        assert again.resume()
        line = [t for t in capsys.readouterr().out.splitlines() if "resuming run" in t]
        assert line and f"from this machine's copy in {spool}/run (uploaded already)" in line[0], line
        again.close()
    else:
        assert left and code == 1, "the control kept no torn folder: this test cannot fail"


# ---------------------------------------------------------------------------------- unit level
def _store(path, **kw) -> CheckpointStore:
    return CheckpointStore(path, keep=None, retry=RetryPolicy(attempts=1), **kw)


def _tear(store: CheckpointStore, name: str) -> None:
    folder = os.path.join(store.path, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "tensors.safetensors"), "wb") as f:
        f.write(b"x" * 100)


def test_a_committed_folder_is_never_removed_and_a_live_writers_folder_is_kept(tmp_path):
    run = tmp_path / "run"
    old = _store(run)
    old.open_for_writing()
    good = old.commit({"a.bin": b"1"}, step=1).info.name
    damaged = old.commit({"a.bin": b"2"}, step=2).info.name
    with open(os.path.join(run, damaged, MANIFEST), "r+b") as f:
        f.seek(5)
        f.write(b"#")  # a damaged manifest is still a committed folder: verify shows it, never removed here
    _tear(old, "ckpt-0000000003-0000aaaa")  # the old writer, still alive, writes this one
    new = _store(run)
    folders = torn.TornFolders(new)
    folders.opening()
    new.open_for_writing(takeover=True)  # a takeover of a live lease: the open clears nothing
    assert "ckpt-0000000003-0000aaaa" in os.listdir(run)
    _tear(new, "ckpt-0000000004-0000bbbb")
    folders.began("ckpt-0000000004-0000bbbb")
    assert folders.remove() == ["ckpt-0000000004-0000bbbb"]  # its own; the live writer's one stays
    assert sorted(os.listdir(run)) == sorted([good, damaged, "ckpt-0000000003-0000aaaa", "LEASE.json"])
    folders.taken_from = dict(folders.taken_from, heartbeat=time.time() - 10 * new.lease.ttl)
    assert folders.remove() == ["ckpt-0000000003-0000aaaa"]  # its lease would have expired: no writer left
    assert sorted(os.listdir(run)) == sorted([good, damaged, "LEASE.json"])
    new.close()
    old.lease.release()


def test_two_flushes_in_a_row_wait_once_and_count_what_is_waited_for(tmp_path, quick, capsys):
    dest = CheckpointStore(f"faulty://{tmp_path / 'dest' / 'run'}", keep=2,
                           retry=RetryPolicy(attempts=2, initial_delay=0.02, max_delay=0.05))
    f = spool_mod.SpooledStore(dest, True, flush_timeout=2.5)
    f.open_for_writing()
    faultyfs.write_control(str(quick), fail_until=4e9, errno="EIO")  # failing, maybe not for good
    for step in (1, 2, 3, 4, 5):
        f.commit({"a.bin": bytes([step]) * 1024}, step=step)
    t0 = time.monotonic()
    assert not f.flush()
    first = time.monotonic() - t0
    t0 = time.monotonic()
    assert not f.flush()
    second = time.monotonic() - t0
    err = capsys.readouterr()
    assert 2.0 <= first < 5.0 and second < 0.5, (first, second)
    # 5 pending, keep=2: 2 are uploaded, 3 would be deleted at once by retention (dropped, not waited for)
    assert "for 2 checkpoint upload(s)" in err.out, err.out
    assert err.err.count("are not uploaded to") == 1 and "2 checkpoint(s)" in err.err, err.err
    faultyfs.write_control(str(quick))
    assert f.flush(timeout=30)  # a timeout of the caller's own is honoured
    f.close()


def test_a_permanent_error_is_not_waited_for_and_a_recovery_is_seen(tmp_path, quick, capsys):
    dest = CheckpointStore(f"faulty://{tmp_path / 'dest' / 'run'}", keep=None,
                           retry=RetryPolicy(attempts=2, initial_delay=0.02, max_delay=0.05))
    f = spool_mod.SpooledStore(dest, True, flush_timeout=60, quiet=True)
    f.open_for_writing()
    faultyfs.write_control(str(quick), fail_until=4e9, errno="EROFS")
    f.commit({"a.bin": b"1" * 1024}, step=1)
    wait_for(lambda: f.uploader.permanent, what="the read-only destination to be seen")
    t0 = time.monotonic()
    assert not f.flush()
    assert time.monotonic() - t0 < flushing.PERMANENT_PROBE + 1.0
    assert "not waiting for the upload of 1 checkpoint(s)" in capsys.readouterr().err
    faultyfs.write_control(str(quick))  # writable again: the next flush's one attempt succeeds
    f.commit({"a.bin": b"2" * 1024}, step=2)
    assert f.flush()
    f.close()


@pytest.mark.parametrize("exc,permanent", [
    (OSError(28, "No space left on device"), True), (OSError(30, "Read-only file system"), True),
    (PermissionError(13, "denied"), True), (OSError(5, "Input/output error"), False),
    (TimeoutError("slow"), False), (OSError(107, "Transport endpoint is not connected"), False),
])
def test_which_errors_are_permanent(exc, permanent):
    from keepalive.spool.outage import is_permanent

    assert is_permanent(exc) is permanent
    wrapped = RuntimeError("upload failed")
    wrapped.__cause__ = exc
    assert is_permanent(wrapped) is permanent


def test_the_resume_line_says_where_the_checkpoint_came_from(tmp_path):
    from keepalive.store import CheckpointInfo

    info = CheckpointInfo("r", "ckpt-1", "/spool/r/ckpt-1", "/spool/r/ckpt-1", source="spool")
    assert read_from(info) == ", from this machine's spool /spool/r (not uploaded yet)"
    info.cached = True
    assert "uploaded already" in read_from(info)
    info = CheckpointInfo("r", "ckpt-1", "x", "gs://b/runs/r/ckpt-1")
    assert read_from(info) == ", from the destination gs://b/runs/r"
    assert json.dumps(read_from(object())) == '""'


def test_sync_stops_at_a_destination_that_failed_for_good(tmp_path, quick):
    url = f"faulty://{tmp_path / 'dest' / 'run'}"
    f = spool_mod.SpooledStore(_store(url), True, quiet=True)
    f.open_for_writing()
    faultyfs.write_control(str(quick), fail_until=4e9, errno="ENOSPC")
    f.commit({"a.bin": b"1" * 1024}, step=1)
    spool_mod.UPLOADERS.stop_all(timeout=10)  # what a crashed kernel leaves: the spool, nobody uploading
    f.spool.close()
    t0 = time.monotonic()
    result = spool_mod.sync(url, timeout=60)
    row = result["destinations"][0]
    assert time.monotonic() - t0 < 10 and not result["ok"] and row["pending"] == 1, result
    assert "No space left" in row["error"], row

"""The spool in one process: destinations that fail (ENOTCONN, EIO, ENOSPC, timeouts), vanish,
corrupt what they receive, or are locked by another session; the size bound; resume from the spool
and the destination; the bounded flush, Colab's Drive flush; `keepalive status` / `keepalive sync`.

Faults come from tests/faultyfs.py (the `faulty://` protocol, or LocalBackend patched for one
folder). Failure windows are opened and closed by the test itself (not by the clock), so nothing
here depends on how fast this machine is. The subprocess tests with real trainings are in
tests/test_spool_crash.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest

import faultyfs
from keepalive import cli, runs
from keepalive import spool as spool_mod
from keepalive.backends import LocalBackend
from keepalive.core import Checkpointer
from keepalive.errors import RunLockedError
from keepalive.spool import mount as mount_mod
from keepalive.spool import uploader as uploader_mod
from keepalive.store import MANIFEST, CheckpointStore, RetryPolicy
from keepalive.units import parse_bytes

FAR = 4e9  # a failure window the test closes by itself


@pytest.fixture(autouse=True)
def spool_env(tmp_path, monkeypatch):
    """A private spool root and fault control file; short backoffs; uploaders stopped afterwards."""
    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))
    control = tmp_path / "control.json"
    monkeypatch.setenv(faultyfs.CONTROL_ENV, str(control))
    faultyfs.write_control(str(control))
    for name in ("KEEPALIVE_SPOOL_MODE", "KEEPALIVE_SPOOL_MAX", "KEEPALIVE_FLUSH_TIMEOUT",
                 "KEEPALIVE_DRIVE_FLUSH", "KEEPALIVE_PROGRESS", "KEEPALIVE_PROGRESS_MIN_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(uploader_mod, "BACKOFF_MAX", 0.5)
    # the stores' own retries (5 attempts, up to 5 s apart) only make these tests slower
    monkeypatch.setattr(RetryPolicy.__init__, "__defaults__", (2, 0.02, 0.05))
    monkeypatch.setattr(uploader_mod, "IDLE_POLL", 0.5)
    yield control
    spool_mod.UPLOADERS.stop_all(timeout=10)


def fail(control, name="EIO", **extra):
    faultyfs.write_control(str(control), fail_until=FAR, errno=name, **extra)


def recover(control):
    faultyfs.write_control(str(control))


def files(step: int, size: int = 4096):
    return {"state.json": json.dumps({"step": step}).encode(),
            "tensors.bin": bytes([step % 251]) * size}


def spooled_store(url, spool="auto", keep=None, **kw):
    dest = CheckpointStore(url, keep=keep, retry=RetryPolicy(attempts=2, initial_delay=0.02, max_delay=0.05))
    return spool_mod.SpooledStore(dest, spool, quiet=True, **kw)


def names_at(path):
    if not os.path.isdir(path):
        return []
    return sorted(d for d in os.listdir(path) if d.startswith("ckpt-")
                  and os.path.exists(os.path.join(path, d, MANIFEST)))


def steps_at(path):
    return sorted(int(n.split("-")[1]) for n in names_at(path))


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def verify_cli(path, capsys):
    capsys.readouterr()
    rc = cli.main(["verify", str(path)])
    out = capsys.readouterr()
    assert rc == 0, out
    return out.out


# ------------------------------------------------------------------------------ the basic path
def test_remote_destination_is_spooled_uploaded_and_verified(tmp_path, capsys):
    dest = tmp_path / "dest" / "run"
    f = spooled_store(f"faulty://{dest}")
    assert f.spooling and f.reason == "destination"
    f.open_for_writing()
    infos = [f.commit(files(s), step=s).info for s in (1, 2, 3)]
    assert all(i.path.startswith(str(tmp_path / "spool")) for i in infos)  # committed locally
    assert f.flush(timeout=30)
    assert names_at(dest) == sorted(i.name for i in infos)
    for i in infos:  # the manifest arrives byte for byte; seq continues
        with open(os.path.join(i.path.replace(f.folder + "/run", str(dest)), MANIFEST), "rb") as fh:
            assert json.loads(fh.read())["seq"] == i.manifest["seq"]
    assert [i.manifest["seq"] for i in infos] == [1, 2, 3]
    assert f.pending() == []
    record = json.loads(open(os.path.join(f.folder, "SPOOL.json")).read())
    assert record["destination"] == f"faulty://{dest}"
    f.close()
    assert "all 3 checkpoint(s) verified" in verify_cli(dest, capsys)


@pytest.mark.parametrize("fault", ["ENOTCONN", "EIO", "ENOSPC", "timeout"])
def test_outage_then_recovery_loses_nothing(tmp_path, spool_env, capsys, fault):
    dest = tmp_path / "dest" / "run"
    f = spooled_store(f"faulty://{dest}")
    f.open_for_writing()
    f.commit(files(1), step=1)
    assert f.flush(timeout=30)
    if fault == "timeout":
        faultyfs.write_control(str(spool_env), fail_until=FAR, timeout=0.2)
    else:
        fail(spool_env, fault)
    # while the destination fails, commits go on (to local disk) and nothing reaches it
    for s in (2, 3, 4):
        f.commit(files(s), step=s)
    assert [c.step for c in f.pending()] == [2, 3, 4]
    assert not f.flush(timeout=0.5)
    wait_for(lambda: f.uploader.failing is not None, what="the outage to be seen")
    assert steps_at(dest) == [1]
    out = capsys.readouterr().err  # warnings go to stderr
    # reported once, however many retries
    assert out.count("cannot upload checkpoints") == 1 and "force_remount" not in out, out
    if fault == "ENOSPC":
        assert "destination is full" in out
    recover(spool_env)
    assert f.flush(timeout=30)
    assert steps_at(dest) == [1, 2, 3, 4]
    out = capsys.readouterr().err
    assert out.count("works again") == 1, out
    f.close()
    verify_cli(dest, capsys)


def test_vanished_mount_reported_once_and_uploads_resume(tmp_path, caplog, capsys):
    mnt = tmp_path / "mnt"
    (mnt / "runs").mkdir(parents=True)
    dest = mnt / "runs" / "r"
    f = spooled_store(str(dest), spool=True)
    f.open_for_writing()
    f.commit(files(1), step=1)
    assert f.flush(timeout=30) and steps_at(dest) == [1]
    os.rename(mnt, tmp_path / "gone")  # the mount point's content disappears
    for s in (2, 3):
        f.commit(files(s), step=s)
    assert not f.flush(timeout=1)
    wait_for(lambda: "not reachable" in capsys.readouterr().err or f.uploader.failing, what="report")
    out = capsys.readouterr().err
    f.flush(timeout=0.5)
    out += capsys.readouterr().err
    assert out.count("not reachable") <= 1
    assert not mnt.exists(), "the vanished folder must not be re-created on the local disk"
    os.rename(tmp_path / "gone", mnt)  # remounted
    assert f.flush(timeout=30)
    assert steps_at(dest) == [1, 2, 3]
    out = capsys.readouterr().err
    assert out.count("works again") == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "keepalive"]  # keepalive.report
    assert sum("Training goes on" in m for m in messages) == 1, messages
    assert any("drive.mount('/content/drive', force_remount=True)" in m for m in messages)
    f.close()


def test_enotconn_on_a_local_destination_is_a_vanished_mount(tmp_path, spool_env, capsys):
    root = tmp_path / "drive"
    dest = root / "run"
    undo = faultyfs.patch_local_backend(str(root))
    try:
        f = spooled_store(str(dest), spool=True)
        f.open_for_writing()
        fail(spool_env, "ENOTCONN")
        f.commit(files(1), step=1)
        assert not f.flush(timeout=1)
        wait_for(lambda: f.uploader.failing is not None, what="the outage")
        out = capsys.readouterr().err
        assert out.count("not reachable") == 1 and "force_remount=True" in out
        recover(spool_env)
        assert f.flush(timeout=30) and steps_at(dest) == [1]
        f.close()
    finally:
        undo()


# --------------------------------------------------------------------- local paths: auto mode
def test_local_auto_writes_directly_spools_on_failure_then_goes_back(tmp_path, spool_env, capsys):
    root = tmp_path / "disk"
    dest = root / "run"
    undo = faultyfs.patch_local_backend(str(root))
    try:
        f = spooled_store(str(dest))
        assert not f.spooling
        f.open_for_writing()
        f.commit(files(1), step=1)
        assert steps_at(dest) == [1] and not os.path.isdir(f.folder)  # direct: no spool at all
        fail(spool_env, "EIO")
        r2 = f.commit(files(2), step=2)  # the direct write fails: this very checkpoint is spooled
        assert f.spooling and f.reason == "failure" and r2.info.path.startswith(f.folder)
        f.commit(files(3), step=3)
        out = capsys.readouterr().err
        assert out.count("Training goes on") == 1, out
        recover(spool_env)
        assert f.flush(timeout=30)
        assert steps_at(dest) == [1, 2, 3]
        r4 = f.commit(files(4), step=4)  # healthy and drained: direct again
        assert not f.spooling and r4.info.path.startswith(str(dest))
        assert [CheckpointStore(str(dest)).list()[i].seq for i in range(4)] == [1, 2, 3, 4]
        assert "directly to" in capsys.readouterr().err
        f.close()
    finally:
        undo()


def test_slow_direct_writes_switch_to_the_spool(tmp_path, spool_env):
    root = tmp_path / "nfs"
    undo = faultyfs.patch_local_backend(str(root))
    try:
        f = spooled_store(str(root / "run"), slow_seconds=0.2)
        f.open_for_writing()
        faultyfs.write_control(str(spool_env), sleep_per_mb=200.0)  # 4 KiB: ~0.8 s a file
        f.commit(files(1), step=1)
        assert f.reason == "slow"
        recover(spool_env)
        r = f.commit(files(2), step=2)
        assert r.info.path.startswith(f.folder)
        assert f.flush(timeout=30) and steps_at(root / "run") == [1, 2]
        f.close()
    finally:
        undo()


def test_never_mode_does_not_spool(tmp_path, spool_env):
    f = spooled_store(f"faulty://{tmp_path / 'd' / 'run'}", spool=False)
    f.open_for_writing()
    fail(spool_env, "ENOSPC")
    with pytest.raises(OSError):
        f.commit(files(1), step=1)
    assert not os.path.isdir(f.folder)


# ------------------------------------------------------------------- verification, leases, bound
def test_corrupted_upload_is_never_committed_and_is_retried(tmp_path, spool_env, capsys):
    root = tmp_path / "disk"
    dest = root / "run"
    undo = faultyfs.patch_local_backend(str(root))
    try:
        f = spooled_store(str(dest), spool=True)
        f.open_for_writing()
        faultyfs.write_control(str(spool_env), corrupt_until=FAR)  # every byte written is flipped
        f.commit(files(1), step=1)
        wait_for(lambda: f.uploader.last_error and "does not match" in f.uploader.last_error,
                 what="the read-back check to fail")
        assert steps_at(dest) == []  # no manifest over bad data
        recover(spool_env)
        assert f.flush(timeout=30) and steps_at(dest) == [1]
        f.close()
        verify_cli(dest, capsys)
    finally:
        undo()


def test_run_locked_by_another_live_session_raises_at_open(tmp_path):
    dest = tmp_path / "dest" / "run"
    dest.mkdir(parents=True)
    (dest / "LEASE.json").write_text(json.dumps({
        "owner": "someone-else", "host": "another-host", "pid": 1, "heartbeat": time.time(), "ttl": 600}))
    f = spooled_store(f"faulty://{dest}")
    with pytest.raises(RunLockedError):
        f.open_for_writing()


def test_bound_drops_only_superseded_never_the_newest(tmp_path, spool_env, capsys):
    f = spooled_store(f"faulty://{tmp_path / 'd' / 'run'}", keep=2, max_bytes=6000)
    f.open_for_writing()
    fail(spool_env, "EIO")
    for s in (1, 2, 3, 4):
        f.commit(files(s), step=s)
    # 4 checkpoints of ~4.1 kB against a 6 kB bound: 1 and 2 are superseded by keep=2 newer ones
    assert [c.step for c in f.pending()] == [3, 4]
    assert "over its bound" in capsys.readouterr().err  # 3 is kept although the bound is exceeded
    g = spooled_store(f"faulty://{tmp_path / 'e' / 'run'}", keep=None, max_bytes=6000)
    g.open_for_writing()
    for s in (1, 2, 3):
        g.commit(files(s), step=s)
    assert [c.step for c in g.pending()] == [1, 2, 3]  # keep everything: nothing may be dropped



def test_a_spooled_manifest_being_written_is_not_taken_for_damage(tmp_path, spool_env, monkeypatch):
    """The uploader lists the spool from its own thread while the writer commits into it. A manifest
    it read half-written would look like a damaged checkpoint, which it removes: the newest one, lost.
    Here the uploader makes a whole pass while the writer holds the manifest open, empty."""
    dest = tmp_path / "d" / "run"
    f = spooled_store(f"faulty://{dest}")
    f.open_for_writing()
    f.commit(files(1), step=1)
    assert f.flush(timeout=30)
    open_write = LocalBackend.open_write

    def open_then_let_the_uploader_look(backend, path):
        out = open_write(backend, path)
        if MANIFEST in os.path.basename(path) and path.startswith(f.folder):
            f.uploader.wait_settled(5)  # the uploader's pass, with this file open and empty
        return out

    monkeypatch.setattr(LocalBackend, "open_write", open_then_let_the_uploader_look)
    f.commit(files(2), step=2)
    monkeypatch.undo()
    assert f.flush(timeout=30)
    assert steps_at(dest) == [1, 2] and [c.step for c in f.spool.cached()] == [2]
    f.close()

def test_after_an_outage_superseded_checkpoints_are_not_uploaded(tmp_path, spool_env):
    dest = tmp_path / "d" / "run"
    f = spooled_store(f"faulty://{dest}", keep=2)
    f.open_for_writing()
    fail(spool_env, "EIO")
    for s in (1, 2, 3, 4, 5):
        f.commit(files(s), step=s)
    recover(spool_env)
    assert f.flush(timeout=30)
    assert steps_at(dest) == [4, 5]  # newest first; the rest would be deleted by retention anyway
    assert f.uploader.dropped == 3
    f.close()


# ---------------------------------------------------------------------------------- resume
def save(ckpt, step, value):
    import numpy as np

    ckpt.counters["step"] = step
    ckpt.save(lambda: {"objects": {"w": np.full(8, value, dtype=np.float32)}}, reason="test")
    ckpt.writer.wait()


def die(ckpt):
    """What a killed process leaves: its spool as it is, no uploads going on. (Its leases are
    released here because this process lives on: a dead one's would simply not be live.)"""
    ckpt.writer.wait()
    spool_mod.UPLOADERS.stop_all(timeout=10)
    ckpt.spooled.spool.lease.release()
    ckpt.saver.opened = False


def test_resume_takes_the_newest_of_spool_and_destination(tmp_path, spool_env, capsys):
    dest = tmp_path / "dest" / "run"
    url = f"faulty://{dest}"
    a = Checkpointer(url, quiet=True, keep=None)
    a.load()
    save(a, 10, 1.0)
    a.flush(timeout=30)
    assert steps_at(dest) == [10]
    fail(spool_env, "EIO")
    save(a, 20, 2.0)  # only in the spool
    die(a)

    b = Checkpointer(url, quiet=True, keep=None)
    recover(spool_env)
    tree = b.load()  # the destination answers: both are looked at, the spool's step 20 wins
    assert tree["counters"]["step"] == 20 and b.resumed_from.path.startswith(b.spooled.folder)
    b.close()
    b.flush(timeout=30)

    # damage the spooled copy of a newer one: resume falls back to the destination's
    fail(spool_env, "EIO")
    c = Checkpointer(url, quiet=True, keep=None)
    c.load()
    save(c, 30, 3.0)
    die(c)
    spooled = c.spooled.pending()[-1]
    with open(os.path.join(spooled.path, "tensors.safetensors"), "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)[0]
        fh.seek(-1, 2)
        fh.write(bytes([last ^ 0xFF]))  # a flipped bit, whatever the byte was
    recover(spool_env)
    d = Checkpointer(url, quiet=True, keep=None)
    tree = d.load()
    assert tree["counters"]["step"] == 20 and "damaged" in capsys.readouterr().err
    d.close()


def test_resume_while_the_destination_is_down_uses_the_spool(tmp_path, spool_env, capsys):
    url = f"faulty://{tmp_path / 'dest' / 'run'}"
    a = Checkpointer(url, quiet=True, keep=None)
    a.load()
    fail(spool_env, "ENOTCONN")
    save(a, 5, 1.0)
    die(a)
    b = Checkpointer(url, quiet=True, keep=None)
    b.store.retry = RetryPolicy(attempts=1)
    tree = b.load()
    assert tree["counters"]["step"] == 5
    assert "cannot read" in capsys.readouterr().err
    recover(spool_env)
    b.close()


def test_the_newest_upload_stays_as_a_local_cache(tmp_path, spool_env):
    dest = tmp_path / "dest" / "run"
    url = f"faulty://{dest}"
    a = Checkpointer(url, quiet=True, keep=None)
    a.load()
    for step in (5, 6):
        save(a, step, float(step))
        a.flush(timeout=30)
    assert steps_at(dest) == [5, 6] and a.spooled.pending() == []
    assert [c.step for c in a.spooled.spool.cached()] == [6]  # only the newest upload is kept locally
    die(a)
    fail(spool_env, "EIO")  # the destination is down: resume from the copy on this machine
    b = Checkpointer(url, quiet=True, keep=None)
    assert b.load()["counters"]["step"] == 6 and b.resumed_from.path.startswith(b.spooled.folder)
    die(b)
    recover(spool_env)
    shutil.rmtree(dest)  # the run deleted at the destination on purpose: the cache does not revive it
    c = Checkpointer(url, quiet=True, keep=None)
    assert c.load() is None
    c.close()



@pytest.mark.parametrize("paused", ["eviction", "retention"])
def test_flush_returns_only_once_the_spool_is_settled(tmp_path, spool_env, monkeypatch, paused):
    """The uploader marks a checkpoint uploaded before it evicts the older local copy the new one
    supersedes and before the destination's retention runs. "Nothing pending" is not "done": a flush
    that starts in between returns only once both happened. The uploader is held in that window
    until the flush has had time to return too early."""
    dest = tmp_path / "d" / "run"
    f = spooled_store(f"faulty://{dest}", keep=1)
    f.open_for_writing()
    f.commit(files(5), step=5)
    assert f.flush(timeout=30) and [c.step for c in f.spool.cached()] == [5]
    in_window, release = threading.Event(), threading.Event()

    def hold() -> None:
        in_window.set()
        release.wait(30)

    if paused == "eviction":  # 6 is marked uploaded, the copy of 5 it supersedes is still there
        mark_uploaded = spool_mod.Spool.mark_uploaded

        def mark_then_hold(spool, info):
            mark_uploaded(spool, info)
            hold()

        monkeypatch.setattr(spool_mod.Spool, "mark_uploaded", mark_then_hold)
    else:  # 6 is uploaded and its local copy settled, 5 is not removed at the destination yet
        apply_retention = CheckpointStore.apply_retention

        def hold_then_apply(store):
            if store is f.dest:
                hold()
            return apply_retention(store)

        monkeypatch.setattr(CheckpointStore, "apply_retention", hold_then_apply)
    f.commit(files(6), step=6)
    assert in_window.wait(30)
    assert f.pending() == []  # 6 counts as uploaded already
    result = {}
    flusher = threading.Thread(target=lambda: result.update(ok=f.flush(timeout=30)))
    flusher.start()
    flusher.join(0.5)
    returned_early = not flusher.is_alive()
    release.set()
    flusher.join(30)
    assert not returned_early, "flush() returned while the uploader was still at work"
    assert result == {"ok": True}
    assert [c.step for c in f.spool.cached()] == [6] and steps_at(dest) == [6]
    f.close()


def test_a_listing_overtaken_by_an_upload_is_not_taken_for_settled(tmp_path, spool_env, monkeypatch):
    """settled() lists the spool; an upload may start and mark its checkpoint uploaded while that
    listing runs. The listing then shows nothing pending although the local copy the upload
    supersedes is not evicted yet: settled() must see that the uploader was at work meanwhile.
    Events force the order: the uploader's pass waits until the listing has begun, the listing
    waits until the upload is marked done, and the uploader holds before its eviction."""
    dest = tmp_path / "d" / "run"
    f = spooled_store(f"faulty://{dest}")
    f.open_for_writing()
    f.commit(files(5), step=5)
    assert f.flush(timeout=30)
    up = f.uploader
    me = threading.current_thread()
    listing, marked, release = threading.Event(), threading.Event(), threading.Event()
    hold_my_listing = []  # armed once commit 6 is in
    spool_list, mark_uploaded = spool_mod.Spool.list, spool_mod.Spool.mark_uploaded

    def list_in_order(spool, *args, **kwargs):
        if threading.current_thread() is me and hold_my_listing:
            hold_my_listing.clear()
            listing.set()
            marked.wait(30)
        elif threading.current_thread() is not me:
            listing.wait(30)  # the uploader looks only once the listing has begun
        return spool_list(spool, *args, **kwargs)

    def mark_then_hold(spool, info):
        mark_uploaded(spool, info)
        marked.set()
        release.wait(30)

    monkeypatch.setattr(spool_mod.Spool, "list", list_in_order)
    monkeypatch.setattr(spool_mod.Spool, "mark_uploaded", mark_then_hold)
    f.commit(files(6), step=6)
    hold_my_listing.append(True)
    try:
        assert not up.settled(), "the listing saw 6 uploaded while 5 was not evicted yet"
    finally:
        release.set()
    assert f.flush(timeout=30)
    assert [c.step for c in f.spool.cached()] == [6]
    f.close()

# ---------------------------------------------------------------------------------- flush
def test_close_waits_bounded_and_says_what_is_pending(tmp_path, spool_env, capsys):
    url = f"faulty://{tmp_path / 'dest' / 'run'}"
    a = Checkpointer(url, quiet=True, flush_timeout=1.0)
    a.load()
    fail(spool_env, "EIO")
    save(a, 7, 1.0)
    a.close()  # returns although the upload cannot finish
    out = capsys.readouterr().err
    assert "not uploaded" in out and f"keepalive sync {url}" in out and "newest step 7" in out
    a.flush()  # nothing moved since: no second report
    assert "not uploaded" not in capsys.readouterr().err
    recover(spool_env)


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_silences_news_but_not_warnings(tmp_path, spool_env, capsys, quiet):
    dest = CheckpointStore(f"faulty://{tmp_path / 'dest' / 'run'}", keep=None,
                           retry=RetryPolicy(attempts=2, initial_delay=0.02, max_delay=0.05))
    f = spool_mod.SpooledStore(dest, quiet=quiet)
    f.open_for_writing()
    fail(spool_env, "EIO")
    f.commit(files(1), step=1)
    assert not f.flush(timeout=2.5)  # news: "waiting up to ..."; warning: what is not uploaded
    out = capsys.readouterr()
    assert ("waiting up to" in out.out) is not quiet
    assert "not uploaded" in out.err and "cannot upload checkpoints" in out.err
    recover(spool_env)
    assert f.flush(timeout=30)
    f.close()


@pytest.fixture
def fake_colab(tmp_path, monkeypatch):
    """Colab's own module is the one thing mocked here: it exists only on Colab VMs. The Drive mount
    is a folder standing in for /content/drive."""
    calls = {"flush_and_unmount": 0, "sync": 0}
    drive = types.ModuleType("google.colab.drive")
    drive.flush_and_unmount = lambda: calls.__setitem__("flush_and_unmount", calls["flush_and_unmount"] + 1)
    colab = types.ModuleType("google.colab")
    colab.drive = drive
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.drive", drive)
    root = tmp_path / "content" / "drive"
    (root / "MyDrive").mkdir(parents=True)
    monkeypatch.setattr(mount_mod, "DRIVE_ROOT", str(root))
    monkeypatch.setattr(mount_mod, "is_mount", lambda p: os.path.isdir(p))
    real_sync = os.sync
    monkeypatch.setattr(os, "sync", lambda: (calls.__setitem__("sync", calls["sync"] + 1), real_sync())[1])
    return root, calls


@pytest.mark.parametrize("drive_flush", [True, False])
def test_drive_destination_flush_on_colab(fake_colab, capsys, drive_flush):
    root, calls = fake_colab
    run = root / "MyDrive" / "runs" / "x"
    a = Checkpointer(str(run), quiet=True, drive_flush=drive_flush)
    assert a.spooled.drive and a.spooled.spooling  # Drive paths always go through the spool
    a.load()
    save(a, 3, 1.0)
    a.flush()  # mid-run flush: sync only
    assert calls["sync"] >= 1 and calls["flush_and_unmount"] == 0
    a.finished = True
    a.flush()  # end of the run
    a.close()
    assert steps_at(run) == [3]
    out = capsys.readouterr().err
    if drive_flush:
        assert calls["flush_and_unmount"] == 1 and "unmounted" in out
    else:
        assert calls["flush_and_unmount"] == 0
        assert out.count("drive.flush_and_unmount()") == 1


def test_drive_not_mounted_is_spooled_not_written_to_the_vm_disk(fake_colab, monkeypatch, capsys):
    root, _ = fake_colab
    monkeypatch.setattr(mount_mod, "is_mount", lambda p: False)
    run = root / "MyDrive" / "runs" / "y"
    f = spooled_store(str(run))
    f.open_for_writing()
    f.commit(files(1), step=1)
    assert not f.flush(timeout=0.5)
    wait_for(lambda: f.uploader.failing is not None, what="the report")
    assert "Google Drive is not mounted" in capsys.readouterr().err
    assert not run.exists()


def test_upload_progress_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_PROGRESS", "1")
    monkeypatch.setenv("KEEPALIVE_PROGRESS_MIN_BYTES", "1000")
    dest = CheckpointStore(f"faulty://{tmp_path / 'd' / 'run'}", keep=None)
    f = spool_mod.SpooledStore(dest, quiet=False)
    f.open_for_writing()
    f.commit(files(1, size=200_000), step=1)
    assert f.flush(timeout=30)
    assert "uploading step 1" in capsys.readouterr().err
    f.close()


def test_rerun_cell_shares_the_uploader_and_its_lease(tmp_path, spool_env):
    url = f"faulty://{tmp_path / 'dest' / 'run'}"
    a = Checkpointer(url, quiet=True, keep=None)
    a.load()
    fail(spool_env, "EIO")
    save(a, 1, 1.0)
    b = Checkpointer(url, quiet=True, keep=None)  # the same cell run again, same process
    b.load()  # hands the run over from `a`
    save(b, 2, 2.0)
    assert b.spooled.uploader is not None and len(spool_mod.UPLOADERS) == 1
    recover(spool_env)
    b.flush(timeout=30)
    assert steps_at(tmp_path / "dest" / "run") == [1, 2]
    b.close()


# --------------------------------------------------------------------------- status and sync
CRASHED_TRAINER = r"""
import os, sys
sys.path.insert(0, {tests!r})
import faultyfs
from keepalive.store import CheckpointStore, RetryPolicy
from keepalive.spool import SpooledStore
faultyfs.patch_local_backend({root!r})
f = SpooledStore(CheckpointStore({dest!r}, keep=None, retry=RetryPolicy(attempts=1)), True, quiet=True)
f.open_for_writing()
for s in (1, 2, 3):
    f.commit({{"a.bin": bytes([s]) * 3000}}, step=s)
print("SPOOLED", flush=True)
os._exit(0)  # dies like a crashed kernel: no flush, no lease release
"""


def test_status_and_sync_after_a_crash(tmp_path, spool_env, capsys):
    root = tmp_path / "disk"
    dest = root / "run"
    fail(spool_env, "EIO")
    code = CRASHED_TRAINER.format(tests=os.path.dirname(__file__), root=str(root), dest=str(dest))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert "SPOOLED" in r.stdout, r.stdout + r.stderr

    capsys.readouterr()
    assert cli.main(["status", "--json", "--dir", str(tmp_path)]) == 0
    pending = json.loads(capsys.readouterr().out)["pending_uploads"]
    assert pending["count"] == 3 and pending["bytes"] >= 9000
    assert pending["oldest_age_seconds"] >= 0 and pending["destinations"][0]["destination"] == str(dest)
    assert cli.main(["status", "--dir", str(tmp_path)]) == 0
    assert "3 checkpoint(s)" in capsys.readouterr().out

    env = dict(os.environ)
    # still failing: `keepalive sync` gives up after --timeout, exit 1 (the local destination is
    # broken through the patched backend only in this test process, so sync runs in-process here)
    undo = faultyfs.patch_local_backend(str(root))
    try:
        assert cli.main(["sync", str(dest), "--timeout", "1"]) == 1
    finally:
        undo()
    capsys.readouterr()
    # recovered: a separate process uploads everything
    r = subprocess.run([sys.executable, "-m", "keepalive", "sync", str(dest), "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert result["ok"] and result["destinations"][0]["uploaded"] == 3
    assert steps_at(dest) == [1, 2, 3]
    verify_cli(dest, capsys)
    assert runs.pending_summary() is None
    r = subprocess.run([sys.executable, "-m", "keepalive", "sync"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and "nothing" in r.stdout.lower()


def test_sync_help():
    r = subprocess.run([sys.executable, "-m", "keepalive", "sync", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "usage: keepalive sync" in r.stdout and "--timeout" in r.stdout


def test_parse_and_modes():
    assert parse_bytes("10GB") == 10 * 10 ** 9
    assert parse_bytes("5GiB") == 5 * 2 ** 30
    assert parse_bytes("500M") == 500 * 10 ** 6
    assert spool_mod.resolve_mode(True) == "always" and spool_mod.resolve_mode(False) == "never"
    with pytest.raises(ValueError):
        spool_mod.resolve_mode("sometimes")
    assert spool_mod.public_options({"key": "k", "secret": "s", "token": "t",
                                     "client_kwargs": {"endpoint_url": "http://x"}}) == {
        "client_kwargs": {"endpoint_url": "http://x"}}

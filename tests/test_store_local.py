"""Local-folder specifics of the store: unusable paths, foreign folders, the writer lease across
processes (dead, zombie, other host, expired, torn), and what ``keepalive.runs.locate`` finds."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from keepalive.errors import NoCheckpointError, RunLockedError, StorageError
from keepalive.runs import find_runs, locate
from keepalive.store import LEASE, CheckpointStore


def blob(step: int) -> dict:
    return {"state.json": json.dumps({"step": step}).encode(), "data.bin": bytes([step % 256]) * 4096}


# ----------------------------------------------------------------------------- unusable paths
def test_path_below_a_regular_file_is_a_clear_error(tmp_path):
    (tmp_path / "afile").write_bytes(b"not a folder")
    store = CheckpointStore(tmp_path / "afile" / "run")
    with pytest.raises(StorageError) as exc:
        store.commit(blob(1), step=1)
    msg = str(exc.value)
    assert "cannot create or write the run folder" in msg and str(tmp_path / "afile" / "run") in msg
    assert isinstance(exc.value, OSError)
    with pytest.raises(StorageError) as exc:
        store.newest_valid()
    assert "is not a run folder: it, or a folder above it, is a file" in str(exc.value)


def test_run_path_that_is_a_file(tmp_path):
    (tmp_path / "run").write_bytes(b"x")
    store = CheckpointStore(tmp_path / "run")
    with pytest.raises(StorageError):
        store.open_for_writing()
    with pytest.raises(StorageError) as exc:
        store.list()
    assert "is not a run folder" in str(exc.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores permission bits; covered by the path-below-a-file tests")
def test_read_only_folder_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StorageError) as exc:
            CheckpointStore(ro / "run").commit(blob(1), step=1)
        assert "cannot create or write" in str(exc.value)
    finally:
        ro.chmod(0o700)


def test_checkpoint_folder_cannot_be_created(tmp_path):
    """The run exists and is leased, but the checkpoint's own folder cannot be made (here: a file
    of that name sits there): a StorageError naming the checkpoint, and older ones stay valid."""
    store = CheckpointStore(tmp_path / "run")
    good = store.commit(blob(1), step=1).info
    store._new_name = lambda step: "ckpt-0000000002-blocked"
    (tmp_path / "run" / "ckpt-0000000002-blocked").write_bytes(b"squatter")
    with pytest.raises(StorageError) as exc:
        store.commit(blob(2), step=2)
    assert "ckpt-0000000002-blocked" in str(exc.value)
    assert store.newest_valid().name == good.name
    store.close()


# -------------------------------------------------------------------------------- foreign data
def test_foreign_folder(tmp_path):
    foreign = tmp_path / "photos"
    (foreign / "2020").mkdir(parents=True)
    (foreign / "2020" / "a.jpg").write_bytes(b"\xff\xd8")
    (foreign / "notes.txt").write_text("hello")
    store = CheckpointStore(foreign)
    assert store.list() == [] and store.newest_valid() is None
    assert find_runs(foreign) == []
    with pytest.raises(NoCheckpointError) as exc:
        locate(foreign)
    assert "no keepalive run or checkpoint" in str(exc.value)
    with pytest.raises(NoCheckpointError):
        locate(tmp_path / "does-not-exist")


def test_foreign_ckpt_named_folder_is_not_trusted(tmp_path):
    """A folder that merely looks like a checkpoint (ckpt-* name, a MANIFEST.json of other JSON)."""
    run = tmp_path / "run"
    (run / "ckpt-0000000009-deadbeef").mkdir(parents=True)
    (run / "ckpt-0000000009-deadbeef" / "MANIFEST.json").write_text(json.dumps({"files": []}))
    (run / "ckpt-0000000010-cafecafe").mkdir()
    (run / "ckpt-0000000010-cafecafe" / "data.bin").write_bytes(b"x")
    store = CheckpointStore(run)
    listed = store.list(include_uncommitted=True)
    assert {c.name: c.valid for c in listed} == {"ckpt-0000000009-deadbeef": False,
                                                 "ckpt-0000000010-cafecafe": False}
    assert "not a keepalive manifest" in listed[0].error
    assert store.newest_valid() is None


def test_locate_kinds(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    a, b = CheckpointStore(root / "a"), CheckpointStore(root / "nested" / "b")
    ia = a.commit(blob(1), step=1).info
    b.commit(blob(2), step=2)
    a.close(), b.close()
    where = locate(root)
    assert where.kind == "root"
    assert [r.url for r in where.runs] == [str(root / "a"), str(root / "nested" / "b")]
    where = locate(root / "a")
    assert where.kind == "run" and [r.destination.path for r in where.runs] == [str(root / "a")]
    where = locate(ia.path)
    info, store = where.checkpoint, where.runs[0].destination
    assert where.kind == "checkpoint" and info.name == ia.name and store.verify(info).valid
    # a bare relative checkpoint folder name (``keepalive verify ckpt-...`` inside the run)
    monkeypatch.chdir(root / "a")
    where = locate(ia.name)
    info, store = where.checkpoint, where.runs[0].destination
    assert where.kind == "checkpoint" and store.path == str(root / "a") and store.verify(info).valid


# ------------------------------------------------------------------------------------- leases
def _write_lease(run, **fields):
    body = {"owner": "someone-else", "host": socket.gethostname(), "pid": 1, "pid_start": None,
            "heartbeat": time.time(), "ttl": 120.0, "released": False}
    body.update(fields)
    (run / LEASE).write_text(json.dumps(body))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lease_of_dead_process_is_taken(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_lease(run, pid=_dead_pid())
    store = CheckpointStore(run)
    store.open_for_writing()  # no takeover needed: same host, that pid is gone
    assert store.commit(blob(1), step=1).info.valid
    store.close()


def test_lease_of_zombie_process_is_taken(tmp_path):
    """A killed writer its parent has not reaped yet (a zombie) holds nothing."""
    run = tmp_path / "run"
    run.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 10
        while time.time() < deadline:  # wait until it has exited but is not reaped
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        _write_lease(run, pid=child.pid)
        store = CheckpointStore(run)
        store.open_for_writing()
        store.close()
    finally:
        child.wait()


def test_lease_of_live_process_locks(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lease(run, pid=sleeper.pid)
        with pytest.raises(RunLockedError) as exc:
            CheckpointStore(run).open_for_writing()
        assert f"pid {sleeper.pid}" in str(exc.value)
    finally:
        sleeper.kill()
        sleeper.wait()
    CheckpointStore(run).open_for_writing()  # now it is dead


def test_lease_of_reused_pid_is_taken(tmp_path):
    """Same pid, but a different process start time: the pid was recycled."""
    run = tmp_path / "run"
    run.mkdir()
    _write_lease(run, pid=os.getpid(), pid_start=1)
    store = CheckpointStore(run)
    store.open_for_writing()
    store.close()


def test_lease_of_other_host(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_lease(run, host="another-vm", pid=4242)
    with pytest.raises(RunLockedError) as exc:
        CheckpointStore(run).open_for_writing()
    assert "another-vm" in str(exc.value)
    _write_lease(run, host="another-vm", pid=4242, heartbeat=time.time() - 1000)  # expired
    CheckpointStore(run).open_for_writing()


@pytest.mark.parametrize("content", [b"", b'{"owner": "x", "host"', b"[1, 2]", b"\x00\xff"])
def test_torn_or_foreign_lease_holds_nothing(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / LEASE).write_bytes(content)
    store = CheckpointStore(run)
    store.commit(blob(1), step=1)
    assert json.loads((run / LEASE).read_text())["owner"] == store.lease.owner
    store.close()


def test_close_releases_lease(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    store.commit(blob(1), step=1)
    store.close()
    assert json.loads((tmp_path / "run" / LEASE).read_text())["released"] is True
    other = CheckpointStore(tmp_path / "run")
    other.open_for_writing()
    other.commit(blob(2), step=2)
    assert [c.step for c in other.list()] == [1, 2]
    other.close()


def test_lease_file_deleted_is_reclaimed(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    store.commit(blob(1), step=1)
    (tmp_path / "run" / LEASE).unlink()
    store.commit(blob(2), step=2)
    assert json.loads((tmp_path / "run" / LEASE).read_text())["owner"] == store.lease.owner
    store.close()


def test_fsync_off_still_valid(tmp_path):
    store = CheckpointStore(tmp_path / "run", fsync=False)
    info = store.commit(blob(7), step=7).info
    assert store.verify(info).valid
    store.close()


def test_read_files_are_private_copies(tmp_path):
    """Local reads are copy-on-write maps: writing to them never changes the checkpoint."""
    store = CheckpointStore(tmp_path / "run")
    info = store.commit(blob(3), step=3).info
    files = store.read_files(info)
    view = files["data.bin"]
    view[0] = 0xAB
    assert store.verify(store.list()[0]).valid
    assert store.read_file(info, "data.bin")[0] == 3
    store.close()

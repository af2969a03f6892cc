"""The checkpoint store on every storage kind: local folder, memory://, gs:// (gcp-storage-emulator)
and s3:// (moto server): write, list, newest-valid, fallback, retention, verify, and damaged
checkpoints, each of which must be skipped (falling back to an older one), never loaded."""
from __future__ import annotations

import json

import pytest

from keepalive.errors import CheckpointCorruptError, LeaseLostError, RunLockedError
from keepalive.store import MANIFEST, _manifest_digest


def files_for(step: int, size: int = 3000) -> dict:
    body = bytes((step * 7 + i) % 251 for i in range(size))
    return {"state.json": json.dumps({"step": step}).encode(), "blob.bin": [body[:1000], body[1000:]]}


def expected_blob(step: int, size: int = 3000) -> bytes:
    return bytes((step * 7 + i) % 251 for i in range(size))


def commit_steps(store, steps, epoch_of=lambda s: s // 10):
    return [store.commit(files_for(s), step=s, epoch=epoch_of(s)).info for s in steps]


def file_path(store, info, name):
    return store.backend.join(info.path, name)


# ------------------------------------------------------------------------------- damage helpers
def truncate(store, info, name="blob.bin"):
    p = file_path(store, info, name)
    data = store.backend.read_bytes(p)
    store.backend.write_bytes(p, data[: len(data) // 2])


def flip_byte(store, info, name="blob.bin", at=1234):
    p = file_path(store, info, name)
    data = bytearray(store.backend.read_bytes(p))
    data[at % len(data)] ^= 0x01
    store.backend.write_bytes(p, bytes(data))


def drop_manifest(store, info):
    store.backend.remove_file(file_path(store, info, MANIFEST))


def drop_file(store, info, name="blob.bin"):
    store.backend.remove_file(file_path(store, info, name))


def manifest_names_missing_file(store, info):
    """A manifest that is self-consistent (own checksum recomputed) but names a file never written."""
    p = file_path(store, info, MANIFEST)
    manifest = json.loads(store.backend.read_bytes(p))
    manifest["files"].append({"name": "extra.bin", "size": 10, "checksum": "0" * 16})
    manifest["manifest_checksum"] = _manifest_digest(manifest)
    store.backend.write_bytes(p, json.dumps(manifest).encode())


def tear_manifest(store, info):
    p = file_path(store, info, MANIFEST)
    data = store.backend.read_bytes(p)
    store.backend.write_bytes(p, data[: len(data) // 2])


def edit_manifest(store, info):
    """Valid JSON, but a field changed without its checksum: must not be trusted."""
    p = file_path(store, info, MANIFEST)
    manifest = json.loads(store.backend.read_bytes(p))
    manifest["step"] = 10 ** 9
    store.backend.write_bytes(p, json.dumps(manifest).encode())


def lie_about_size(store, info):
    """Manifest re-signed with a wrong size: the file itself is checked, not only the manifest."""
    p = file_path(store, info, MANIFEST)
    manifest = json.loads(store.backend.read_bytes(p))
    manifest["files"][-1]["size"] += 1
    manifest["manifest_checksum"] = _manifest_digest(manifest)
    store.backend.write_bytes(p, json.dumps(manifest).encode())


DAMAGE = {
    "truncated": (truncate, "truncated"),
    "flipped-byte": (flip_byte, "checksum"),
    "missing-file": (drop_file, "missing"),
    "manifest-names-missing-file": (manifest_names_missing_file, "extra.bin is missing"),
    "torn-manifest": (tear_manifest, "not valid JSON"),
    "edited-manifest": (edit_manifest, "own checksum"),
    "size-lie": (lie_about_size, "bytes, the manifest says"),
}


# ------------------------------------------------------------------------------------- basics
def test_write_list_read(location):
    store = location.store(keep=None)
    assert store.list() == []
    assert store.newest_valid() is None
    infos = commit_steps(store, [0, 5, 12])
    listed = store.list()
    assert [c.step for c in listed] == [0, 5, 12]
    assert [c.epoch for c in listed] == [0, 0, 1]
    assert [c.seq for c in listed] == [1, 2, 3]
    assert [c.name for c in listed] == [i.name for i in infos]
    for c in listed:
        assert c.name.startswith("ckpt-") and c.run == "run" and c.committed and c.error is None
        assert c.size_bytes == 3000 + len(json.dumps({"step": c.step}))
        assert c.url.startswith(location.url if location.kind != "memory" else "memory://")
        assert store.verify(c).valid is True
        got = store.read_files(c)
        assert set(got) == {"state.json", "blob.bin"}
        assert bytes(got["blob.bin"]) == expected_blob(c.step)
        assert json.loads(bytes(got["state.json"])) == {"step": c.step}
    newest = store.newest_valid()
    assert newest.step == 12 and store.read_file(newest, "blob.bin") == expected_blob(12)
    assert newest.manifest["versions"]["keepalive"]
    store.close()
    # a second store object (a new process after a reset) sees the same
    again = location.store()
    assert [c.step for c in again.list()] == [0, 5, 12]
    assert again.newest_valid().name == newest.name


def test_commit_result_and_metadata(location):
    store = location.store()
    res = store.commit(files_for(3), step=3, epoch=1, metadata={"lr": 0.1, "note": "x"})
    assert res.bytes_written == 3000 + len(json.dumps({"step": 3}))
    assert res.info.valid is True and res.seconds >= 0
    assert store.newest_valid().manifest["metadata"] == {"lr": 0.1, "note": "x"}
    with pytest.raises(ValueError):
        store.commit({MANIFEST: b"x"}, step=4)
    with pytest.raises(ValueError):
        store.commit({"a/b": b"x"}, step=4)
    store.close()


def test_retention_keep_last(location):
    store = location.store(keep=2)
    removed = []
    for s in range(5):
        removed += store.commit(files_for(s), step=s).removed
    assert [c.step for c in store.list()] == [3, 4]
    assert len(removed) == 3
    assert [c.step for c in store.list(include_uncommitted=True)] == [3, 4]  # no leftovers
    assert store.newest_valid().step == 4
    store.close()


def test_retention_keep_every(location):
    store = location.store(keep=2, keep_every=3)
    for s in range(10):
        store.commit(files_for(s * 100), step=s * 100)
    listed = store.list()
    assert [c.seq for c in listed] == [3, 6, 9, 10]
    assert [c.step for c in listed] == [200, 500, 800, 900]
    assert all(store.verify(c).valid for c in listed)
    store.close()


def test_keep_none_keeps_all(location):
    store = location.store(keep=None)
    commit_steps(store, range(4))
    assert store.apply_retention() == []
    assert len(store.list()) == 4
    store.close()
    with pytest.raises(ValueError):
        location.store(keep=0)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back(location, damage):
    fn, reason = DAMAGE[damage]
    store = location.store(keep=None)
    infos = commit_steps(store, [1, 2, 3])
    store.close()
    fn(store, infos[-1])

    reader = location.store()
    listed = reader.list(include_uncommitted=True)
    bad = [c for c in listed if c.name == infos[-1].name]
    assert len(bad) == 1
    # verify names the problem
    assert reader.verify(bad[0]).valid is False
    assert reason in bad[0].error, bad[0].error
    # reading it raises instead of handing out bad bytes
    with pytest.raises(CheckpointCorruptError) as exc:
        reader.read_files(bad[0])
    assert infos[-1].name in str(exc.value)
    # resume falls back to the previous checkpoint
    skipped = []
    newest = reader.newest_valid(on_corrupt=skipped.append)
    assert newest.name == infos[-2].name and newest.step == 2
    assert [s.name for s in skipped] == [infos[-1].name]
    assert bytes(reader.read_files(newest)["blob.bin"]) == expected_blob(2)


def test_missing_manifest_is_not_a_checkpoint(location):
    store = location.store(keep=None)
    infos = commit_steps(store, [1, 2])
    drop_manifest(store, infos[-1])
    assert [c.name for c in store.list()] == [infos[0].name]
    leftover = [c for c in store.list(include_uncommitted=True) if not c.committed]
    assert [c.name for c in leftover] == [infos[1].name]
    assert leftover[0].valid is False and "no manifest" in leftover[0].error
    with pytest.raises(CheckpointCorruptError):
        store.read_files(leftover[0])
    assert store.newest_valid().name == infos[0].name
    store.close()
    # the next writer garbage-collects the unfinished folder, keeps the good one
    writer = location.store(keep=None)
    writer.open_for_writing()
    assert [c.name for c in writer.list(include_uncommitted=True)] == [infos[0].name]
    writer.close()


def test_all_damaged_gives_none(location):
    store = location.store(keep=None)
    infos = commit_steps(store, [1, 2])
    store.close()
    flip_byte(store, infos[0])
    truncate(store, infos[1])
    assert store.newest_valid() is None


def test_retention_never_counts_unfinished_folders(location):
    store = location.store(keep=2)
    infos = commit_steps(store, [1, 2])
    drop_manifest(store, infos[1])  # as if the write of step 2 had crashed before its manifest
    commit_steps(store, [3])
    assert [c.step for c in store.list()] == [1, 3]
    store.close()


def test_vanished_run_folder(location):
    """The run folder is deleted between two writes: the next commit must not fail silently or
    hand out anything stale; here it re-creates the run and writes a complete checkpoint."""
    store = location.store(keep=3)
    commit_steps(store, [1, 2])
    store.backend.remove_tree(store.path)
    reader = location.store()
    assert reader.list() == [] and reader.newest_valid() is None
    info = store.commit(files_for(3), step=3).info
    listed = reader.list()
    assert [c.name for c in listed] == [info.name]
    assert reader.newest_valid().step == 3
    assert bytes(reader.read_files(listed[0])["blob.bin"]) == expected_blob(3)
    store.close()


def test_two_writers(location):
    first = location.store()
    first.commit(files_for(1), step=1)
    second = location.store()
    with pytest.raises(RunLockedError) as exc:
        second.open_for_writing()
    msg = str(exc.value)
    assert "another session" in msg and "takeover=True" in msg and str(first.lease.pid) in msg
    # committing without opening first takes the same path
    with pytest.raises(RunLockedError):
        second.commit(files_for(2), step=2)
    second.open_for_writing(takeover=True)
    second.commit(files_for(2), step=2)
    with pytest.raises(LeaseLostError) as lost:
        first.commit(files_for(3), step=3)
    assert "taken over" in str(lost.value)
    # the loser wrote nothing that counts; the winner's checkpoints are intact
    assert [c.step for c in second.list()] == [1, 2]
    assert second.newest_valid().step == 2
    # and the loser stays out: its next commit finds a live lease
    with pytest.raises(RunLockedError):
        first.commit(files_for(4), step=4)
    second.commit(files_for(5), step=5)
    second.close()
    # after a clean close the run is free again
    third = location.store()
    third.open_for_writing()
    third.commit(files_for(6), step=6)
    assert third.newest_valid().step == 6
    third.close()

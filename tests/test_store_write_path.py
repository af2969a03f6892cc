"""The store's write path: each piece is hashed right after it is written (one read of the bytes),
local writes start their writeback while they go on, and a commit reports the writer's CPU time.

What must hold whatever the path does: the manifest's checksum is the xxh3 of the bytes the file
holds (a single buffer, a list of chunks of any type, a file retried after a transient failure),
and a write that fails for good leaves no manifest (the older checkpoint stays the newest)."""
from __future__ import annotations

import errno
import json
import mmap
import os
from typing import Any, Dict, List

import numpy as np
import pytest
import xxhash

from keepalive import backends
from keepalive import store as store_module
from keepalive.errors import StorageError
from keepalive.store import MANIFEST, CheckpointStore, RetryPolicy

PIECE = 4096  # small pieces and writeback steps, so that a few KiB cross many piece borders


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(backends.LocalBackend, "write_piece", PIECE)
    monkeypatch.setattr(backends, "WRITEBACK_EVERY", 3 * PIECE)


def new_store(path, **kwargs) -> CheckpointStore:
    store = CheckpointStore(str(path), keep=None, fsync=True,
                            retry=RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.002), **kwargs)
    store.open_for_writing()
    return store


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def chunked_files() -> Dict[str, Any]:
    """A state.json-like small file and a tensors-like file in chunks of every buffer kind, with
    sizes that are not multiples of a piece."""
    floats = np.random.default_rng(1).standard_normal(3001).astype(np.float32)
    return {
        "state.json": json.dumps({"step": 7}).encode(),
        "blob.bin": payload(10_000),
        "tensors.safetensors": [payload(1000, 2), bytearray(payload(PIECE * 5 + 17, 3)),
                                memoryview(floats), memoryview(payload(PIECE, 4))[PIECE // 3:]],
    }


def joined(content) -> bytes:
    parts = [content] if isinstance(content, (bytes, bytearray, memoryview)) else content
    return b"".join(memoryview(p).cast("B").tobytes() for p in parts)


def assert_manifest_matches_files(store: CheckpointStore, info, files: Dict[str, Any]) -> None:
    manifest = json.loads(open(os.path.join(info.path, MANIFEST), "rb").read())
    entries = {e["name"]: e for e in manifest["files"]}
    assert set(entries) == set(files)
    for name, content in files.items():
        on_disk = open(os.path.join(info.path, name), "rb").read()
        assert on_disk == joined(content), name
        assert entries[name]["size"] == len(on_disk)
        assert entries[name]["checksum"] == xxhash.xxh3_64(on_disk).hexdigest(), name
    assert store.verify(store.load_info(info.name)).valid


class FlakyFile:
    """Wraps a file opened for writing: the first ``fail_times`` files opened for ``target`` write
    ``fail_after`` bytes (a torn write), then raise ``error``."""

    def __init__(self, inner, fail_after: int, error: OSError):
        self.inner, self.fail_after, self.error, self.written = inner, fail_after, error, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        room = self.fail_after - self.written
        if len(view) > room:
            if room > 0:
                self.inner.write(view[:room])
                self.written += room
            raise self.error
        self.written += len(view)
        return self.inner.write(view)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()


def inject(store: CheckpointStore, target: str, *, fail_times: int, fail_after: int, error: OSError
           ) -> List[str]:
    """Make the store's writes of files named ``target`` fail ``fail_times`` times; the returned list
    names every file opened for writing."""
    opened: List[str] = []
    real_open = store.backend.open_write

    def open_write(path: str):
        opened.append(os.path.basename(path))
        f = real_open(path)
        if os.path.basename(path) == target and opened.count(target) <= fail_times:
            return FlakyFile(f, fail_after, error)
        return f

    store.backend.open_write = open_write  # type: ignore[method-assign]
    return opened


# ------------------------------------------------------------------------------------- checksums
def test_single_buffers_and_chunk_lists_are_hashed_as_written(tmp_path, small_pieces):
    store = new_store(tmp_path / "run")
    single = {"one.bin": payload(PIECE * 7 + 5), "empty.bin": b""}
    r1 = store.commit(single, step=1)
    assert_manifest_matches_files(store, r1.info, single)
    files = chunked_files()
    r2 = store.commit(files, step=2)
    assert_manifest_matches_files(store, r2.info, files)
    assert r2.bytes_written == sum(len(joined(c)) for c in files.values())


def test_remote_backend_keeps_its_pieces_and_checksums():
    store = CheckpointStore("memory://write-path/run", keep=None)
    assert store.backend.write_piece == 64 << 20  # remote writes are handed over as before
    files = chunked_files()
    info = store.commit(files, step=3).info
    manifest = json.loads(store.backend.read_bytes(store.backend.join(info.path, MANIFEST)))
    for entry in manifest["files"]:
        assert entry["checksum"] == xxhash.xxh3_64(joined(files[entry["name"]])).hexdigest()
    assert store.read_files(store.newest_valid())["tensors.safetensors"] == joined(files["tensors.safetensors"])


# ----------------------------------------------------------------------------------------- retries
def test_a_file_retried_after_a_transient_failure_has_the_digest_of_its_final_bytes(tmp_path, small_pieces):
    store = new_store(tmp_path / "run")
    files = chunked_files()
    opened = inject(store, "tensors.safetensors", fail_times=1, fail_after=PIECE * 3 + 100,
                    error=OSError(errno.EIO, "injected I/O error"))
    result = store.commit(files, step=1)
    assert opened.count("tensors.safetensors") == 2  # torn once (3 pieces and a bit hashed), then rewritten
    assert_manifest_matches_files(store, result.info, files)


def test_control_a_hasher_that_kept_the_failed_attempt_is_caught(tmp_path, small_pieces, monkeypatch):
    """Negative control: were the torn attempt's pieces hashed too (no fresh start per attempt), the
    manifest would name a digest the file does not have, and the check above would see it."""

    class NoFreshStart:
        def __init__(self) -> None:
            self.inner = xxhash.xxh3_64()

        def reset(self) -> None:  # the bug: keeps what the failed attempt hashed
            pass

        def update(self, data) -> None:
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(store_module, "new_hasher", lambda algorithm="xxh3_64": NoFreshStart())
    store = new_store(tmp_path / "run")
    files = chunked_files()
    inject(store, "tensors.safetensors", fail_times=1, fail_after=PIECE * 3 + 100,
           error=OSError(errno.EIO, "injected I/O error"))
    result = store.commit(files, step=1)
    with pytest.raises(AssertionError):
        assert_manifest_matches_files(store, result.info, files)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "injected: disk full"),
                                   OSError(errno.EIO, "injected: I/O error every time")],
                         ids=["permanent", "transient-every-attempt"])
def test_a_torn_write_leaves_no_manifest(tmp_path, small_pieces, error):
    store = new_store(tmp_path / "run")
    good = store.commit(chunked_files(), step=1).info
    opened = inject(store, "tensors.safetensors", fail_times=99, fail_after=PIECE * 2 + 1, error=error)
    with pytest.raises(StorageError):
        store.commit(chunked_files(), step=2)
    assert MANIFEST not in opened  # the manifest is never begun
    torn = [c for c in store.list(include_uncommitted=True) if c.step == 2]
    assert len(torn) == 1 and not torn[0].committed
    assert 0 < os.path.getsize(os.path.join(torn[0].path, "tensors.safetensors")) < len(
        joined(chunked_files()["tensors.safetensors"]))  # really torn, not absent
    assert store.newest_valid().name == good.name


# --------------------------------------------------------------------------------------- writeback
def test_local_writes_start_their_writeback_and_go_on_without_it(tmp_path, small_pieces, monkeypatch):
    calls: List[tuple] = []

    def spy(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags))
        return 0

    monkeypatch.setattr(backends, "_sync_file_range", spy)
    store = new_store(tmp_path / "run")
    data = payload(PIECE * 10 + 3)
    info = store.commit({"big.bin": data}, step=1).info
    # ranges follow each other from 0, each at least WRITEBACK_EVERY long, and start (not wait for) writes
    assert calls and calls[0][0] == 0 and all(flags == 2 for _, _, flags in calls)
    assert all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))
    assert all(length >= 3 * PIECE for _, length, _ in calls)
    assert_manifest_matches_files(store, info, {"big.bin": data})

    refused: List[int] = []
    monkeypatch.setattr(backends, "_sync_file_range", lambda *a: refused.append(1) or -1)
    info = store.commit({"big.bin": data}, step=2).info  # a file system that refuses it: plain writes
    assert len(refused) == 1  # asked once per file, not again after a refusal
    assert_manifest_matches_files(store, info, {"big.bin": data})


def test_commit_reports_the_writers_cpu_time(tmp_path):
    store = new_store(tmp_path / "run")
    result = store.commit({"a.bin": payload(1 << 20)}, step=1)
    assert result.cpu_seconds is not None and 0 <= result.cpu_seconds <= result.seconds + 0.05


# ------------------------------------------------------------------------------------ direct I/O
def page_aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned memory, as a snapshot buffer is (an anonymous mapping)."""
    mapped = mmap.mmap(-1, len(data))
    mapped[:] = data
    return memoryview(mapped)


def direct_io_works(folder) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".probe"), os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")


def keep_opened_files(store: CheckpointStore) -> Dict[str, Any]:
    opened: Dict[str, Any] = {}
    real_open = store.backend.open_write

    def open_write(path: str):
        opened[os.path.basename(path)] = f = real_open(path)
        return f

    store.backend.open_write = open_write  # type: ignore[method-assign]
    return opened


@pytest.fixture
def direct_from_small_sizes(monkeypatch):
    monkeypatch.setattr(backends, "DIRECT_MIN", 2 * backends.DIRECT_ALIGN)
    monkeypatch.setattr(backends.LocalBackend, "write_piece", 5 * backends.DIRECT_ALIGN)


def test_a_page_aligned_buffer_after_a_page_aligned_header_goes_straight_to_disk(
        tmp_path, direct_from_small_sizes):
    align = backends.DIRECT_ALIGN
    store = new_store(tmp_path / "run")
    opened = keep_opened_files(store)
    body = payload(align * 12 + 77, 5)  # a tail shorter than a page goes through the page cache
    files = {"state.json": b"{}", "tensors.safetensors": [payload(align, 6), page_aligned(body)]}
    info = store.commit(files, step=1).info
    assert_manifest_matches_files(store, info, files)
    if direct_io_works(tmp_path):
        assert opened["tensors.safetensors"].direct_bytes == align * 12
    assert opened["state.json"].direct_bytes == 0

    # control: the same buffer after a header that is not a whole page cannot go direct
    files = {"tensors.safetensors": [payload(align - 64, 6), page_aligned(body)]}
    info = store.commit(files, step=2).info
    assert_manifest_matches_files(store, info, files)
    assert opened["tensors.safetensors"].direct_bytes == 0


def test_direct_io_refused_falls_back_to_the_page_cache(tmp_path, direct_from_small_sizes, monkeypatch):
    align = backends.DIRECT_ALIGN
    store = new_store(tmp_path / "run")
    opened = keep_opened_files(store)
    body = payload(align * 8, 7)
    # memory the disk cannot read directly, declared aligned: the kernel answers EINVAL (or the file
    # system refuses O_DIRECT already): the write goes on through the page cache, the bytes intact
    monkeypatch.setattr(backends, "_address", lambda view: 0)
    files = {"tensors.safetensors": [payload(align, 8), memoryview(b"x" + body)[1:]]}
    info = store.commit(files, step=1).info
    assert_manifest_matches_files(store, info, files)

    import fcntl

    real_fcntl = fcntl.fcntl

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & backends._O_DIRECT:
            raise OSError(errno.EINVAL, "injected: no O_DIRECT here")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(backends, "_address", lambda view: 0)
    monkeypatch.setattr(fcntl, "fcntl", no_direct)
    files = {"tensors.safetensors": [payload(align, 8), page_aligned(body)]}
    info = store.commit(files, step=2).info
    assert_manifest_matches_files(store, info, files)
    assert opened["tensors.safetensors"].direct_bytes == 0


def test_no_direct_io_on_fuse_or_network_mounts(tmp_path, direct_from_small_sizes, monkeypatch):
    monkeypatch.setattr(backends, "filesystem_type", lambda path: "fuse.drive")
    store = new_store(tmp_path / "run")
    opened = keep_opened_files(store)
    align = backends.DIRECT_ALIGN
    files = {"tensors.safetensors": [payload(align, 9), page_aligned(payload(align * 8, 9))]}
    info = store.commit(files, step=1).info
    assert_manifest_matches_files(store, info, files)
    assert opened["tensors.safetensors"].direct_bytes == 0

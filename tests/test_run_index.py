"""The index of runs: ``RUNS.json`` plus one record per run in the default
checkpoint dir, so that runs opened with an explicit path are found after a VM reset.

Written without rename (Drive, object stores), torn files ignored, concurrent writers merged, local
runs deleted since dropped; runs that do not answer in time are set aside instead of waited for.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from keepalive import runs
from keepalive.core import Checkpointer
from keepalive.runs import RUN_INDEX, RUN_RECORDS, Run, answered_within, indexed_runs, read_run_index, record_run
from keepalive.store import CheckpointStore


def _run_at(path, step=1, finished=False):
    store = CheckpointStore(str(path), keep=None)
    store.commit({"a.bin": b"x"}, step=step, epoch=0, metadata={"finished": finished})
    store.close()
    return str(path)


def test_record_and_read(tmp_path):
    index = tmp_path / "default"
    a, b = _run_at(tmp_path / "drive" / "a"), _run_at(tmp_path / "drive" / "b")
    assert record_run(a, str(index)) and record_run(b, lambda: str(index))
    found = read_run_index(str(index))
    assert set(found) == {a, b} and found[a]["run"] == "a" and found[a]["opened"] <= found[b]["opened"]
    assert (index / RUN_INDEX).is_file() and len(list((index / RUN_RECORDS).iterdir())) == 2
    # what is not recorded: runs inside the index dir (listed there anyway), memory://, no index dir
    assert not record_run(str(index / "inside"), str(index))
    assert not record_run("memory://somewhere/run", str(index))
    assert not record_run(a, None) and not record_run(a, lambda: None)
    assert set(read_run_index(str(index))) == {a, b}
    assert read_run_index(str(tmp_path / "no-index-here")) == {}
    # recording again moves a run to the front (most recently opened first)
    time.sleep(0.01)
    record_run(a, str(index))
    assert [r.url for r in indexed_runs(str(index))] == [a, b]
    assert [r.url for r in indexed_runs(str(index), exclude_below=str(tmp_path / "drive" / "b"))] == [a]


def test_torn_files_are_ignored_and_the_records_keep_every_run(tmp_path):
    index = tmp_path / "default"
    a, b = _run_at(tmp_path / "a"), _run_at(tmp_path / "b")
    record_run(a, str(index))
    record_run(b, str(index))
    whole = (index / RUN_INDEX).read_bytes()
    (index / RUN_INDEX).write_bytes(whole[: len(whole) // 2])          # a crash while writing it
    assert set(read_run_index(str(index))) == {a, b}                  # the per-run records answer
    record = next((index / RUN_RECORDS).iterdir())
    record.write_bytes(record.read_bytes().replace(b'"run"', b'"rum"'))  # checksum no longer fits
    assert len(read_run_index(str(index))) == 1
    record_run(a, str(index))
    record_run(b, str(index))                                         # rewritten whole
    assert set(read_run_index(str(index))) == {a, b}


def test_deleted_local_runs_leave_the_index(tmp_path):
    import shutil

    index = tmp_path / "default"
    a, b = _run_at(tmp_path / "a"), _run_at(tmp_path / "b")
    record_run(a, str(index))
    record_run(b, str(index))
    shutil.rmtree(a)
    assert [r.url for r in indexed_runs(str(index))] == [b]           # not offered any more
    record_run(b, str(index))                                         # the next write drops it
    assert set(read_run_index(str(index))) == {b}
    assert len(list((index / RUN_RECORDS).iterdir())) == 1


def test_concurrent_writers_lose_no_run(tmp_path):
    """Six processes open six runs at the same moment: every one is in the index."""
    index = tmp_path / "default"
    urls = [_run_at(tmp_path / "drive" / f"r{i}") for i in range(6)]
    start = time.time() + 1.0
    code = ("import sys, time\nfrom keepalive.runs import record_run\n"
            "time.sleep(max(0.0, float(sys.argv[1]) - time.time()))\n"
            "assert record_run(sys.argv[2], sys.argv[3])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(start), u, str(index)]) for u in urls]
    assert all(p.wait(60) == 0 for p in procs)
    assert set(read_run_index(str(index))) == set(urls)


def test_a_checkpointer_records_its_run_when_it_opens_it(tmp_path, monkeypatch):
    default = tmp_path / "default"
    monkeypatch.setenv("KEEPALIVE_DIR", str(default))
    outside = tmp_path / "drive" / "runs" / "pets"
    ckpt = Checkpointer(str(outside), quiet=True)
    ckpt.save(lambda: {"objects": {}}, sync=True)
    ckpt.close()
    assert set(read_run_index(str(default))) == {str(outside)}
    inside = Checkpointer(run="here", quiet=True)                     # in the default dir: listed there
    inside.save(lambda: {"objects": {}}, sync=True)
    inside.close()
    assert set(read_run_index(str(default))) == {str(outside)}
    (run,) = indexed_runs(str(default))
    assert run.unfinished and run.newest.step == 0


def test_an_unwritable_index_warns_once_and_training_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    a = _run_at(tmp_path / "a")
    assert record_run(a, str(blocker / "index")) is False
    assert record_run(a, str(blocker / "index")) is False
    err = capsys.readouterr().err
    assert err.count("could not record run") == 1 and "%resume_training" in err


def test_runs_that_do_not_answer_are_set_aside(tmp_path):
    class Slow(Run):
        def _list(self, include_uncommitted=False):
            time.sleep(3)
            return super()._list(include_uncommitted)

    fast = runs.open_run(_run_at(tmp_path / "fast"))
    slow = Slow(_run_at(tmp_path / "slow"))
    t0 = time.monotonic()
    answered, silent = answered_within([slow, fast], timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert answered == [fast] and silent == [slow] and fast.unfinished


def test_memory_runs_are_not_recorded(tmp_path):
    assert record_run("memory://x/run", str(tmp_path)) is False and not os.path.exists(tmp_path / RUN_INDEX)

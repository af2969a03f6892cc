"""The run layer (keepalive/runs.py): a run's checkpoints newest first, its destination and this
machine's spool merged (``source`` / ``cached``), the newest valid one past damaged ones, a resume
when the destination cannot be read, every run below a folder (nested, spool-only), what ``keepalive
ls`` / ``status`` see. Local folders and memory://."""
from __future__ import annotations

import json
import os
import shutil
import uuid

import numpy as np
import pytest

from keepalive import cli, runs
from keepalive.errors import NoCheckpointError
from keepalive.spool import Spool
from keepalive.state import to_files
from keepalive.store import CheckpointStore
from test_store_backends import flip_byte

TENSORS = "tensors.safetensors"


def files_for(step: int) -> dict:
    """A real state (what a resume decodes): the step and a tensor that says which step it is."""
    return to_files({"step": step, "w": np.full(1000, step, dtype=np.float32)})


def assert_state(tree, step: int) -> None:
    assert tree["step"] == step and np.array_equal(tree["w"], np.full(1000, step, dtype=np.float32))


@pytest.fixture(autouse=True)
def private_spool(tmp_path, monkeypatch):
    """A spool root of this test's own: no other test's spools are seen."""
    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    """A folder of runs: a local folder, or a fresh memory:// one."""
    if request.param == "local":
        return str(tmp_path / "runs")
    return f"memory://test-runs-{uuid.uuid4().hex[:8]}"


def make_run(url, steps, keep=None):
    store = CheckpointStore(url, keep=keep)
    infos = [store.commit(files_for(s), step=s, epoch=s // 10).info for s in steps]
    store.close()
    return store, infos


def spool_with(dest, copies=(), pending=()):
    """The spool of ``dest`` on this machine: ``copies`` (checkpoints of ``dest``) copied into it and
    marked uploaded (the local cache), and new checkpoints ``pending`` committed only there."""
    spool = Spool.for_destination(dest)
    spool.write_record(dest, None)
    for info in copies:
        shutil.copytree(info.path, os.path.join(spool.path, info.name))
        spool.mark_uploaded(spool.load_info(info.name))
    spool.seq_floor = max((c.seq or 0 for c in dest.list()), default=0)
    for step in pending:
        spool.commit(files_for(step), step=step, epoch=step // 10)
    spool.close()
    return spool


# ---------------------------------------------------------------------------------- one run
def test_checkpoints_newest_first(root):
    _, infos = make_run(f"{root}/pets", [1, 12, 5])
    run = runs.open_run(f"{root}/pets")
    assert run.name == run.run == "pets" and run.spool is None
    listed = run.checkpoints()
    assert [c.step for c in listed] == [12, 5, 1]
    assert all(c.source == "destination" and not c.cached for c in listed)
    assert run.newest.step == 12 and run.count == 3 and run.broken == 0 and run.error is None
    assert run.newest_valid().step == 12
    info, tree, previous = run.load_newest()
    assert info.step == 12 and info.valid is True and previous is None
    assert_state(tree, 12)
    summary = run.summary()
    assert summary["run"] == "pets" and summary["checkpoints"] == 3 and summary["newest_step"] == 12
    assert summary["newest_created"].endswith("Z") and summary["newest_epoch"] == 1


def test_newest_valid_falls_back_past_damaged_ones(root, capsys):
    store, infos = make_run(f"{root}/run", [1, 2, 3])
    flip_byte(store, infos[2], name=TENSORS)
    flip_byte(store, infos[1], name="state.json", at=3)
    run = runs.open_run(f"{root}/run")
    assert run.newest.step == 3  # the manifests read: damage shows only when the data is read
    skipped = []
    newest = run.newest_valid(on_corrupt=skipped.append)
    assert newest.step == 1 and [c.step for c in skipped] == [3, 2]
    assert all(c.valid is False and c.error for c in skipped)
    capsys.readouterr()
    assert runs.open_run(f"{root}/run").newest_valid().step == 1
    err = capsys.readouterr().err
    assert err.count("is damaged") == 2 and infos[2].name in err  # each one named, as a warning
    info, tree, _ = runs.open_run(f"{root}/run").load_newest(quiet=True)
    assert info.step == 1
    assert_state(tree, 1)
    # every one damaged: nothing to resume from, and nothing raised
    flip_byte(store, infos[0], name=TENSORS)
    assert runs.open_run(f"{root}/run").newest_valid(on_corrupt=lambda c: None) is None
    assert runs.open_run(f"{root}/run").load_newest(quiet=True) is None


def test_missing_run_has_no_checkpoints(root):
    run = runs.open_run(f"{root}/nothing-here")
    assert run.checkpoints() == [] and run.newest is None and run.load_newest() is None
    assert run.summary()["checkpoints"] == 0 and not run.unfinished


# --------------------------------------------------------------------------- spool + destination
def test_spool_and_destination_merged(tmp_path):
    dest, infos = make_run(str(tmp_path / "drive" / "run"), [1, 2])
    spool_with(dest, copies=[infos[1]], pending=[3, 4])
    run = runs.open_run(str(tmp_path / "drive" / "run"))
    assert run.spool is not None
    listed = run.checkpoints()
    assert [(c.step, c.source, c.cached) for c in listed] == [
        (4, "spool", False), (3, "spool", False), (2, "destination", False), (1, "destination", False)]
    assert run.in_spool(listed[0]) and not run.in_spool(listed[2])
    assert "in the local spool, not uploaded yet" in run.where()
    assert [c.step for c in run.pending_uploads()] == [4, 3]
    assert [c.seq for c in listed] == [4, 3, 2, 1]  # the spool continues the destination's numbering
    info, tree, _ = run.load_newest()
    assert info.step == 4 and info.source == "spool"
    assert_state(tree, 4)
    assert runs.open_run(str(tmp_path / "drive" / "run")).summary()["pending_uploads"] == 2


def test_cached_copy_is_read_first_and_only_while_the_destination_has_it(tmp_path):
    dest, infos = make_run(str(tmp_path / "drive" / "run"), [1, 2])
    spool = spool_with(dest, copies=[infos[1]])
    url = str(tmp_path / "drive" / "run")
    listed = runs.open_run(url).checkpoints()
    assert [(c.step, c.source) for c in listed] == [(2, "destination"), (1, "destination")]  # once each
    info, _, _ = runs.open_run(url).load_newest()
    assert info.step == 2 and info.source == "spool" and info.cached  # the local copy, read first
    # the local copy damaged: the destination's copy of the same checkpoint is used
    flip_byte(spool, spool.load_info(infos[1].name), name=TENSORS)
    info, tree, _ = runs.open_run(url).load_newest(quiet=True)
    assert info.step == 2 and info.source == "destination"
    assert_state(tree, 2)
    # deleted at the destination on purpose: the cache does not bring it back
    dest.remove(infos[1])
    run = runs.open_run(url)
    assert [c.step for c in run.checkpoints()] == [1] and run.load_newest()[0].step == 1


def test_destination_unreadable_resumes_from_the_spool(tmp_path, capsys):
    drive = tmp_path / "drive"
    dest, infos = make_run(str(drive / "run"), [1, 2])
    spool_with(dest, copies=[infos[1]], pending=[3])
    shutil.rmtree(drive)
    drive.write_bytes(b"a file where the mount was")  # listing the destination now fails
    run = runs.open_run(str(drive / "run"))
    listed = run.checkpoints()
    assert [(c.step, c.source, c.cached) for c in listed] == [(3, "spool", False), (2, "spool", True)]
    assert run.error and "not a run folder" in run.error
    capsys.readouterr()
    info, _, _ = runs.open_run(str(drive / "run")).load_newest()
    assert info.step == 3 and "cannot read" in capsys.readouterr().err
    # without a spool an unreadable destination is an error, not "no checkpoints"
    with pytest.raises(OSError):
        runs.open_run(str(drive / "other")).checkpoints()
    with pytest.raises(OSError):
        runs.open_run(str(drive / "other")).load_newest()


# ------------------------------------------------------------------------------ finding runs
def test_find_runs_nested_and_spool_only(root, tmp_path):
    make_run(f"{root}/a", [1])
    make_run(f"{root}/x/b", [2])
    make_run(f"{root}/x/y/c", [3])
    make_run(f"{root}/x/y/z/too-deep", [4])
    found = runs.find_runs(root)
    assert [r.name for r in found] == ["a", "b", "c"]
    assert [r.newest.step for r in found] == [1, 2, 3]
    # a run whose only checkpoints wait in this machine's spool (its destination was never written)
    ghost = CheckpointStore(f"{root}/x/ghost", keep=None)
    spool_with(ghost, pending=[7])
    elsewhere = CheckpointStore(str(tmp_path / "elsewhere" / "run"), keep=None)
    spool_with(elsewhere, pending=[8])
    found = runs.find_runs(root)
    assert [r.name for r in found] == ["a", "b", "c", "ghost"]
    assert found[-1].newest.step == 7 and found[-1].in_spool(found[-1].newest)
    assert [r.name for r in runs.find_runs(root, include_spools=False)] == ["a", "b", "c"]
    assert [r.url for r in runs.spooled_runs(below=root)] == [ghost.url]
    assert {r.url for r in runs.spooled_runs()} == {ghost.url, elsewhere.url}


def test_locate_and_checkpoints_at(root):
    _, infos = make_run(f"{root}/a", [1, 2])
    make_run(f"{root}/b", [3])
    assert runs.locate(root).kind == "root"
    assert [c.step for c in runs.checkpoints_at(root)] == [1, 2, 3]  # each run oldest first, as `ls`
    where = runs.locate(f"{root}/a")
    assert where.kind == "run" and where.runs[0].name == "a"
    where = runs.locate(infos[0].url)
    assert where.kind == "checkpoint" and where.checkpoint.name == infos[0].name
    assert [c.valid for c in runs.checkpoints_at(infos[0].url, verify=True)] == [True]
    with pytest.raises(NoCheckpointError):
        runs.locate(f"{root}/missing")


def test_locate_a_spool_only_run(tmp_path):
    ghost = CheckpointStore(str(tmp_path / "drive" / "ghost"), keep=None)
    spool_with(ghost, pending=[5, 6])
    where = runs.locate(str(tmp_path / "drive" / "ghost"))
    assert where.kind == "run" and where.runs[0].url == ghost.url
    listed = runs.checkpoints_at(ghost.url, verify=True)
    assert [(c.step, c.source, c.valid) for c in listed] == [(5, "spool", True), (6, "spool", True)]
    info, tree, _ = where.runs[0].load_newest()
    assert info.step == 6
    assert_state(tree, 6)


def test_pending_summary(tmp_path):
    assert runs.pending_summary() is None and runs.format_pending(None) == "none pending"
    dest, infos = make_run(str(tmp_path / "d" / "run"), [1])
    spool_with(dest, copies=infos, pending=[2, 3])
    summary = runs.pending_summary()
    assert summary["count"] == 2 and summary["bytes"] > 8000 and summary["oldest_age_seconds"] >= 0
    [row] = summary["destinations"]
    assert row["destination"] == dest.url and row["newest_step"] == 3
    line = runs.format_pending(summary)
    assert "2 checkpoint(s)" in line and "keepalive sync" in line and dest.url in line


def test_ls_and_verify_show_the_spool(tmp_path, capsys):
    dest, infos = make_run(str(tmp_path / "drive" / "run"), [1])
    spool_with(dest, copies=infos, pending=[2])
    assert cli.main(["ls", dest.url, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["source"], r["cached"]) for r in rows] == [(1, "destination", False),
                                                                     (2, "spool", False)]
    assert cli.main(["verify", dest.url]) == 0
    assert "all 2 checkpoint(s) verified" in capsys.readouterr().out

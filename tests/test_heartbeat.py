"""The run's heartbeat and its sessions: RUNNING / STOPPED / DIED / FINISHED seen from another process.

A torch loop trains with a short heartbeat (``KEEPALIVE_HEARTBEAT=0.3s``) in children forked from a
server that has imported torch (tests/forkserver.py). ``keepalive status --json PATH``, run as its own
process, sees the run RUNNING while the first child trains, DIED after it is SIGKILLed, STOPPED after
the second child's SIGTERM and FINISHED after the third ran to the end; on a local folder and on the
GCS emulator (tests/conftest.py's ``gcs_server``). The records then hold the three sessions, where
each resumed from, and what ``ckpt.log`` logged. Keras' epoch logs land in the record too. The stale
heartbeat rule has its negative control: a record whose heartbeat is fresh is not DIED.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from keepalive import cli, runlog
from keepalive.store import CheckpointStore
from objectskit import forks_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = r'''
import json, os, sys, time
import torch
from keepalive.callbacks.torch import DriveCheckpoint

url, pause = sys.argv[1], float(sys.argv[2])
options = json.loads(os.environ.get("TEST_STORAGE_OPTIONS") or "null")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=4)
ckpt = DriveCheckpoint(url, model=model, optimizer=opt, every="5 steps", storage_options=options, quiet=True)
for epoch in ckpt.epochs(3):
    for x in ckpt.batches(loader):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ckpt.log(loss=loss.item())
        print("STEP", ckpt.step, flush=True)
        time.sleep(pause)
print("DONE", flush=True)
'''


forks = forks_fixture(quick_exit=True)  # a server that has imported torch


def status_of(url: str) -> dict:
    """The run's entry in ``keepalive status --json URL``, from a process of its own."""
    done = subprocess.run([sys.executable, "-m", "keepalive", "status", "--json", url], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert len(runs) == 1, runs
    return runs[0]


def wait_for_step(child, at_least: int) -> int:
    """Read the child's output until it printed a step >= ``at_least``."""
    for line in child.stdout:
        if line.startswith("STEP") and int(line.split()[1]) >= at_least:
            return int(line.split()[1])
    raise AssertionError(f"the child ended (exit {child.wait(30)}) before step {at_least}")


def train(forks, tmp_path, url, options, pause):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KEEPALIVE_HEARTBEAT="0.3s",
               TEST_STORAGE_OPTIONS=json.dumps(options))
    return forks.spawn([str(script), url, str(pause)], env)


@pytest.mark.parametrize("kind", ["local", "gs"])
def test_running_died_stopped_finished(kind, forks, tmp_path, request, capsys):
    if kind == "gs":
        server = request.getfixturevalue("gcs_server")
        url, options = server.url(f"hb-{os.getpid()}-{time.time_ns()}", "run"), server.storage_options
    else:
        url, options = str(tmp_path / "runs" / "run"), None

    first = train(forks, tmp_path, url, options, pause=0.2)
    wait_for_step(first, 7)
    running = status_of(url)
    assert running["state"] == "RUNNING", running
    assert running["step"] >= 1 and running["heartbeat_age_s"] < 10, running
    first.kill()
    assert first.wait(30) == -signal.SIGKILL
    died = status_of(url)
    assert died["state"] == "DIED" and "gone" in died["state_detail"], died

    second = train(forks, tmp_path, url, options, pause=0.2)
    resumed_at = wait_for_step(second, 1)
    wait_for_step(second, resumed_at + 2)
    second.send_signal(signal.SIGTERM)
    assert second.stdout.read() is not None and second.wait(60) == 143
    stopped = status_of(url)
    assert stopped["state"] == "STOPPED" and "SIGTERM" in stopped["state_detail"], stopped

    third = train(forks, tmp_path, url, options, pause=0.0)
    assert "DONE" in third.stdout.read() and third.wait(60) == 0
    finished = status_of(url)
    assert finished["state"] == "FINISHED" and finished["step"] == 30 and finished["sessions"] == 3, finished

    records = runlog.read_sessions(url, options)
    assert [r.state for r in records] == ["running", "stopped", "finished"]
    assert records[0].resumed_from is None and records[0].first_step == 0
    for after in records[1:]:  # each resumed from the newest checkpoint saved before
        assert after.resumed_from is not None and after.first_step == after.resumed_from["step"]
    # the killed session's record holds its step as of its last heartbeat (it printed step 7 before
    # the status was asked: beats came since); it resumed from a scheduled save; the SIGTERM's stop
    # saved, and its record's end was written after that save: no step lost there
    assert records[0].step >= 7 and records[1].first_step % 5 == 0
    assert records[2].first_step == records[1].step == records[1].last_saved_step
    assert records[-1].saves >= 1 and records[-1].last_saved_step == 30 and records[-1].total_steps == 30
    steps = [p["step"] for r in records for p in r.metrics]
    assert all("loss" in p for r in records for p in r.metrics) and steps[-1] == 30
    assert len(records[-1].metrics) == 30 - records[-1].first_step  # one ckpt.log per step of the session
    # the session records are no checkpoints: listing and verifying see only the ckpt-* folders
    store = CheckpointStore(url, keep=None, storage_options=options)
    assert all(c.name.startswith("ckpt-") for c in store.list(include_uncommitted=True))
    if kind == "local":
        assert cli.main(["ls", url]) == 0
        listed = capsys.readouterr().out
        assert "sessions" not in listed.replace(f"run {url}:", "")
        assert f"run {url}: FINISHED (step 30" in listed, listed


# ------------------------------------------------------------------------------------ rules
def record(**fields) -> runlog.SessionRecord:
    base = dict(session="20261129T003000Z-00000000", host="another-machine", pid=1, started=1000.0,
                updated=1000.0, heartbeat_s=60.0, state="running", step=12)
    return runlog.SessionRecord(**{**base, **fields})


def test_the_stale_heartbeat_rule_and_its_negative_control():
    fresh, stale = record(), record()
    limit = 3 * 60 + runlog.STALE_SLACK_S
    assert runlog.run_state([fresh], now=1000.0 + limit - 1)[0] == "RUNNING"  # control: not DIED
    state, detail = runlog.run_state([stale], now=1000.0 + limit + 1)
    assert state == "DIED" and "no heartbeat" in detail
    # this very process, alive: RUNNING however old the record; a dead pid on this machine: DIED at once
    me = record(**runlog.process_identity())
    assert runlog.run_state([me], now=1001.0)[0] == "RUNNING"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = record(**dict(runlog.process_identity(), pid=dead.pid))
    assert runlog.run_state([gone], now=1001.0)[0] == "DIED"
    assert runlog.run_state([record(state="stopped", reason="SIGTERM")])[0] == "STOPPED"
    assert runlog.run_state([record(state="closed")])[0] == "STOPPED"
    assert runlog.run_state([record(state="crashed", reason="ValueError: nan")]) == ("DIED", "step 12: ValueError: nan")
    assert runlog.run_state([record(state="finished")])[0] == "FINISHED"
    assert runlog.run_state([]) == ("NEW", "no session recorded")
    # the newest session decides
    older = record(state="finished", started=10.0)
    assert runlog.run_state([older, record(state="stopped")])[0] == "STOPPED"
    assert socket.gethostname() != "another-machine"


def test_a_failing_destination_is_skipped_and_tried_again(tmp_path):
    store = CheckpointStore(f"memory://hb-tests/{time.time_ns()}/run", keep=None)
    failing = {"on": True}
    real = store.backend.write_bytes

    def write(path, data):
        if failing["on"]:
            raise OSError(5, "Input/output error")
        real(path, data)

    store.backend.write_bytes = write  # type: ignore[method-assign]
    body = record(session="20261129T003000Z-11111111").to_json()
    writer = runlog.RecordWriter(store, body["session"], lambda: body, interval=0.05, min_gap=0.01)
    writer.start()
    deadline = time.monotonic() + 30
    while writer.failures < 2 and time.monotonic() < deadline:  # two beats failed, none raised
        time.sleep(0.02)
    assert writer.failures >= 2 and writer.writes == 0 and runlog.read_sessions(store) == []
    failing["on"] = False
    body["state"] = "finished"
    assert writer.close(timeout=5)
    assert [r.state for r in runlog.read_sessions(store)] == ["finished"]
    # a torn record (a crash while a store without rename wrote it) is skipped, not an error
    store.backend.write_bytes(store.backend.join(store.path, runlog.SESSIONS, "20261129T010000Z-2.json"), b'{"ses')
    assert len(runlog.read_sessions(store)) == 1


def test_keras_epoch_logs_and_last_metrics_in_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "tensorflow"))
    keras = pytest.importorskip("keras")
    import numpy as np

    from keepalive.callbacks.keras import DriveCheckpoint

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y = np.random.rand(16, 3).astype("float32"), np.random.rand(16, 1).astype("float32")
    ckpt = DriveCheckpoint(str(tmp_path / "k"), quiet=True)
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[ckpt])
    (rec,) = runlog.read_sessions(str(tmp_path / "k"))
    assert rec.state == "finished" and rec.framework == "keras" and rec.step == 4
    assert [p["loss"] for p in rec.metrics] == pytest.approx(history.history["loss"])
    assert [p["mae"] for p in rec.metrics] == pytest.approx(history.history["mae"])
    assert ckpt.core.last_metrics["loss"] == pytest.approx(history.history["loss"][-1])


def test_a_checkpointer_closed_between_two_fits_ends_finished(tmp_path, monkeypatch):
    """fastai's fine_tune closes the checkpointer after its first fit and trains on with it: the record
    goes back to running, and the second fit's final save makes it finished (no end is told after
    it). Control: a checkpointer closed after its first fit with nothing following says closed (STOPPED)
    once the process exits."""
    import numpy as np

    from keepalive.core import Checkpointer

    monkeypatch.setenv("KEEPALIVE_HEARTBEAT", "0.2s")
    core = Checkpointer(str(tmp_path / "run"), quiet=True, every="epoch")
    capture = lambda: {"objects": {"w": np.zeros(2)}}  # noqa: E731
    core.load()
    core.start_epoch()
    for _ in range(3):
        core.advance(capture)
    core.end_stage(capture, reason="end of fit 0", finished=False)
    core.close()
    # not an end yet: a next fit may follow (a close nothing followed is told at the process' exit)
    assert [r.state for r in runlog.read_sessions(str(tmp_path / "run"))] == ["running"]
    for _ in range(3):
        core.advance(capture)
    core.heartbeat.log({"loss": np.float32(0.5), "name": "not a number"})
    core.end_stage(capture, reason="end of fit 1", finished=True)
    core.close()
    (rec,) = runlog.read_sessions(str(tmp_path / "run"))
    assert (rec.state, rec.step, rec.last_saved_step, rec.saves) == ("finished", 6, 6, 2)
    assert [(p["step"], p["loss"]) for p in rec.metrics] == [(6, 0.5)] and core.last_metrics == {"loss": 0.5}

    left = Checkpointer(str(tmp_path / "left"), quiet=True, every="epoch")  # the control: nothing follows
    left.load()
    left.start_epoch()
    left.advance(capture)
    left.end_stage(capture, reason="end of fit 0", finished=False)
    left.close()
    left.events.tell_close()  # what the process' exit does
    assert [r.state for r in runlog.read_sessions(str(tmp_path / "left"))] == ["closed"]


def test_a_run_with_session_records_only_is_listed(tmp_path, capsys):
    # a run that died (or still runs) before its first checkpoint reached the destination: a spooled
    # run's kernel killed before its first upload leaves its session records there, nothing else
    run = tmp_path / "runs" / "early"
    store = CheckpointStore(str(run), keep=None)
    body = record(session="20261129T003000Z-22222222", updated=time.time() - 3600).to_json()
    writer = runlog.RecordWriter(store, body["session"], lambda: body, interval=60, min_gap=0.01)
    writer.start()
    assert writer.close(timeout=5)
    assert sorted(os.listdir(run)) == [runlog.SESSIONS]
    # control: a folder that merely has a "sessions" folder (no record in it) is no run
    (tmp_path / "runs" / "notes" / "sessions").mkdir(parents=True)
    (tmp_path / "runs" / "notes" / "sessions" / "readme.txt").write_text("not a record")
    assert cli.main(["ls", str(tmp_path / "runs")]) == 0
    listed = capsys.readouterr().out
    assert f"run {run}: DIED" in listed and "notes" not in listed, listed

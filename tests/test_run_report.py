"""`keepalive report`: a run across its sessions from the records its heartbeat keeps -- the sessions
along the step axis, redone steps, the state (a stale heartbeat is DIED), the ETA in steps, time and
sessions of a platform's budget, the picture and the JSON."""
import json
import os
import signal
import time

import pytest

from keepalive import cli
from keepalive.runchart import draw, metric_name
from keepalive.runsummary import estimate_eta, summarize
from objectskit import forks_fixture


def record(session, first, step, state, started, updated, **more):
    return {"session": session, "first_step": first, "step": step, "state": state, "started": started,
            "updated": updated, "heartbeat_s": 10, "total_steps": 1000, **more}


def killed_three_times():
    # session 2 and 3 were SIGKILLed (their records stay "running", heartbeat stale); 4 is stopped by
    # the deadline; 5 runs. Each resumed from a checkpoint behind where the previous one died.
    return [
        record("a", 0, 120, "running", 0, 120),
        record("b", 100, 260, "running", 200, 360),
        record("c", 250, 400, "crashed", 400, 550, reason="RuntimeError: CUDA out of memory"),
        record("d", 400, 600, "stopped", 600, 800, reason="deadline: 5 min left"),
        record("e", 600, 700, "running", 900, 1000, steps_per_s=1.0, budget_s=500, platform="kaggle"),
    ]


def test_sessions_redone_steps_and_states():
    s = summarize("runs/x", killed_three_times(), now=1001)
    assert [(g.start_step, g.end_step, g.redone) for g in s.segments] == [
        (0, 120, 0), (100, 260, 20), (250, 400, 10), (400, 600, 0), (600, 700, 0)]
    assert [g.state for g in s.segments] == ["died", "died", "crashed", "stopped", "running"]
    assert s.redone_steps == 30 and s.state == "RUNNING" and s.step == 700


def test_a_killed_session_is_died_only_once_its_heartbeat_is_stale():
    # the rule is keepalive.runlog's (three promised beats and a slack); a fresh one is running (control)
    fresh = [record("a", 0, 10, "running", 0, 1000)]
    assert summarize("r", fresh, now=1000 + 3 * 10 + 29).state == "RUNNING"
    stale = summarize("r", fresh, now=1000 + 3 * 10 + 31)
    assert stale.state == "DIED" and stale.segments[0].state == "died"
    assert summarize("r", [record("a", 0, 10, "closed", 0, 10)]).state == "STOPPED"


def test_eta_in_steps_time_and_sessions_of_the_budget():
    s = summarize("runs/x", killed_three_times(), now=1001)
    # 300 steps at 1 step/s = 300 s; the running session (budget 500 s, started at 900) has 399 s left
    assert s.eta.steps_left == 300 and s.eta.seconds == pytest.approx(300) and s.eta.sessions == 0
    assert "it ends in this session" in s.eta.words()
    eta = estimate_eta(3000, 1.0, budget_s=1000, session_left_s=400, platform="kaggle")
    assert eta.sessions == 3 and "about 3 more Kaggle sessions" in eta.words()
    assert estimate_eta(10, None) is None


def test_a_finished_run_has_no_eta_and_a_new_one_no_sessions():
    done = [record("a", 0, 1000, "finished", 0, 100)]
    assert summarize("r", done).eta is None and summarize("r", done).state == "FINISHED"
    assert summarize("r", []).state == "NEW"


def test_the_picture_and_the_json(tmp_path):
    records = killed_three_times()
    for r in records:
        r["metrics"] = [{"step": s, "loss": 1.0 / (1 + s), "acc": 0.5} for s in range(r["first_step"], r["step"], 20)]
    s = summarize("runs/x", records, now=1001)
    assert metric_name(s.metrics) == "loss"
    png = draw(s, str(tmp_path / "r.png"))
    assert png[:4] == b"\x89PNG" and (tmp_path / "r.png").read_bytes() == png
    data = json.loads(json.dumps(s.to_json()))
    assert [g["redone"] for g in data["segments"]] == [0, 20, 10, 0, 0]
    assert data["eta"]["steps_left"] == 300 and "words" in data["eta"]
    assert {p["session"] for p in data["metrics"]} == {0, 1, 2, 3, 4}


def test_the_cli_on_a_folder_without_sessions_says_so(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "NEW"


# ------------------------------------------------------------- a real run killed three times
TRAIN = r'''
import sys, time
import torch
from keepalive.callbacks.torch import DriveCheckpoint

url, pause = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(torch.randn(80, 4), batch_size=4)
ckpt = DriveCheckpoint(url, model=model, optimizer=opt, every="10 steps", quiet=True)
for epoch in ckpt.epochs(4):
    for x in ckpt.batches(loader):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ckpt.log(loss=loss.item())
        print("STEP", ckpt.step, flush=True)
        time.sleep(pause)  # a steady step time
print("DONE", time.time(), flush=True)
'''


forks = forks_fixture(quick_exit=True)  # a server that has imported torch


def _newest_record(url):
    from keepalive import runlog

    records = runlog.read_sessions(url)
    return records[-1] if records else None


def _record_past(url, child, step, timeout=120.0):
    """The run's newest session record once it is ``child``'s and shows a step >= ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _newest_record(url)
        if found is not None and found.pid == child.pid and found.step >= step:
            return found
        assert child.poll() is None, f"the child ended (exit {child.returncode}) first"
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_report_of_a_run_killed_three_times(forks, tmp_path, capsys):
    """Three SIGKILLs, each after the session's record shows it past a step (so the record holds the
    step the kill lost), then a session that runs to the end: the report has the four sessions, each
    resumed session's redone steps are the steps its predecessor did past its checkpoint, and the ETA
    read in the last session is within 10 % of the time it then took to the end."""
    url = str(tmp_path / "run")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KEEPALIVE_HEARTBEAT="0.2s", KEEPALIVE_PROGRESS="0")
    killed_at = []
    for past in (15, 33, 52):  # checkpoints every 10 steps: 5, 3 and 2 steps past the newest
        child = forks.spawn([str(script), url, "0.05"], env)
        record = _record_past(url, child, past)
        child.kill()
        assert child.wait(30) == -signal.SIGKILL
        killed_at.append(_newest_record(url).step)
        assert killed_at[-1] >= record.step
    last = forks.spawn([str(script), url, "0.15"], env)
    record = _record_past(url, last, 60)  # resumed at 50: 20 steps of 0.15 s left
    assert cli.main(["report", url, "--json"]) == 0
    mid = json.loads(capsys.readouterr().out)
    done_at = float(next(line for line in last.stdout if line.startswith("DONE")).split()[1])
    assert last.wait(60) == 0

    assert cli.main(["report", url, "--json", "--png", str(tmp_path / "r.png")]) == 0
    final = json.loads(capsys.readouterr().out)
    segments = final["segments"]
    assert final["state"] == "FINISHED" and final["step"] == 80 and len(segments) == 4
    assert [s["state"] for s in segments] == ["died", "died", "died", "finished"]
    starts = [s["start_step"] for s in segments]
    assert starts == [0, 10, 30, 50]  # each resumed from the newest checkpoint before its kill
    assert [s["end_step"] for s in segments[:3]] == killed_at
    assert [s["redone"] for s in segments] == [0] + [k - s for k, s in zip(killed_at, starts[1:])]
    assert final["redone_steps"] == sum(k - s for k, s in zip(killed_at, starts[1:])) >= 10

    eta, actual = mid["eta"]["seconds"], done_at - record.updated
    assert mid["eta"]["steps_left"] == 80 - mid["step"]
    assert abs(eta - actual) <= 0.1 * actual, (eta, actual, mid["eta"])

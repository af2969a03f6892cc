"""Notifications end to end: a torch training's events (started, resumed, stopped for the deadline,
crashed, stalled, finished) sent through Apprise's ``json://`` URL to a real HTTP receiver on 127.0.0.1,
each received once with the right run, step and reason; a dead receiver costs the training nothing it
could measure and is said once; a bad URL is said at construction."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fakeclock import deadline_after
from keepalive import notify
from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.errors import TrainingStopped

pytest.importorskip("apprise")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Receiver:
    """A webhook on 127.0.0.1: every JSON body Apprise's ``json://`` posts, in order."""

    def __init__(self) -> None:
        self.messages: List[dict] = []
        received = self.messages

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                received.append(json.loads(self.rfile.read(length) or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/hook"

    def titles(self, wait_for: int = 0, timeout: float = 10.0) -> List[str]:
        limit = time.monotonic() + timeout
        while len(self.messages) < wait_for and time.monotonic() < limit:
            time.sleep(0.02)
        return [m["title"] for m in self.messages]

    def one(self, word: str) -> dict:
        found = [m for m in self.messages if word in m["title"]]
        assert len(found) == 1, (word, [m["title"] for m in self.messages])
        return found[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _dead_url() -> str:
    """A json:// URL whose port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"json://127.0.0.1:{port}/hook"


def _train(path, epochs: int, sleep_at: int = -1, sleep: float = 0.0, **options) -> DriveCheckpoint:
    """2 epochs of 3 batches of a tiny model: ``sleep`` seconds in the step ``sleep_at`` (a hung loader)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True, **options)
    data = DataLoader(TensorDataset(torch.randn(6, 4), torch.randint(0, 2, (6,))), batch_size=2)
    with contextlib.suppress(TrainingStopped, SystemExit):  # a stop ends the loop as a stop ends it
        for _ in ckpt.epochs(epochs):
            for x, y in ckpt.batches(data):
                if ckpt.step == sleep_at:
                    time.sleep(sleep)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            ckpt.log(loss=loss.item())
        ckpt.close()
    return ckpt


def test_deadline_stop_then_resume_then_finish_each_told_once(tmp_path, receiver):
    run = tmp_path / "pets"
    stopped = _train(run, 2, every=1, notify=receiver.url, remaining_fn=deadline_after(2))
    at = stopped.step
    assert stopped.stopped and 0 < at < 6
    assert len(receiver.titles(wait_for=2)) == 2
    start, stop = receiver.messages
    assert start["title"] == "keepalive: run 'pets' started" and str(run) in start["message"]
    assert stop["title"] == f"keepalive: run 'pets' stopped at step {at}: the session's deadline"
    assert "deadline" in stop["message"] and "run the same code again" in stop["message"]
    assert stop["type"] == "warning" and f"step {at}" in stop["message"]

    done = _train(run, 2, notify=receiver.url)
    assert done.finished and done.step == 6
    assert len(receiver.titles(wait_for=4)) == 4
    resumed, finished = receiver.messages[2:]
    assert resumed["title"] == f"keepalive: run 'pets' resumed at step {at}"
    assert "resumed from ckpt-" in resumed["message"] and f"step {at}" in resumed["message"]
    assert "redone" in resumed["message"]
    assert finished["title"] == "keepalive: run 'pets' finished at step 6" and finished["type"] == "success"
    assert "final step 6" in finished["message"] and "last metrics: loss=" in finished["message"]
    time.sleep(0.2)
    assert len(receiver.messages) == 4  # nothing told twice (close() after the end tells nothing)


def test_a_script_that_crashes_tells_its_exception_and_newest_checkpoint(tmp_path, receiver):
    script = textwrap.dedent(f"""
        import torch
        from keepalive.callbacks.torch import DriveCheckpoint
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = DriveCheckpoint({str(tmp_path / "run")!r}, model=model, optimizer=opt, every=2, quiet=True)
        for epoch in ckpt.epochs(2):
            for x in ckpt.batches(torch.utils.data.DataLoader(torch.ones(4, 2))):
                model(x).sum().backward()
                opt.step()
                if ckpt.step == 3:
                    raise ValueError("loss is nan\\nsecond line")
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, KEEPALIVE_NOTIFY=f"  {receiver.url}, ")  # the variable, as users set it
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr
    # sent before the process ended: no wait here
    assert receiver.titles() == ["keepalive: run 'run' started",
                                 "keepalive: run 'run' crashed at step 3: ValueError: loss is nan"], out.stderr
    crash = receiver.messages[1]
    assert crash["type"] == "failure" and "second line" not in crash["message"]
    assert "the newest checkpoint is ckpt-" in crash["message"] and "(step 2)" in crash["message"]


def test_a_step_that_hangs_is_told_once_as_stalled(tmp_path, receiver, monkeypatch):
    monkeypatch.setenv("KEEPALIVE_NOTIFY_STALL", "0.6s")
    _train(tmp_path / "control", 1, notify=receiver.url)  # steps well under the limit: no stall
    assert receiver.titles(wait_for=2) == ["keepalive: run 'control' started",
                                           "keepalive: run 'control' finished at step 3"]

    _train(tmp_path / "hung", 1, sleep_at=1, sleep=2.0, notify=receiver.url)  # 3 limits long: told once
    titles = receiver.titles(wait_for=5)[2:]
    assert len(titles) == 3 and titles[0] == "keepalive: run 'hung' started", titles
    assert titles[1].startswith("keepalive: run 'hung' stalled: no step for "), titles
    assert titles[2] == "keepalive: run 'hung' finished at step 3"
    stall = receiver.messages[3]
    assert stall["type"] == "failure" and "step 1" in stall["message"] and "lives" in stall["message"]


def test_a_dead_receiver_costs_the_training_nothing_and_is_said_once(tmp_path, capfd, monkeypatch):
    # what the training thread does for its notifications, told by structure, not by the clock (the
    # figures are benchmarks/notify_cost.py's): each send only queues, every delivery runs in the
    # notifier's own thread, and the end of training waits for no delivery that could not succeed
    trainer = threading.current_thread()
    delivered_in, flushes = [], []
    deliver, flush = notify.Notifier._deliver, notify.Notifier.flush

    def deliver_recorded(self, message):
        delivered_in.append(threading.current_thread())
        return deliver(self, message)

    def flush_recorded(self, timeout=None):
        done = flush(self, timeout)
        flushes.append(done)
        return done

    monkeypatch.setattr(notify.Notifier, "_deliver", deliver_recorded)
    monkeypatch.setattr(notify.Notifier, "flush", flush_recorded)
    dead = _dead_url()
    for i in range(2):
        assert _train(tmp_path / f"dead{i}", 4, notify=dead).finished
    err = capfd.readouterr().err
    assert len(delivered_in) == 4  # started and finished, twice: each refused
    assert trainer not in delivered_in and all(t.name == "keepalive-notify" for t in delivered_in)
    assert all(flushes), flushes  # no end of training waited out its bound: nothing was left to wait for
    assert err.count("could not send to json://127.0.0.1") == 1, err  # said once for the notifier


def test_a_bad_url_is_said_at_construction_and_the_good_ones_are_used(tmp_path, receiver, capfd):
    ckpt = _train(tmp_path / "run", 1, notify=["discrd://nope/token123", receiver.url])
    assert ckpt.finished
    err = capfd.readouterr().err
    assert err.count("Apprise cannot send to discrd://...") == 1 and "token123" not in err, err
    assert len(receiver.titles(wait_for=2)) == 2


def test_a_notebook_cell_that_raises_is_told_as_a_crash(tmp_path, receiver):
    from IPython.core.interactiveshell import InteractiveShell

    from keepalive import magics

    ip = InteractiveShell.instance()
    try:
        magics.load_ipython_extension(ip)
        ip.user_ns.update(DriveCheckpoint=DriveCheckpoint, torch=torch, path=str(tmp_path / "nb"), url=receiver.url)
        cell = textwrap.dedent("""
            model = torch.nn.Linear(2, 1)
            ckpt = DriveCheckpoint(path, model=model, quiet=True, notify=url)
            for epoch in ckpt.epochs(1):
                for x in ckpt.batches(torch.utils.data.DataLoader(torch.ones(4, 2))):
                    raise RuntimeError("CUDA out of memory")
        """)
        result = ip.run_cell(cell)
        assert isinstance(result.error_in_exec, RuntimeError)
        assert receiver.titles(wait_for=2) == [
            "keepalive: run 'nb' started", "keepalive: run 'nb' crashed at step 0: RuntimeError: CUDA out of memory"]
        ip.user_ns["ckpt"].close()
        time.sleep(0.1)
        assert len(receiver.messages) == 2  # the close after it tells nothing more

        # the control: without the hook the same cell's error is no crash (the close, told at exit, says "ended early")
        magics.unload_ipython_extension(ip)
        assert magics.tell_cell_error not in ip.events.callbacks["post_run_cell"]
        ip.user_ns["path"] = str(tmp_path / "unhooked")
        assert isinstance(ip.run_cell(cell).error_in_exec, RuntimeError)
        ip.user_ns["ckpt"].close()
        ip.user_ns["ckpt"].core.events.tell_close()  # what the process' exit does with a close nothing followed
        assert receiver.titles(wait_for=4)[2:] == ["keepalive: run 'unhooked' started",
                                                   "keepalive: run 'unhooked' ended at step 0 before its end"]
    finally:
        InteractiveShell.clear_instance()


def test_import_keepalive_and_a_run_without_a_url_import_no_apprise(tmp_path):
    code = textwrap.dedent(f"""
        import sys, numpy as np
        from keepalive.core import Checkpointer
        ckpt = Checkpointer({str(tmp_path / "run")!r}, quiet=True)
        ckpt.load()
        ckpt.close()
        assert ckpt.notifications is None
        assert "apprise" not in sys.modules, "apprise imported"
    """)
    env = {k: v for k, v in os.environ.items() if k != "KEEPALIVE_NOTIFY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(env, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr


def test_the_settings_table_never_shows_a_notification_token():
    from keepalive import settings, status

    env = {"KEEPALIVE_NOTIFY": "discord://1234/SECRET-TOKEN, ntfy://my-topic", "KEEPALIVE_NOTIFY_STALL": "off"}
    rows = settings.table(env=env)
    shown = status.format_settings(rows) + json.dumps(rows, default=str)
    assert "SECRET" not in shown and "my-topic" not in shown and "discord://... ntfy://..." in shown
    assert settings.get("KEEPALIVE_NOTIFY", env=env).text == env["KEEPALIVE_NOTIFY"]  # what the notifier reads
    assert notify.split_urls(settings.get("KEEPALIVE_NOTIFY", env=env).text) == [
        "discord://1234/SECRET-TOKEN", "ntfy://my-topic"]
    assert settings.get("KEEPALIVE_NOTIFY_STALL", env=env) == 0.0
    assert settings.get("KEEPALIVE_NOTIFY_STALL", env={"KEEPALIVE_NOTIFY_STALL": "15min"}) == 900.0
    assert settings.get("KEEPALIVE_NOTIFY_STALL", env={}) is None  # auto


def test_only_the_process_that_writes_checkpoints_notifies(monkeypatch):
    from types import SimpleNamespace

    from keepalive import distributed
    from keepalive.boundary import Counters
    from keepalive.lifecycle.notifications import Notifications, notify_events

    class Recorder:
        failing = False

        def __init__(self):
            self.sent = []

        def send(self, title, body, kind="info"):
            self.sent.append(title)

        def flush(self, timeout=None):
            return True

    def fake(writes):
        return SimpleNamespace(path=SimpleNamespace(writes=writes), store=SimpleNamespace(run="r"), url="/runs/r",
                               state=SimpleNamespace(counters=Counters.of({"step": 7})), epoch_batches=None)

    rank0 = ["keepalive: run 'r' started", "keepalive: run 'r' crashed at step 7: E: x"]
    for writes, told in ((False, []), (True, rank0)):
        notifier = Recorder()
        listener = Notifications(notifier)
        listener.started(fake(writes), None)
        listener.stepped(fake(writes))
        listener.ended(fake(writes), "crashed", "E: x")
        assert notifier.sent == told  # a rank that does not write says nothing; the control: rank 0 does
    monkeypatch.setattr(type(distributed.GROUP), "is_main", property(lambda self: False))
    assert notify_events(SimpleNamespace(config=SimpleNamespace(notify="json://127.0.0.1:9/x"))) is None


def test_without_apprise_it_is_said_once_and_the_training_goes_on(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "apprise", None)  # `import apprise` raises ImportError
    assert notify.notifier_from("json://127.0.0.1:9/x") is None
    ckpt = _train(tmp_path / "run", 1, notify="json://127.0.0.1:9/y")
    assert ckpt.finished and ckpt.core.notifications is None
    assert capfd.readouterr().err.count("needs Apprise, which is not installed") == 1

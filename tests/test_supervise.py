"""``keepalive run -- CMD`` (keepalive/supervise.py): the command started again after a stop that asks
to be continued and after a crash (bounded, with a doubling back-off), never after it finished or was
refused; SIGTERM forwarded to it; each restart, stop, refusal and the finish notified.

One real training (tests/scripts/relay_train.py, whose session deadline comes after 5 steps of each
process) is stopped by the deadline twice and finishes in its third process; the rest are tiny
scripts (tests/scripts/supervised_child.py), supervised in this process with a notifier that records.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import List, Tuple

from keepalive.supervise import Supervisor, judge

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "scripts", "relay_train.py")
CHILD = os.path.join(HERE, "scripts", "supervised_child.py")


class Recorder:
    """A notifier that keeps what it was asked to send."""

    def __init__(self) -> None:
        self.sent: List[Tuple[str, str, str]] = []

    def send(self, title: str, body: str, kind: str = "info") -> None:
        self.sent.append((title, body, kind))

    def flush(self, timeout=None) -> bool:
        return True


def supervise(tmp_path, mode: str, **options):
    """Supervise supervised_child.py in ``mode``: (exit status, lines said, notifications, start times)."""
    counter, lines, notifier = tmp_path / "starts", [], Recorder()
    code = Supervisor([sys.executable, CHILD, str(counter), mode], notifier=notifier, say=lines.append,
                      **options).run()
    starts = [float(t) for t in counter.read_text().split()]
    return code, lines, notifier.sent, starts


def test_a_training_stopped_by_its_deadline_twice_is_restarted_twice_and_finishes(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KEEPALIVE_NOTIFY="")
    done = subprocess.run([sys.executable, "-m", "keepalive", "run", "--backoff", "0", "--",
                           sys.executable, TRAIN, str(tmp_path / "run"), str(tmp_path / "out.pt"), "--stop-after", "5"],
                          capture_output=True, text=True, env=env, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert len(re.findall(r"exiting with code 143 \(stopped by the session's deadline\)", out)) == 2, out[-3000:]
    assert re.findall(r"restart (\d+): ", out) == ["1", "2"], out[-3000:]
    resumed = re.findall(r"resuming run 'run' from ckpt-[\w-]+: .*?step (\d+)", out)
    assert resumed == ["5", "10"], out[-3000:]
    steps = [int(s) for s in re.findall(r"^STEP (\d+)", done.stdout, re.M)]
    assert steps == list(range(1, 13)), steps  # each step trained once, across three processes
    assert "the command finished after 2 restart(s)" in out and (tmp_path / "out.pt").exists()


def test_stopped_twice_then_finished_is_notified_each_time(tmp_path):
    code, lines, sent, starts = supervise(tmp_path, "stop-twice", backoff=5.0)
    assert code == 0 and len(starts) == 3
    assert [(title, kind) for title, _, kind in sent] == [
        ("keepalive run: restarted", "info"), ("keepalive run: restarted", "info"),
        ("keepalive run: finished", "success")]
    assert all(CHILD in body for _, body, _ in sent)
    assert starts[-1] - starts[0] < 4.0  # a stop is continued at once: the crash back-off is not waited


def test_a_refusal_is_not_restarted(tmp_path):
    code, lines, sent, starts = supervise(tmp_path, "refuse", backoff=0.0)
    assert code == 1 and len(starts) == 1
    assert lines == ["not restarted: StateMismatchError: the checkpoint's model has other shapes: "
                     "'fc.weight' (10, 4) != (10, 8)"]
    assert [(title, kind) for title, _, kind in sent] == [("keepalive run: refused", "failure")]


def test_crashes_are_retried_with_a_doubling_back_off_then_given_up(tmp_path):
    code, lines, sent, starts = supervise(tmp_path, "crash", max_crashes=2, backoff=0.3)
    assert code == 1 and len(starts) == 3  # the first start and two restarts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.3 and gaps[1] >= 0.6 and sum(gaps) < 20, gaps
    assert "exit 1: RuntimeError: CUDA out of memory; restart 1 in 0.3 s (crash 1 of 2)" in lines[0]
    assert "restart 2 in 0.6 s (crash 2 of 2)" in lines[1]
    assert "3 crashes in a row (--max-crashes 2)" in lines[2]
    assert [title for title, _, _ in sent] == ["keepalive run: restarted"] * 2 + ["keepalive run: gave up"]


def test_sigterm_is_forwarded_waited_for_and_not_restarted(tmp_path):
    counter = tmp_path / "starts"
    command = [sys.executable, "-m", "keepalive", "run", "--", sys.executable, CHILD, str(counter), "trap"]
    proc = subprocess.Popen(command,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", KEEPALIVE_NOTIFY=""))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 143, rest
    assert rest.startswith("SAVED") and "SIGTERM forwarded" in rest and "not restarted" in rest, rest
    assert len(counter.read_text().split()) == 1


def test_what_each_exit_means():
    assert judge(2, None)[0] == judge(127, None)[0] == "refused"  # the command line is wrong
    assert judge(1, None) == ("crashed", "exit 1")
    assert judge(-9, None) == ("crashed", "killed by SIGKILL")  # the OOM killer: tried again
    assert judge(143, {"outcome": "crashed"})[0] == "stopped"
    assert judge(1, {"outcome": "refused", "error": "RunLockedError: run 'r' is held"}) == (
        "refused", "RunLockedError: run 'r' is held")


def test_a_command_that_cannot_run_is_not_restarted(tmp_path):
    lines: List[str] = []
    assert Supervisor([str(tmp_path / "no-such-program")], say=lines.append).run() == 127
    assert lines[0].startswith("cannot run ") and lines[1] == "not restarted: exit 127: the command was not found"

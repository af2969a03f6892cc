"""``keepalive run -- CMD``: a training command started again until it has finished.

For a VM or a terminal nobody watches (a spot VM's start-up script runs ``keepalive run -- python
train.py ...``). The command is started again after a stop that asks to be continued (exit status
:data:`~keepalive.errors.EXIT_STOPPED`, 143: SIGTERM, a cloud's preemption notice, the session's
deadline, each after a durable save), and after a crash up to ``max_crashes`` times in a row, with a
back-off that doubles (``backoff``, 2×, 4×, ... up to ``max_backoff``). It is never started again
after it finished (status 0) or after a refusal: an error a restart cannot mend (the checkpoint does
not fit the model, another live session holds the run: :mod:`keepalive.endrecord`, which the child's
keepalive writes to the file named in ``KEEPALIVE_END_FILE``), a usage error (status 2) or a command
that cannot be run (126, 127).

SIGTERM and SIGINT sent to the supervisor are forwarded to the command (started in a session and process
group of its own, so a terminal's Ctrl-C reaches it once, through the supervisor; a hang-up is forwarded
as SIGTERM); the supervisor waits for it
to save and stop, then ends with its status, without a restart. One line is said per restart, and each
restart, stop, refusal and the finish is notified (``notify=`` URLs or ``KEEPALIVE_NOTIFY``:
:mod:`keepalive.notify`).

>>> judge(0, None), judge(143, None)[0], judge(1, {"outcome": "refused", "error": "RunLockedError: x"})
(('finished', 'finished'), 'stopped', ('refused', 'RunLockedError: x'))
>>> judge(-9, None), judge(1, {"outcome": "crashed", "error": "RuntimeError: CUDA out of memory"})[0]
(('crashed', 'killed by SIGKILL'), 'crashed')
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from . import endrecord, report
from .errors import EXIT_STOPPED

__all__ = ["Supervisor", "add_run", "cmd_run", "judge", "USAGE_STATUSES"]

#: exit statuses that say the command itself is wrong (a usage error, not executable, not found)
USAGE_STATUSES = {2: "a usage error", 126: "the command cannot be executed", 127: "the command was not found"}
#: the signals forwarded to the command
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def judge(code: int, record: Optional[Dict[str, Any]]) -> Tuple[str, str]:
    """``(outcome, why)`` of one run of the command: ``finished``, ``stopped`` (143: continue it),
    ``refused`` (never again) or ``crashed`` (again, within the crash budget)."""
    if code == 0:
        return "finished", "finished"
    if record is not None and record.get("outcome") == "refused":
        return "refused", str(record.get("error") or "refused")
    if code == EXIT_STOPPED:
        return "stopped", "stopped (exit 143: deadline, notice or SIGTERM; its checkpoint is saved)"
    if code in USAGE_STATUSES and record is None:
        return "refused", f"exit {code}: {USAGE_STATUSES[code]}"
    if code < 0:
        return "crashed", f"killed by {_signal_name(-code)}"
    error = (record or {}).get("error")
    return "crashed", f"exit {code}" + (f": {error}" if error else "")


@dataclass
class Supervisor:
    """Runs ``command`` until it finishes, is refused, crashes too often or the supervisor is stopped."""

    command: Sequence[str]
    max_crashes: int = 3
    backoff: float = 10.0
    max_backoff: float = 600.0
    notifier: Any = None  # a keepalive.notify.Notifier, or None
    say: Callable[[str], None] = field(default=lambda line: report.say(line))
    #: how many times the command was started again
    restarts: int = 0
    _child: Optional[subprocess.Popen] = field(default=None, repr=False)
    _stop: Optional[int] = field(default=None, repr=False)
    _wake: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def words(self) -> str:
        return shlex.join(self.command)

    def _tell(self, title: str, line: str, kind: str) -> None:
        self.say(line)
        if self.notifier is not None:
            self.notifier.send(f"keepalive run: {title}", f"{line}\ncommand: {self.words}\nhost: "
                               f"{socket.gethostname()}", kind=kind)

    def _forward(self, signum: int, frame: Any) -> None:
        self._stop = signum
        self._wake.set()
        child = self._child
        if child is not None and child.poll() is None:
            # its group: the command and whatever it started. A hang-up (the terminal closed) asks
            # for a save as SIGTERM does: the training's default for SIGHUP is to die unsaved.
            try:
                os.killpg(child.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
            except ProcessLookupError:  # it has just ended
                pass

    def _once(self, folder: str) -> Tuple[int, Optional[Dict[str, Any]]]:
        end_file = os.path.join(folder, f"end-{self.restarts}.json")
        env = dict(os.environ, **{endrecord.ENV: end_file})
        try:
            # a session (and process group) of its own: a terminal's Ctrl-C reaches it once, forwarded
            self._child = subprocess.Popen(list(self.command), env=env, start_new_session=True)
        except OSError as exc:  # not found, not executable: as a shell would say it
            self.say(f"cannot run {self.words}: {exc.strerror or exc}")
            return (127 if isinstance(exc, FileNotFoundError) else 126), None
        try:
            code = self._child.wait()
        finally:
            self._child = None
        return code, endrecord.read(end_file)

    def _delay(self, crashes: int) -> float:
        return 0.0 if crashes == 0 else min(self.backoff * 2 ** (crashes - 1), self.max_backoff)

    def run(self) -> int:
        """Supervise; returns the exit status the supervisor should end with (the command's last)."""
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        try:
            with tempfile.TemporaryDirectory(prefix="keepalive-run-") as folder:
                return self._loop(folder)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.notifier is not None:
                self.notifier.flush()

    def _loop(self, folder: str) -> int:
        crashes = 0
        while True:
            code, record = self._once(folder)
            outcome, why = judge(code, record)
            status = code if code >= 0 else 128 - code
            if self._stop is not None:
                self._tell("stopped", f"{_signal_name(self._stop)} forwarded: the command ended ({why}); "
                           "not restarted", "warning")
                return status
            if outcome == "finished":
                self._tell("finished", f"the command finished after {self.restarts} restart(s)", "success")
                return 0
            if outcome == "refused":
                self._tell("refused", f"not restarted: {why}", "failure")
                return status or 1
            crashes = 0 if outcome == "stopped" else crashes + 1
            if crashes > self.max_crashes:
                self._tell("gave up", f"{why}; not restarted: {crashes} crashes in a row "
                           f"(--max-crashes {self.max_crashes})", "failure")
                return status
            delay = self._delay(crashes)
            self.restarts += 1
            self._tell("restarted", f"{why}; restart {self.restarts}"
                       f"{f' in {delay:g} s (crash {crashes} of {self.max_crashes})' if crashes else ''}: "
                       f"{self.words}", "warning" if crashes else "info")
            if self._wake.wait(delay):  # stopped while waiting: nothing to forward, nothing to start
                self._tell("stopped", f"{_signal_name(self._stop or 0)} while waiting to restart; "
                           "not restarted", "warning")
                return status


def add_run(sub: Any) -> None:
    """The ``keepalive run`` command (registered in :mod:`keepalive.cli`)."""
    p = sub.add_parser("run", help="run a training command, again after a stop or a crash, until it finishes",
                       description="Run CMD (keepalive run -- python train.py ...) and start it again after a "
                                   "stop that asks to be continued (exit 143: the session's deadline, a cloud's "
                                   "notice, SIGTERM) and after a crash, up to --max-crashes in a row with a "
                                   "doubling back-off; never after it finished (0) or was refused (a changed "
                                   "model, a locked run, a usage error). SIGTERM / SIGINT are forwarded to CMD, "
                                   "which saves and stops. The line a spot VM's start-up script runs.")
    p.add_argument("--max-crashes", type=int, default=3, metavar="N",
                   help="crashes in a row before giving up (default 3)")
    p.add_argument("--backoff", type=float, default=10.0, metavar="S",
                   help="seconds before the first restart after a crash, doubled for each further crash in "
                        "a row (default 10)")
    p.add_argument("--notify", default=None, metavar="URLS",
                   help="Apprise URL(s) told of each restart, stop and the finish (default $KEEPALIVE_NOTIFY)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=cmd_run)


def cmd_run(args: Any) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        report.warn("keepalive run: no command given (keepalive run -- python train.py ...)")
        return 2
    return Supervisor(command, max_crashes=max(0, args.max_crashes), backoff=max(0.0, args.backoff),
                      notifier=_notifier(args.notify)).run()


def _notifier(urls: Optional[str]) -> Any:
    """The notifier of ``urls`` (default ``KEEPALIVE_NOTIFY``); None without notifications."""
    try:
        from .notify import notifier_from
    except ImportError:  # a keepalive without its notifications: the lines are said all the same
        return None
    return notifier_from(urls)

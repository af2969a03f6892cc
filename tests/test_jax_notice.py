"""A GCE preemption notice during a single-process Flax NNX training: saved within 5 s, stopped, resumed exact.

Orbax's own preemption save asks ``multihost_utils.reached_preemption_sync_point``, which never answers
"yes" in a process where ``jax.distributed`` was not initialized: a single-process TPU / GPU VM gets no
save from it. keepalive's metadata watcher covers that case as for torch. The GCE metadata service
cannot run here: tests/metaserver.py stands in for it on 127.0.0.1 (``KEEPALIVE_CLOUD=gce``,
``KEEPALIVE_METADATA_URL``). The training is tests/scripts/jax_train.py's NNX shape (the Flax MNIST
tutorial's, a Grain loader), with ``--trace``: a line per step (and a pause after it, in which the
notice comes), per committed checkpoint, and when keepalive stopped the run.

The notice comes inside epoch 1 (six steps an epoch, every=100: no scheduled save inside an epoch): the
checkpoint of the next step is committed within 5 s, the process stops with exit 0 (as the torch notice
tests expect), and the re-run ends bit-identical to a run without keepalive. Negative control, run
beside it: the same notice with no cloud watched (``KEEPALIVE_CLOUD=none``): no checkpoint within the
5 s, the training goes on past the notice.
"""
from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

import numpy as np

from metaserver import MetadataServer
from test_jax_crash import SCRIPT, TWICE, _env, _load, _same

BOUND = 5.0     # seconds from the notice to the committed checkpoint
SLEEP = "0.8"   # seconds each step's body pauses: the training's end (its only scheduled save) is 8 s after the notice
NOTICE_AFTER = 8  # the notice comes in step 8's pause: epoch 1, batch 2 (six batches an epoch)


class Child:
    """tests/scripts/jax_train.py --trace in a process of its own, its lines read with their times."""

    def __init__(self, args: List[str], env: dict):
        self.proc = subprocess.Popen([sys.executable, SCRIPT, *args, "--trace", "--step-sleep", SLEEP],
                                     env=_env(env), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: List[str] = []
        self._queue: "queue.Queue[Optional[Tuple[float, str]]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self._queue.put((time.monotonic(), line.rstrip("\n")))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float) -> Optional[Tuple[float, "re.Match[str]"]]:
        """The first line from here on that matches ``pattern`` (its time, its match); None when
        ``timeout`` passed or the child ended first."""
        end, regex = time.monotonic() + timeout, re.compile(pattern)
        while True:
            try:
                item = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                return None
            if item is None:
                self._queue.put(None)
                return None
            self.lines.append(item[1])
            m = regex.search(item[1])
            if m:
                return item[0], m

    def finish(self, timeout: float = 120.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        while (item := self._queue.get(timeout=30)) is not None:
            self.lines.append(item[1])
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _notice(srv: MetadataServer, child: Child) -> float:
    """Preempt once the child is in step NOTICE_AFTER's pause; the moment it was announced."""
    assert child.wait_line(rf"^STEP {NOTICE_AFTER}$", timeout=180) is not None, child.text
    srv.preempt()
    return time.monotonic()


def test_a_gce_notice_mid_epoch_is_saved_within_5s_stops_and_resumes_exact(tmp_path):
    """The notice in step 8 (epoch 1): step 8's checkpoint committed within 5 s, stopped with exit 143,
    the re-run (in one interpreter after the run without keepalive) equal to it array for array. The
    control, no cloud watched, beside it: no checkpoint within 5 s, the steps go on."""
    run, out = str(tmp_path / "run"), str(tmp_path / "res.npz")
    base = ["--shape", "nnx", "--every", "100"]
    with MetadataServer(cloud="gce") as srv, MetadataServer(cloud="gce") as unwatched:
        first = Child([*base, "--run", run, "--out", out],
                      {"KEEPALIVE_CLOUD": "gce", "KEEPALIVE_METADATA_URL": srv.url})
        control = Child([*base, "--run", str(tmp_path / "control"), "--out", str(tmp_path / "control.npz")],
                        {"KEEPALIVE_CLOUD": "none", "KEEPALIVE_METADATA_URL": unwatched.url})
        sent, control_sent = _notice(srv, first), _notice(unwatched, control)
        committed = first.wait_line(r"^COMMITTED (\d+)$", timeout=60)
        assert committed is not None, first.text
        at, m = committed
        print(f"notice -> committed: {at - sent:.2f} s")
        assert at - sent < BOUND, first.text
        assert first.finish() == 143, first.text  # stopped, not finished (EXIT_STOPPED)
        late = control.wait_line(r"^COMMITTED (\d+)$", timeout=BOUND + control_sent - time.monotonic())
        control.proc.kill()
        control.finish()
    step = int(m.group(1))
    assert f"STOPPED {step}" in first.text and "DONE" not in first.text, first.text
    assert step == NOTICE_AFTER, first.text  # the boundary right after the notice, inside epoch 1
    assert f"stopping before the VM is reclaimed: saved in epoch 1 after 2 batches, step {step}" in first.text, \
        first.text
    assert "Why: GCE" in first.text, first.text
    # the control: nothing saved within the bound, and the training went on past the notice
    assert late is None and f"STEP {NOTICE_AFTER + 2}" in control.text, control.text
    plain = str(tmp_path / "plain.npz")
    argvs = [[SCRIPT, "--shape", "nnx", "--out", plain, "--plain"],
             [SCRIPT, *base, "--run", run, "--out", out]]
    proc = subprocess.run([sys.executable, "-c", TWICE.format(argvs=argvs)], capture_output=True, text=True,
                          env=_env({"KEEPALIVE_CLOUD": "none"}), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"in epoch 1 after 2 batches, step {step}" in proc.stdout + proc.stderr
    _same(_load(plain), _load(out))
    assert np.load(out)["history/h"].shape == (2, 3)

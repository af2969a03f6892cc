"""A stop before the training's end (a cloud's notice, the session's deadline, a signal) stops the script.

After the stop's save is durable the training call does not return: a script ends with exit status
``keepalive.errors.EXIT_STOPPED`` (143, as SIGTERM's), its code after the loop not run (its
``finally`` still runs), one line saying why; a notebook cell ends with ``TrainingStopped`` instead.
``on_preempt="save"`` / ``on_deadline="save"`` train on to the end. The children are
tests/scripts/stop_train.py, forked from a server that has imported torch; a GCE notice comes from the
metadata stand-in (tests/metaserver.py). Every stopped run, run again, ends bit-identical to the same
training without keepalive. The control takes the stop's exit away: the script's code after the loop
then runs after 2 of 4 epochs and exits 0, what the checks here would catch.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
from typing import Dict, List, Optional

import pytest

torch = pytest.importorskip("torch")

from crashkit import assert_differs, assert_same  # noqa: E402
from forkserver import ForkServer  # noqa: E402
from keepalive.distributed import DistributedMisuseError  # noqa: E402
from keepalive.errors import EXIT_STOPPED, TrainingStopped  # noqa: E402
from metaserver import MetadataServer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "stop_train.py")
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0",
                KEEPALIVE_CLOUD="none", PYTHONPATH=os.pathsep.join([os.path.join(HERE, "scripts"), ROOT]))
EXIT_LINE = ("exiting with code 143 (stopped by {}), not 0: the program did not run to its end, and only a failed "
             "exit makes torchrun --max-restarts or a job scheduler start it again, which resumes from this checkpoint")


class Child:
    """tests/scripts/stop_train.py forked; its lines read by a thread."""

    def __init__(self, server: ForkServer, run_dir: str, out: str, **env: str):
        self.out = out
        self.proc = server.spawn([SCRIPT, run_dir, out], dict(BASE_ENV, **env))
        self.lines: List[str] = []
        self._queue: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, text: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while True:
            line = self._queue.get(timeout=max(0.01, end - time.monotonic()))
            assert line is not None, f"ended without {text!r}:\n{self.text}"
            self.lines.append(line)
            if line == text:
                return

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def final(self) -> Dict[str, object]:
        return torch.load(self.out)


@pytest.fixture(scope="module")
def server():
    forks = ForkServer(["torch", "torch._dynamo", "torch.utils.data"], BASE_ENV)
    try:
        yield forks
    finally:
        forks.close()


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory) -> Dict[str, object]:
    """The uninterrupted training without keepalive."""
    folder = tmp_path_factory.mktemp("plain")
    child = Child(server, str(folder / "unused"), str(folder / "out.pt"), ST_PLAIN="1")
    assert child.finish() == 0 and "AFTER" in child.text, child.text
    return child.final()


def assert_stopped(first: Child, cause: str) -> int:
    """Exit 143 after a committed save, the code after the loop not run, the ``finally`` run, the
    line; the step the run stopped at."""
    code = first.finish()
    assert code == EXIT_STOPPED, (code, first.text)
    assert "AFTER" not in first.text and not os.path.exists(first.out), first.text
    assert "FINALLY" in first.text, first.text
    assert first.text.count("exiting with code") == 1 and EXIT_LINE.format(cause) in first.text, first.text
    committed = [int(s) for s in re.findall(r"^COMMITTED (\d+)$", first.text, re.M)]
    assert len(committed) == 1 and 0 < committed[0] < 20, first.text
    return committed[0]


def resumed(server, tmp_path) -> Child:
    again = Child(server, str(tmp_path / "run"), str(tmp_path / "out.pt"))
    assert again.finish() == 0 and "AFTER" in again.text and "resuming run" in again.text, again.text
    return again


def test_a_gce_notice_ends_the_script_with_143_and_the_rerun_is_exact(server, reference, tmp_path):
    with MetadataServer(cloud="gce") as srv:
        first = Child(server, str(tmp_path / "run"), str(tmp_path / "out.pt"), KEEPALIVE_CLOUD="gce",
                      KEEPALIVE_METADATA_URL=srv.url, ST_STEP_SLEEP="0.1")
        first.wait_line("STEP 6")
        srv.preempt()
        assert_stopped(first, "a preemption notice")
    assert "stopping before the VM is reclaimed: saved in epoch " in first.text, first.text
    assert_same(resumed(server, tmp_path).final(), reference)


def test_the_deadline_ends_the_script_with_143_and_the_rerun_is_exact(server, reference, tmp_path):
    first = Child(server, str(tmp_path / "run"), str(tmp_path / "out.pt"), ST_DEADLINE_AT="7")
    assert assert_stopped(first, "the session's deadline") == 7
    assert "stopping before the session ends: saved in epoch 1 after 2 batches, step 7" in first.text, first.text
    assert_same(resumed(server, tmp_path).final(), reference)


def test_on_preempt_save_saves_and_trains_on_to_exit_0(server, reference, tmp_path):
    with MetadataServer(cloud="gce") as srv:
        first = Child(server, str(tmp_path / "run"), str(tmp_path / "out.pt"), KEEPALIVE_CLOUD="gce",
                      KEEPALIVE_METADATA_URL=srv.url, ST_STEP_SLEEP="0.15", ST_ON_PREEMPT="save")
        first.wait_line("STEP 3")
        srv.preempt()
        assert first.finish() == 0, first.text
    assert "AFTER" in first.text and "exiting with code" not in first.text, first.text
    assert re.search(r"^COMMITTED ([3-9]|1\d)$", first.text, re.M), first.text  # the notice's save
    assert "; the training goes on" in first.text, first.text
    assert_same(first.final(), reference)


def test_negative_control_without_the_exit_the_code_after_the_loop_runs(server, reference, tmp_path):
    """The old behaviour (the training call returns after a stop): the script writes its "final"
    weights after 7 of 20 steps and exits 0, which the checks above reject."""
    first = Child(server, str(tmp_path / "run"), str(tmp_path / "out.pt"), ST_DEADLINE_AT="7", ST_NO_EXIT="1")
    with pytest.raises(AssertionError):
        assert_stopped(first, "the session's deadline")
    assert first.proc.returncode == 0 and "AFTER" in first.text, first.text
    assert_differs(first.final(), reference)


# ------------------------------------------------------------------------------------ in process
def _loop(tmp_path, epochs_of_keepalive=True, **options):
    """A plain torch loop with ``DriveCheckpoint(**options)`` whose session has 1 s left; its checkpointer.
    ``epochs_of_keepalive=False``: ``for epoch in range(3)`` around ``ckpt.batches()``."""
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True, remaining_fn=lambda: 1.0,
                           deadline_margin="5s", **options)
    for _ in ckpt.epochs(3) if epochs_of_keepalive else range(3):
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return ckpt


def test_on_deadline_save_trains_on_and_returns(tmp_path):
    ckpt = _loop(tmp_path, on_deadline="save")
    assert ckpt.finished and ckpt.step == 6 and not ckpt.core.stopped


def test_in_a_notebook_the_training_call_ends_with_training_stopped_not_systemexit(tmp_path, monkeypatch):
    from keepalive import session

    monkeypatch.setattr(session, "in_notebook", lambda ip=None: True)
    with pytest.raises(TrainingStopped, match="The cells after this one did not run"):
        _loop(tmp_path)


@pytest.mark.parametrize("epochs_of_keepalive", [True, False], ids=["ckpt.epochs", "range"])
def test_in_a_script_the_same_loop_ends_with_systemexit_143(tmp_path, epochs_of_keepalive):
    with pytest.raises(SystemExit) as stop:
        _loop(tmp_path, epochs_of_keepalive)
    assert stop.value.code == EXIT_STOPPED


def test_hf_trainer_deadline_stop_raises_143_and_the_rerun_is_exact(tmp_path):
    import hfkit

    hfkit.importorskip("transformers")
    from keepalive.callbacks.transformers import DriveCheckpoint

    cb = DriveCheckpoint(tmp_path / "run", every=100, quiet=True, remaining_fn=hfkit.stop_after(3),
                         deadline_margin="5s")
    after = []
    with pytest.raises(SystemExit) as stop:
        hfkit.train(tmp_path / "a", cb, epochs=1)
        after.append("the code after train()")
    assert stop.value.code == EXIT_STOPPED and not after and cb.stopped and 0 < cb.step, cb.step
    plain = hfkit.train(tmp_path / "p", epochs=1)
    assert cb.step < plain.state.global_step
    assert_same(hfkit.resumed(tmp_path, plain.state.global_step, epochs=1), hfkit.trainer_state(plain))


# --------------------------------------------------------------- the check-in under a process group
class _Store:
    """The few calls of torch's Store that check_in makes; rank 1 arrives at ``arrives`` (monotonic) or never."""

    def __init__(self, arrives: Optional[float] = None):
        self.values: Dict[str, int] = {}
        self.arrives = arrives

    def _peer(self) -> None:
        if self.arrives is not None and time.monotonic() >= self.arrives and "peer" not in self.values:
            self.values["peer"] = 1
            self.values["keepalive/group/save()/1/1"] = 1
            self.values["keepalive/group/save()/1"] = self.values.get("keepalive/group/save()/1", 0) + 1

    def set(self, key: str, value: str) -> None:
        self.values[key] = 1

    def add(self, key: str, n: int) -> int:
        self._peer()
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def check(self, keys: List[str]) -> bool:
        return all(k in self.values for k in keys)


def _group(store: _Store):
    from keepalive.distributed import ProcessGroup

    class TwoRanks(ProcessGroup):
        rank, world_size = 0, 2  # type: ignore[assignment]

        def _store(self):
            return store

    return TwoRanks()


@pytest.fixture
def sigterm_noted():
    """SIGTERM sent to this process while keepalive's handler defers it (as in a training loop)."""
    from keepalive.interrupts import DeferredSignals

    deferred = DeferredSignals(lambda: None, announce=lambda: False)
    deferred.install()
    try:
        yield lambda: signal.raise_signal(signal.SIGTERM)
    finally:
        deferred.uninstall()


def test_check_in_waiting_for_a_dead_peer_ends_on_a_pending_sigterm(sigterm_noted, monkeypatch, capsys):
    from keepalive import distributed

    monkeypatch.setattr(distributed, "SIGNAL_GRACE_SECONDS", 0.3)
    sigterm_noted()
    started = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        _group(_Store()).check_in("save()", "call it on every rank", timeout=20)
    assert stop.value.code == EXIT_STOPPED and time.monotonic() - started < 5
    assert "rank 0: SIGTERM while waiting at save() for rank 1: stopping without a new checkpoint" in \
        capsys.readouterr().err


def test_check_in_control_a_live_peer_within_the_grace_is_waited_for(sigterm_noted, monkeypatch):
    """The same pending SIGTERM while the other rank comes 0.2 s later: the save goes on (the signal
    acts after it); and without any signal the dead peer is waited for until the timeout."""
    from keepalive import distributed

    monkeypatch.setattr(distributed, "SIGNAL_GRACE_SECONDS", 1.0)
    sigterm_noted()
    _group(_Store(arrives=time.monotonic() + 0.2)).check_in("save()", "call it on every rank", timeout=20)


def test_check_in_control_without_a_signal_the_dead_peer_is_waited_for_until_the_timeout():
    started = time.monotonic()
    with pytest.raises(DistributedMisuseError):
        _group(_Store()).check_in("save()", "call it on every rank", timeout=1.0)
    assert time.monotonic() - started >= 1.0


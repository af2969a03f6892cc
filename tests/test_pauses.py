"""The pieces of saves between steps (keepalive/pauses.py) on their own: the step gate, the version
sum, the guard's timing. The saves themselves are tested per adapter in tests/test_preempt_*.py."""
from __future__ import annotations

import threading
import time

import pytest

from keepalive import pauses


def test_the_gate_closes_only_between_steps_and_never_releases_a_lock_it_did_not_take():
    gate = pauses.StepGate()
    with gate.closed() as between:
        assert between
    gate.enter_step()  # a step runs
    with gate.closed() as between:
        assert not between
    gate.leave_step()
    # a step entering right now holds the gate's lock: the guard gives up, and leaves that lock alone
    gate._lock.acquire()
    try:
        with gate.closed() as between:
            assert not between
        assert gate._lock.locked()  # still the step's
    finally:
        gate._lock.release()


def test_a_step_waits_at_the_gate_while_the_guard_copies():
    gate = pauses.StepGate()
    entered = threading.Event()

    def step() -> None:
        gate.enter_step()
        entered.set()
        gate.leave_step()

    with gate.closed() as between:
        assert between
        worker = threading.Thread(target=step)
        worker.start()
        assert not entered.wait(0.2)  # the step waits while the gate is closed
    assert entered.wait(10)
    worker.join(10)


def test_versions_only_grow_and_detach_shares_them():
    torch = pytest.importorskip("torch")
    weight = torch.zeros(3)
    tree = {"model": {"w": weight.detach()}, "opt": [torch.ones(2)], "n": 3}
    before = pauses.version_sum(pauses.tensors_of(tree))
    assert len(pauses.tensors_of(tree)) == 2
    weight.add_(1)  # in place, on the original: the detached view's counter moves too
    assert pauses.version_sum(pauses.tensors_of(tree)) > before


def test_the_guard_acts_only_after_the_loop_has_been_away():
    calls = []
    last = {"t": time.monotonic()}
    guard = pauses.PauseGuard(lambda: last["t"], lambda: calls.append(time.monotonic()))
    try:
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls and calls[0] - last["t"] >= pauses.PAUSE_SECONDS
        n = len(calls)
        last["t"] = time.monotonic() + 3600  # the loop calls keepalive all the time: the guard waits
        time.sleep(3 * pauses.POLL_SECONDS)
        assert len(calls) <= n + 1
    finally:
        guard.stop()

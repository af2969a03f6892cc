"""Saves that land while the training loop pauses between steps (a long evaluation, a data stall).

A SIGTERM, a Ctrl-C, a cloud's preemption notice or the session's deadline may come while the loop
is outside a training step: in a 60 s validation pass, while the next batch loads, during warm-up.
The state after the last optimizer step is consistent then, and waiting for the next step boundary
can take longer than the notice leaves. So the core remembers, at each consistent boundary, a
:class:`Mark`: the counters, the random state (the evaluation will draw from it), the optimizer steps,
the sum of the state's tensor version counters and the adapter's fingerprint of its other state (a
scheduler's step count, a loader's position). A save between steps writes the state as it is *now*
with the mark's random state, and only when nothing else moved: an optimizer step, an in-place
tensor change (BatchNorm statistics of the next batch's forward, an EMA), a scheduler stepped before
the evaluation. Otherwise it waits for the next boundary and says why.

Two ways in: the training thread calls the core while it evaluates (the adapters' evaluation hooks:
:meth:`keepalive.core.Checkpointer.active`), or, when the loop does not call the core for longer
than :data:`PAUSE_SECONDS`, :class:`PauseGuard`'s thread saves, holding :class:`StepGate` so that no
optimizer step starts while the state is copied, and checking the versions again after the copy.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from .boundary import Counters

log = logging.getLogger("keepalive.pauses")

#: the loop has not called keepalive for this long: the guard's thread may save for it
PAUSE_SECONDS = 1.0
#: how often the guard looks
POLL_SECONDS = 0.25

__all__ = ["Mark", "PauseGuard", "StepGate", "tensors_of", "version_sum", "PAUSE_SECONDS"]


def tensors_of(tree: Any) -> List[Any]:
    """The tensors (anything with a version counter: torch tensors) in a captured state tree."""
    found: List[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "_version") and hasattr(x, "data_ptr"):
            found.append(x)

    walk(tree)
    return found


def version_sum(tensors: List[Any]) -> int:
    """The sum of the tensors' version counters. Versions only grow, so two equal sums over the same
    tensors mean none was changed in place in between (``detach()``, as ``state_dict`` does, shares
    the counter)."""
    return sum(t._version for t in tensors)


@dataclass(frozen=True)
class Mark:
    """The state at the last consistent boundary, as far as a later save between steps needs it."""

    counters: Counters
    rng: Any
    optimizer_steps: int
    versions: int
    fingerprint: Any
    at: float


class StepGate:
    """Lets the guard's thread copy the state while no optimizer step runs: a step waits at its
    start (an optimizer's step pre-hook) while the gate is closed; the gate closes only between
    steps. The training thread pays one uncontended lock per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_step = False
        #: whether a step hook uses the gate (adapters on torch optimizers); else no thread save
        self.used = False
        #: the optimizers whose steps pass the gate (weakly: the gate must not keep them alive); their
        #: parameters and state change only inside a step, so a lazy snapshot may copy them later
        self.optimizers: "List[weakref.ref[Any]]" = []
        #: called (weakly) at each step's start before anything else: the core settles a lazy
        #: snapshot's copy there, before the step changes what it still copies
        self.before_step: "Optional[weakref.WeakMethod[Callable[[], None]]]" = None
        #: False where the adapter settles later itself (Lightning runs forward and backward inside
        #: optimizer.step(closure): settled at the step's start, the copy would overlap nothing)
        self.settle_at_step_start = True

    def watch(self, optimizer: Any) -> None:
        self.used = True
        self.optimizers.append(weakref.ref(optimizer))

    def watched(self) -> List[Any]:
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def enter_step(self) -> None:
        settle = self.before_step() if self.before_step is not None and self.settle_at_step_start else None
        if settle is not None:
            settle()
        with self._lock:  # blocks while the guard copies the state
            self._in_step = True

    def leave_step(self) -> None:
        self._in_step = False

    def closed(self) -> "_Closed":
        return _Closed(self)


class _Closed:
    def __init__(self, gate: StepGate):
        self.gate, self.ok, self.held = gate, False, False

    def __enter__(self) -> bool:
        self.held = self.gate._lock.acquire(timeout=0.05)
        if not self.held:  # a step is entering right now: not between steps
            return False
        self.ok = not self.gate._in_step  # a step that began before: not between steps
        return self.ok

    def __exit__(self, *exc: Any) -> None:
        if self.held:  # only ours: a lock the step's pre-hook holds is not released here
            self.held = False
            self.gate._lock.release()


class PauseGuard:
    """A daemon thread that, while the training loop runs, calls ``act()`` every
    :data:`POLL_SECONDS` when the loop has not called keepalive for :data:`PAUSE_SECONDS`
    (``last_call()``: monotonic time of its last call). ``wake()`` makes it look at once."""

    def __init__(self, last_call: Callable[[], float], act: Callable[[], None]):
        self._last_call, self._act = last_call, act
        self._event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="keepalive-pause-guard", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._event.set()

    def stop(self, wait: float = 1.0) -> None:
        """End the thread, waiting up to ``wait`` seconds for it: at the interpreter's exit no
        keepalive thread may still run (a daemon thread inside torch's C++ code when Python ends
        aborts the process)."""
        self._stopped = True
        self._event.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(wait)

    def _run(self) -> None:
        while not self._stopped:
            self._event.wait(POLL_SECONDS)
            self._event.clear()
            if self._stopped:
                return
            if time.monotonic() - self._last_call() < PAUSE_SECONDS:
                continue
            try:
                self._act()
            except BaseException as exc:  # noqa: BLE001 - a guard must never die of what it tried
                log.debug("a save between steps failed: %s", exc, exc_info=True)


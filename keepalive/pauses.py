"""Saves that land while the training loop pauses between steps (a long evaluation, a data stall).

A SIGTERM, a Ctrl-C, a cloud's preemption notice or the session's deadline may come while the loop
is outside a training step: in a 60 s validation pass, while the next batch loads, during warm-up.
The state after the last optimizer step is consistent then, and waiting for the next step boundary
can take longer than the notice leaves. So the core remembers, at each consistent boundary, a
:class:`Mark`: the counters, the random state (the evaluation will draw from it), the optimizer steps,
the version counters of the state's tensors and the adapter's fingerprint of what no part keeps (a
loader's position). The mark also holds what the :class:`BoundaryPart` s kept at that boundary: the
small state beside the tensors (a scheduler's ``state_dict``, an optimizer's learning rates,
``ckpt.extras``, the loop's plain values), copied without a tensor (:func:`kept_copy`; only what
changed since the last copy). A save between steps
writes the tensors as they are *now* with the mark's random state and the parts' kept state, and only
when no tensor moved: an optimizer step, an in-place change (BatchNorm statistics of a forward in
training mode, an EMA) are refused, named (:func:`changed_tensor`), and wait for the next boundary. A
scheduler stepped between the last batch and the evaluation is no obstacle: its state at the boundary
is the one saved, and the resumed loop steps it again.

Two ways in: the training thread calls the core while it evaluates (the adapters' evaluation hooks:
:meth:`keepalive.core.Checkpointer.active`), or, when the loop does not call the core for longer
than :data:`PAUSE_SECONDS`, :class:`PauseGuard`'s thread saves, holding :class:`StepGate` so that no
optimizer step starts while the state is copied, and checking the versions again after the copy.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .boundary import Counters
from .statetree import StateTree

log = logging.getLogger("keepalive.pauses")

#: the loop has not called keepalive for this long: the guard's thread may save for it
PAUSE_SECONDS = 1.0
#: how often the guard looks
POLL_SECONDS = 0.25

__all__ = ["BoundaryPart", "KeptValue", "Mark", "PauseGuard", "StepGate", "UNKEPT", "Uncopyable", "changed_tensor",
           "describe_path", "kept_copy", "named_tensors", "small_copy", "tensors_of", "version_sum", "versions",
           "PAUSE_SECONDS"]


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "_version") and hasattr(x, "data_ptr")


def named_tensors(tree: Any) -> Iterator[Tuple[Tuple[Any, ...], Any]]:
    """``(path, tensor)`` for each tensor (anything with a version counter: torch tensors) in a
    captured state tree, in the order :func:`tensors_of` lists them."""
    stack: List[Tuple[Tuple[Any, ...], Any]] = [((), tree)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, dict):
            stack.extend(reversed([((*path, k), v) for k, v in x.items()]))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed([((*path, i), v) for i, v in enumerate(x)]))
        elif _is_tensor(x):
            yield path, x


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
        elif _is_tensor(x):
            found.append(x)

    walk(tree)
    return found


def version_sum(tensors: List[Any]) -> int:
    """The sum of the tensors' version counters. Versions only grow, so two equal sums over the same
    tensors mean none was changed in place in between (``detach()``, as ``state_dict`` does, shares
    the counter)."""
    return sum(t._version for t in tensors)


def versions(tensors: Sequence[Any]) -> Tuple[int, ...]:
    """The tensors' version counters, one each (no dearer than their sum): a mark keeps them to name
    the tensor that moved."""
    return tuple([t._version for t in tensors])


def changed_tensor(tree: StateTree, tensors: Sequence[Any], before: Sequence[int]) -> Optional[str]:
    """None when no tensor of ``tree`` was changed in place since a mark took the version counters
    ``before`` of ``tensors`` (those the last save held); else the one that was, named by its place in
    the tree (``1.running_mean of 'model'``). A tensor is found among ``tensors`` by its memory (a
    ``state_dict()`` gives new views of the same tensors each time); one that is not there (new since
    the last save: the random state, a loop's batch) is taken as unchanged only while it has never been
    changed in place (its version counter is 0)."""
    at_mark: Dict[Tuple[int, int], int] = {}
    for t, was in zip(tensors, before):
        if t.numel():
            at_mark[(t.data_ptr(), t.numel())] = was
    for path, t in named_tensors(tree):
        if not t.numel():
            continue
        was = at_mark.get((t.data_ptr(), t.numel()), 0)
        if t._version != was:
            return describe_path(path)
    return None


def describe_path(path: Tuple[Any, ...]) -> str:
    """A place in a state tree as a user knows it: ``1.running_mean of 'model'`` for an entry of a
    registered object's ``state_dict()``, else the keys joined by ``/``."""
    keys = [str(k) for k in path]
    if len(keys) >= 3 and keys[0] == "objects":
        return f"{'.'.join(keys[2:])} of '{keys[1]}'"
    return "/".join(keys)


# ---------------------------------------------------------------------------- boundary parts
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_TYPES = frozenset(_SCALARS)


class Uncopyable(Exception):
    """A part's state holds a value :func:`kept_copy` cannot copy (it is not kept)."""


def small_copy(x: Any) -> Any:
    """``x`` copied so that later changes of the live state do not reach it: containers and plain
    values copied, arrays copied, tensors *by reference* (a mark's version counters prove them
    unchanged: no tensor is ever copied here); other objects through ``copy.deepcopy``."""
    if isinstance(x, _SCALARS) or _is_tensor(x):
        return x
    kind = type(x)
    if kind is dict:
        return {k: small_copy(v) for k, v in x.items()}
    if kind is list:
        return [small_copy(v) for v in x]
    if kind is tuple:
        return tuple([small_copy(v) for v in x])
    if hasattr(x, "dtype") and hasattr(x, "copy"):  # a NumPy array or scalar
        return x.copy()
    try:
        return copy.deepcopy(x)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it cannot be kept
        raise Uncopyable(f"a {kind.__name__} cannot be copied: {exc}") from exc


_MISSING = object()


def kept_copy(now: Any, before: Any = None, leave: Tuple[str, ...] = ()) -> Any:
    """:func:`small_copy` of ``now``, sharing the entries of ``before`` (the previous copy of the same
    dict) that did not change: a scheduler stepped once copies its step count, not its whole state.
    ``leave``: keys of ``now`` not copied (an optimizer group's ``params``)."""
    if type(now) is not dict or type(before) is not dict:
        now = {k: v for k, v in now.items() if k not in leave} if leave and isinstance(now, dict) else now
        return small_copy(now)
    out = {}
    for key, value in now.items():
        was = before.get(key, _MISSING)
        kind = type(value)
        if was is value or (kind in _PLAIN_TYPES and type(was) is kind and was == value):
            out[key] = was  # (plain values inline: this runs at every step boundary)
        elif key not in leave:
            out[key] = was if _equal(was, value) else small_copy(value)
    return out


def _equal(was: Any, now: Any) -> bool:
    """Whether an earlier copy ``was`` still equals ``now``: plain values and their containers by
    value; a tensor, an array or another object only to itself (no tensor is ever compared by value:
    that would read a GPU's memory at every step)."""
    if was is now:
        return True
    kind = type(now)
    if type(was) is not kind:
        return False
    if kind in _PLAIN_TYPES:
        return bool(was == now)
    if kind is dict:
        return len(was) == len(now) and all(k in was and _equal(was[k], v) for k, v in now.items())
    if kind is list or kind is tuple:
        return len(was) == len(now) and all(_equal(a, b) for a, b in zip(was, now))
    return False


#: what a part that could not copy its state keeps: a save between steps is refused (named)
UNKEPT = object()


class BoundaryPart:
    """A piece of the state that a save between steps takes as it was at the last consistent boundary
    instead of as it is now: the small state beside the tensors that a loop changes after its last
    batch and before its evaluation (an epoch's scheduler stepped, an optimizer's learning rates, a
    counter, the loop's plain values). The core calls :meth:`keep` at each consistent boundary (in the
    training thread: it must be cheap, copy no tensor, and copy only what changed since ``before``,
    what it kept last time, None at first) and :meth:`put` on the tree a save between steps built from
    the objects as they are now. Adapters add theirs with
    :meth:`keepalive.lifecycle.between_steps.BetweenSteps.add_part`."""

    #: how a refusal names it
    name = "a part of the state"

    def keep(self, before: Any) -> Any:
        raise NotImplementedError

    def put(self, tree: StateTree, kept: Any) -> None:
        raise NotImplementedError


class KeptValue(BoundaryPart):
    """The part of the tree under ``path`` (``("extras",)``), read by ``read()``: kept by
    :func:`kept_copy`, put back in its place."""

    def __init__(self, name: str, path: Tuple[str, ...], read: Callable[[], Any]):
        self.name, self.path, self._read = name, path, read

    def keep(self, before: Any) -> Any:
        return kept_copy(self._read(), before)

    def put(self, tree: StateTree, kept: Any) -> None:
        node: Any = tree
        for key in self.path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and self.path[-1] in node:
            node[self.path[-1]] = kept


@dataclass(frozen=True)
class Mark:
    """The state at the last consistent boundary, as far as a later save between steps needs it."""

    counters: Counters
    rng: Any
    optimizer_steps: int
    #: the version counters of ``tensors``, those the last save held (None: the checkpoint resumed from
    #: is the state)
    versions: Optional[Tuple[int, ...]]
    fingerprint: Any
    at: float
    #: each :class:`BoundaryPart` with what it kept at this boundary
    parts: Tuple[Tuple[BoundaryPart, Any], ...] = ()
    #: the tensors ``versions`` counts (the list the saver held then: a later save replaces it)
    tensors: Sequence[Any] = ()


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


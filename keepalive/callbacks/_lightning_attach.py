"""Stand-ins in front of a Lightning trainer's loop methods, for one fit: where a save is exact.

Lightning calls a callback at no moment that is a safe boundary for every case (after a batch's logging,
before its validation, after an epoch's end hooks, where the training loaders become final), so the
Lightning adapter (:mod:`keepalive.callbacks.lightning`) stands in front of a few loop methods of the
trainer it fits (on the instances only, never the classes) and puts them back when the fit ends. The
method names are those of the inventory (:mod:`keepalive.callbacks._compat_lightning`), checked when the
callback was made. This module knows where to stand; what happens there is the :class:`LoopEvents`'.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, List, NamedTuple, Tuple, Type

from . import _compat_lightning as lc

_ABSENT = object()


class LoopEvents(NamedTuple):
    """What the adapter does at each place it stands (each called with no argument)."""

    epoch_start: Callable[[], None]       # before an epoch of the fit loop starts
    epoch_end: Callable[[], None]         # after it ended (its validation, end hooks, schedulers: done)
    batch_end: Callable[[], None]         # after a training batch and its logging
    validation_begins: Callable[[], bool]  # before the epoch loop's validation runs: True skips it
    loaders_ready: Callable[[], None]     # the training loaders are final; Lightning calls iter() next
    positioned: Callable[[], bool]        # keepalive positions the training loaders (they are resumable)


class StandIns:
    """Attributes of a trainer's objects set for one fit, each put back as it was by :meth:`put_back`."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []  # (object, attribute, what was there)

    def change(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` for this fit only (an instance attribute)."""
        self._saved.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, value)

    def wrap(self, obj: Any, name: str, fn: Callable[..., Any]) -> Any:
        """Put ``fn`` in front of the method ``obj.name`` for this fit; returns the method it stands for."""
        original = getattr(obj, name)
        self.change(obj, name, fn)
        return original

    def put_back(self) -> None:
        for obj, name, before in reversed(self._saved):
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)
        self._saved = []


def attach(trainer: Any, stand_ins: StandIns, events: LoopEvents) -> bool:
    """Stand in front of the fit loop's epoch start and end, the epoch loop's reset, batch end and
    validation, and the method that builds the training loaders' states. Returns False when this
    Lightning builds its training data in an unknown way (that method is missing)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    _around(stand_ins, fit_loop, lc.EPOCH_START, before=events.epoch_start)
    _around(stand_ins, fit_loop, lc.EPOCH_END, after=events.epoch_end)
    _around(stand_ins, epoch_loop, lc.BATCH_END, after=events.batch_end)
    orig_reset = getattr(epoch_loop, lc.EPOCH_RESET)

    def epoch_reset(*a: Any, **k: Any) -> Any:
        if not events.positioned():
            return orig_reset(*a, **k)
        with warnings.catch_warnings():  # keepalive positions the loaders: they are resumable
            warnings.filterwarnings("ignore", message=lc.NOT_RESUMABLE_WARNING)
            return orig_reset(*a, **k)

    stand_ins.change(epoch_loop, lc.EPOCH_RESET, epoch_reset)
    # the epoch loop's validation (inside the epoch or at its end): its start is the batch's boundary
    orig_validation_run = epoch_loop.val_loop.run

    def validation_run(*a: Any, **k: Any) -> Any:
        if events.validation_begins():
            return []  # the deadline's stop, saved at this boundary: no validation first
        return orig_validation_run(*a, **k)

    stand_ins.change(epoch_loop.val_loop, "run", validation_run)
    if not callable(getattr(fit_loop, lc.LOAD_LOADER_STATES, None)):
        return False
    _around(stand_ins, fit_loop, lc.LOAD_LOADER_STATES, before=events.loaders_ready)
    return True


def _around(stand_ins: StandIns, obj: Any, name: str, before: Callable[[], None] = lambda: None,
            after: Callable[[], None] = lambda: None) -> None:
    """Stand in front of ``obj.name``: ``before`` runs first, ``after`` once it returned, or raised
    Lightning's SIGTERMException (the signal ends the fit after this boundary)."""
    original = getattr(obj, name)
    sigterm = _sigterm_exception()

    def stand_in(*a: Any, **k: Any) -> Any:
        before()
        try:
            result = original(*a, **k)
        except sigterm:
            after()
            raise
        after()
        return result

    stand_ins.change(obj, name, stand_in)


def _sigterm_exception() -> Tuple[Type[BaseException], ...]:
    """Lightning's SIGTERMException classes (both namespaces, when installed)."""
    found: List[Type[BaseException]] = []
    for module in ("lightning.pytorch.utilities.exceptions", "pytorch_lightning.utilities.exceptions"):
        if module.split(".")[0] not in sys.modules:  # never import a namespace the user does not use
            continue
        try:
            found.append(__import__(module, fromlist=["SIGTERMException"]).SIGTERMException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)

"""The training's plan: what the code asked for (epochs, steps, a scheduler's settings, a split),
stored with every checkpoint and compared with the code's plan when a run resumes.

A plan is a flat dict of JSON values keyed by dotted names, filled by the adapter (the core stores it
under the tree's ``plan`` key). On a resume the saved plan and the code's are compared: each changed
value is a line the user reads, saying which one wins.

>>> saved = {"epochs": 5, "scheduler.T_max": 5, "split": fingerprint([0, 3, 4])}
>>> now = {"epochs": 8, "scheduler.T_max": 8, "split": fingerprint([0, 3, 4])}
>>> changes(saved, now)
[('epochs', 5, 8), ('scheduler.T_max', 5, 8)]
>>> describe(changes(saved, now))
'epochs 5 -> 8, scheduler.T_max 5 -> 8'
>>> changes(None, now)  # a checkpoint written before plans were stored: nothing to compare
[]

The plan from a saved position, for the adapters whose run is several fit calls (Keras' stages,
fastai's fits): each fit call is matched with a recorded fit by its place among the run's fits, unless
its plan says otherwise (a script re-run with its first ``fit`` commented out is the second fit, not
the first one again); a resumed fit whose plan changed follows the code from the work the checkpoint
had done (:class:`Resumed`), said once. Both adapters keep their own record of fits in their
checkpoints; the rules for reading it against the code's plan live here, once.

>>> recorded = {0: {"epochs": 2, "lr": 0.1}, 1: {"epochs": 5, "lr": 0.01}}
>>> by_plan(recorded, 0, {"epochs": 5, "lr": 0.01})  # fit 0 commented out: this is fit 1
1
>>> by_plan(recorded, 0, {"epochs": 8, "lr": 0.3}) is None  # no recorded fit has this plan
True
>>> resumed = Resumed(saved={"epochs": 5, "lr": 0.01}, now={"epochs": 3, "lr": 0.01}, done=4)
>>> resumed.changed, resumed.complete
([('epochs', 5, 3)], True)
>>> change_words(resumed.changed)
'epochs 5 -> 3'
>>> schedule_position(saved_epochs=5, epochs=3, saved_position=0.8, steps_done=40, steps_per_epoch=10)
1.3333333333333333
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Resumed", "by_plan", "change_words", "changes", "describe", "fingerprint", "plain", "same_plan",
           "schedule_position"]

Change = Tuple[str, Any, Any]


def plain(value: Any) -> Any:
    """``value`` as a JSON value (numbers, strings, lists, dicts), or its ``repr`` (a plan compares
    what can be compared; an object it cannot read is not a plan value)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    item = getattr(value, "item", None)  # a NumPy / torch scalar
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError):
            pass
    return repr(value)


def fingerprint(values: Iterable[Any]) -> str:
    """A short hash of a sequence (e.g. a validation split's indices): equal sequences, equal hashes."""
    h = hashlib.sha256()
    for v in values:
        h.update(json.dumps(plain(v), sort_keys=True).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any],
            keys: Optional[Iterable[str]] = None) -> List[Change]:
    """``(key, saved value, value now)`` for every key both plans hold (or of ``keys``) whose value
    differs. A key only one side has is no change (an older checkpoint, an adapter that learnt more)."""
    if not saved:
        return []
    names = list(keys) if keys is not None else [k for k in now if k in saved]
    return [(k, saved[k], now[k]) for k in names
            if k in saved and k in now and plain(saved[k]) != plain(now[k])]


def describe(found: List[Change]) -> str:
    """``"epochs 5 -> 8, scheduler.T_max 5 -> 8"``."""
    return ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, a, b in found)


def _short(value: Any) -> str:
    text = json.dumps(plain(value)) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------- the plan from a position
Plan = Optional[Mapping[str, Any]]


def same_plan(saved: Plan, now: Plan, keys: Optional[Sequence[str]] = None) -> Optional[bool]:
    """Whether two plans are the same (over ``keys``, default the keys both hold); None when either
    is unknown (a checkpoint written before plans were recorded)."""
    if not saved or not now:
        return None
    return not changes(saved, now, keys)


def by_plan(plans: Mapping[int, Plan], at: Optional[int], now: Plan, keys: Optional[Sequence[str]] = None, *,
            unknown_is_same: bool = False) -> Optional[int]:
    """The recorded fit (a key of ``plans``, in their order) a fit call with the plan ``now`` is:
    ``at``, its place, when the plan recorded there is ``now``, else the first recorded fit whose
    plan is ``now``; None when none is (the caller decides: the place, or a new fit).

    ``unknown_is_same``: a place whose recorded plan is unknown is this fit (nothing says otherwise);
    without it the place must show the same plan, and a later fit with this plan is preferred."""
    if at is not None:
        same = same_plan(plans.get(at), now, keys)
        if same or (same is None and unknown_is_same):
            return at
    return next((j for j, planned in plans.items() if same_plan(planned, now, keys)), None)


def change_words(found: Sequence[Change], unreadable: Optional[Mapping[str, str]] = None) -> str:
    """Plan changes in words, ``"epochs 5 -> 3, lr 0.1 -> 0.3"``; a key of ``unreadable`` (a
    fingerprint, no value to read) is said with its words instead."""
    words = unreadable or {}
    return ", ".join(words[key] if key in words else describe([(key, was, now)]) for key, was, now in found)


@dataclass(frozen=True)
class Resumed:
    """A fit resumed from a saved position under the code's plan: ``saved`` is the plan the
    checkpoint recorded for it, ``now`` the code's, ``done`` the epochs the checkpoint had done.
    The code's plan wins: the fit goes on to the code's epochs, or ends here when they are done."""

    saved: Plan
    now: Mapping[str, Any]
    done: int
    keys: Optional[Sequence[str]] = None
    changed: List[Change] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "changed", changes(self.saved, self.now, self.keys))

    @property
    def epochs(self) -> int:
        """The epochs the code asks of the fit."""
        return int(self.now.get("epochs") or 0)

    @property
    def complete(self) -> bool:
        """Nothing is left to train: the checkpoint had done the code's epochs already."""
        return self.done >= self.epochs

    @property
    def fewer_epochs(self) -> bool:
        """The code asks fewer epochs than the checkpoint's plan did."""
        saved = (self.saved or {}).get("epochs")
        return saved is not None and self.epochs < int(saved)


def schedule_position(*, saved_epochs: int, epochs: int, saved_position: float, steps_done: int,
                      steps_per_epoch: int) -> float:
    """Where a resumed fit stands in its hyper-parameter schedule (0 at its start, 1 at its end): as
    saved when the code asks the saved epochs, else the same work done placed on the code's epochs."""
    if saved_epochs == epochs:
        return float(saved_position)
    return int(steps_done) / (steps_per_epoch * epochs)

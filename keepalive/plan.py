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
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Iterable, List, Mapping, Optional, Tuple

__all__ = ["changes", "describe", "fingerprint", "plain"]

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

"""What the lazy-snapshot tests of every adapter share: a clone of the state at a step boundary, a
tensor-by-tensor comparison with a committed checkpoint, and a background copy held until the loop
has made the change a test forces into it (:data:`HOLD` names the next save's copy, :data:`RELEASE`
lets it run)."""
from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch

from keepalive.state import PendingCopy, from_files
from keepalive.store import CheckpointStore

#: the warning a tensor changed in place before its copy gives (once)
CHANGED = "changed in place before its snapshot was copied: copied synchronously from now on"

HOLD, RELEASE = threading.Event(), threading.Event()


def hold_next_copy() -> None:
    """The copy of the next save waits for :data:`RELEASE` (which an earlier save's settle may have
    left set)."""
    RELEASE.clear()
    HOLD.set()


@pytest.fixture
def held_copy(monkeypatch):
    """Patch :meth:`PendingCopy.run` so that the copy :func:`hold_next_copy` names waits for
    :data:`RELEASE`."""
    HOLD.clear()
    RELEASE.clear()
    original = PendingCopy.run

    def run(self: Any) -> None:
        if HOLD.is_set():
            HOLD.clear()
            assert RELEASE.wait(30), "the loop never made its change"
        original(self)

    monkeypatch.setattr(PendingCopy, "run", run)
    yield
    RELEASE.set()


def clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [clone(v) for v in tree]
    return tree


def differences(a: Any, b: Any, where: str = "", strict: bool = True) -> List[str]:
    """Where ``b`` differs from ``a`` (tensors compared bit for bit). ``strict=False``: only
    ``a``'s tensors are compared (a checkpoint may hold more than the clone)."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or (strict and set(a) != set(b)):
            return [where]
        return [d for k, v in a.items() for d in differences(v, b.get(k), f"{where}.{k}", strict)]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}.{i}", strict)]
    return [] if not strict or a == b else [where]


def checkpoints(run: str) -> Dict[int, Any]:
    """Every committed checkpoint's state tree, by step."""
    store = CheckpointStore(run)
    return {info.step: from_files(store.read_files(info), copy=True) for info in store.list()}


def overlapped(events: List[Any]) -> List[bool]:
    """For each lazy save: whether a backward ran between it and the settle of its copy."""
    out: List[bool] = []
    for i, (kind, _) in enumerate(events):
        if kind != "save":
            continue
        backward = False
        for later, _ in events[i + 1:]:
            if later == "backward":
                backward = True
            if later == "settle":
                break
        out.append(backward)
    return out

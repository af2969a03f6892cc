"""What the probe audit counts (tests/test_probe_audit.py): every call keepalive could make into the
user's data code, each with the state of every global generator at that moment.

:class:`Probe` notes each call of a dataset's ``__getitem__`` / ``__iter__`` / ``__len__`` and of a
collate function, with a digest of Python's, NumPy's and torch's global generators (and, per
framework, the training steps). Two trainings that make the same calls in the same order, each
seeing the same random state, are the same as far as the user's code can tell; a look keepalive
takes at a batch shows up as an extra call, a draw it makes as a changed digest of the next one.
Imported by the test and by its Keras child (one interpreter per Keras backend)."""
from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, List, Optional, Tuple

import numpy as np


def rng_digest() -> str:
    """The state of Python's, NumPy's and (when imported) torch's global generators, in 12 hex digits."""
    import sys

    h = hashlib.sha1(repr(random.getstate()).encode())
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    h.update(keys.tobytes() + repr((pos, has_gauss, cached)).encode())
    torch = sys.modules.get("torch")
    if torch is not None:
        h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()[:12]


class Probe:
    """The calls made into the user's data code, in order, each with :func:`rng_digest`."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, str]] = []

    def note(self, what: str) -> None:
        self.events.append((what, rng_digest()))

    def counts(self) -> dict:
        out: dict = {}
        for what, _ in self.events:
            out[what] = out.get(what, 0) + 1
        return out

    def collate(self, inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def collate(batch: Any) -> Any:
            self.note("collate")
            return inner(batch)
        return collate


def augment() -> float:
    """A draw from every global generator, as an augmenting ``__getitem__`` makes."""
    import sys

    noise = random.random() + float(np.random.rand())
    torch = sys.modules.get("torch")
    if torch is not None:
        noise += float(torch.rand(()))
    return 0.01 * noise


def first_difference(a: List[Tuple[str, str]], b: List[Tuple[str, str]]) -> Optional[str]:
    """Where two event lists part, in words (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i}: without keepalive {x}, with it {y} (before: {a[max(0, i - 3):i]})"
    if len(a) != len(b):
        i = min(len(a), len(b))
        return f"{len(a)} events without keepalive, {len(b)} with it; the first extra: {(a if len(a) > i else b)[i]}"
    return None

"""A session clock for tests whose deadline comes at the N-th step boundary.

The trigger asks ``remaining_fn`` at every boundary, and also while the loop pauses between steps
(keepalive/pauses.py: at each evaluation batch, and from the pause guard's thread when a step is
slow). A clock that counts calls as steps must count the boundaries' questions only: the others get
the "plenty of time" answer, as before the deadline.
"""
from __future__ import annotations

import sys
from typing import Callable


def _asked_during_a_pause() -> bool:
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "between_steps_due":
            return True
        frame = frame.f_back
    return False


def deadline_after(boundaries: int, plenty: float = 10_000.0, left: float = 1.0) -> Callable[[], float]:
    """``plenty`` seconds left until the ``boundaries``-th boundary asks, then ``left``."""
    asked = {"n": 0}

    def remaining() -> float:
        if _asked_during_a_pause():
            return plenty if asked["n"] < boundaries else left
        asked["n"] += 1
        return plenty if asked["n"] <= boundaries else left

    return remaining

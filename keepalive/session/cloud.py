"""A cloud VM's preemption notices (placeholder: the watcher replaces this module)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional


@dataclass(frozen=True)
class Notice:
    cloud: str
    kind: str
    stops_at: Optional[float]
    detail: str
    event_id: Optional[str] = None

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        if self.stops_at is None:
            return None
        return self.stops_at - (time.time() if now is None else now)


class NoticeWatcher:
    cloud = "none"

    def notice(self) -> Optional[Notice]:
        return None

    def subscribe(self, callback: Callable[[Notice], None]) -> None:
        pass

    def acknowledge(self, notice: Notice) -> None:
        pass

    def status(self) -> Dict[str, Any]:
        return {"cloud": None, "watched": False}

    def stop(self) -> None:
        pass


def detect() -> Optional[str]:
    return None


def watcher() -> Optional[NoticeWatcher]:
    return None


def status() -> Dict[str, Any]:
    return {"cloud": None, "watched": False}

"""How much host memory a save may take for its copy of the state: the memory budget.

A background save copies the state's tensors into a host buffer as large as the state, so the
training goes on while the copy is written (:class:`keepalive.state.HostSnapshot`). That copy doubles
the state's footprint in host memory; on a VM whose RAM the training already fills, it is what gets
the process OOM-killed at its first save, and again after every re-run. So before a buffer is
allocated, the save asks this module what it may use:

* the machine's available memory (``MemAvailable`` of ``/proc/meminfo``: free memory plus the page
  cache that can be dropped), and the container's limit where a cgroup sets one (v2
  ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``,
  each plus its reclaimable page cache, ``inactive_file``; the process's own cgroup of
  ``/proc/self/cgroup``, else the mount's root), whichever is smaller;
* minus a margin (:func:`margin_for`: a tenth of the memory the process may use, at least
  :data:`MARGIN_MIN`), for what the training allocates next (a batch, an evaluation, the kernel);
* unless ``memory_budget=`` (or ``KEEPALIVE_MEMORY_BUDGET``) says how much, which overrides it.

A buffer the save already holds counts as room: it is reused. A state that does not fit is
streamed (:mod:`keepalive.hoststream`): the training waits for the write, and no full copy is made.

>>> b = MemoryBudget("1GiB")
>>> b.fits(512 << 20), b.fits(2 << 30)
(True, False)
>>> margin_for(16 << 30) // (1 << 20)
1638
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Optional, Union

from . import settings
from .units import format_bytes, parse_bytes

__all__ = ["MARGIN_MIN", "PIECE_MIN", "PIECE_MAX", "Room", "MemoryBudget", "margin_for", "room", "parse_budget"]

#: the margin is never less than this (a batch, an evaluation pass, the notebook's own memory)
MARGIN_MIN = 512 << 20
#: the margin as a fraction of the memory the process may use (the VM's, or its container's limit)
MARGIN_FRACTION = 0.10
#: the bounded buffer of a streamed save: a quarter of the budget, within these bounds
PIECE_MIN = 64 << 20
PIECE_MAX = 256 << 20


@dataclass(frozen=True)
class Room:
    """The memory this process may still take, as the machine and its container say."""

    #: bytes available now (None: unknown, e.g. not Linux)
    available: Optional[int]
    #: the memory the process may use in all (the VM's RAM, or the container's limit when smaller)
    total: Optional[int]
    #: which limit is the tighter one, in words
    source: str

    @property
    def margin(self) -> int:
        return margin_for(self.total)

    @property
    def for_copies(self) -> Optional[int]:
        """What a host copy may take: the available memory minus the margin (None: unknown)."""
        if self.available is None:
            return None
        return max(0, self.available - self.margin)


def margin_for(total: Optional[int]) -> int:
    """The memory left untouched by a save's copy: a tenth of ``total``, at least :data:`MARGIN_MIN`."""
    return max(MARGIN_MIN, int((total or 0) * MARGIN_FRACTION))


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _meminfo(proc: str) -> Dict[str, int]:
    out = {}
    for line in (_read(os.path.join(proc, "meminfo")) or "").splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024
    return out


def _number(path: str) -> Optional[int]:
    """A cgroup file's number; None for ``max``, a missing file or a limit so large it is none."""
    text = (_read(path) or "").strip()
    if not text.isdigit():
        return None
    value = int(text)
    return value if value < (1 << 60) else None


def _stat(path: str, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _own_groups(proc: str) -> Dict[str, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``: ``""`` -> the v2 path, ``"memory"`` ->
    the v1 memory controller's (a container sees ``/``; a systemd slice a deeper one)."""
    groups: Dict[str, str] = {}
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                groups.setdefault(controller, parts[2].strip())
    return groups


def _cgroup(root: str, proc: str) -> Optional[Room]:
    """The container's limit and what it leaves (v2, else v1), or None where no limit is set: the
    process's own cgroup's files, else those at the root of the mount."""
    groups = _own_groups(proc)
    for path in dict.fromkeys((groups.get("", "/"), "/")):
        folder = os.path.join(root, path.lstrip("/"))
        limit = _number(os.path.join(folder, "memory.max"))
        if limit is not None:
            used = _number(os.path.join(folder, "memory.current")) or 0
            cache = _stat(os.path.join(folder, "memory.stat"), "inactive_file")
            return Room(max(0, limit - used + cache), limit,
                        f"the container's limit of {format_bytes(limit)} (cgroup v2)")
    for path in dict.fromkeys((groups.get("memory", "/"), "/")):
        folder = os.path.join(root, "memory", path.lstrip("/"))
        limit = _number(os.path.join(folder, "memory.limit_in_bytes"))
        if limit is not None:
            used = _number(os.path.join(folder, "memory.usage_in_bytes")) or 0
            cache = _stat(os.path.join(folder, "memory.stat"), "total_inactive_file")
            return Room(max(0, limit - used + cache), limit,
                        f"the container's limit of {format_bytes(limit)} (cgroup v1)")
    return None


def room(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> Room:
    """The memory this process may still take: the machine's available memory, or what the
    container's limit leaves when that is less. (The folders are parameters for tests.)"""
    info = _meminfo(proc)
    available, total = info.get("MemAvailable"), info.get("MemTotal")
    source = "the machine's available memory"
    container = _cgroup(cgroup, proc)
    if container is not None and container.total is not None and container.available is not None:
        total = container.total if total is None else min(total, container.total)
        if available is None or container.available < available:
            available, source = container.available, container.source
    return Room(available, total, source)


def parse_budget(value: Union[str, int, None]) -> Optional[int]:
    """``memory_budget=``'s bytes (None: not given); a value that is no size raises ``ValueError``."""
    if value is None:
        return None
    try:
        n = parse_bytes(value)
    except ValueError:
        raise ValueError(f"memory_budget={value!r} is not a size (use e.g. '2GiB' or a number of bytes)") from None
    if n < 0:
        raise ValueError(f"memory_budget={value!r} cannot be negative")
    return n


class MemoryBudget:
    """What a save may use for its host copy of the state: ``memory_budget=``, else
    ``KEEPALIVE_MEMORY_BUDGET``, else the room the machine and its container leave (:func:`room`),
    read again at each decision (the training's own memory changes)."""

    def __init__(self, override: Union[str, int, None] = None, *, room_fn=room):
        self.override = parse_budget(override)
        self._room_fn = room_fn

    def limit(self, held: int = 0) -> Optional[int]:
        """The bytes a host copy may take, counting ``held`` (a buffer the save holds already and
        would reuse or give back first); None where nothing is known (no limit then)."""
        if self.override is not None:
            return self.override
        env = settings.get("KEEPALIVE_MEMORY_BUDGET")
        if env is not None:
            return int(env)
        free = self._room_fn().for_copies
        return None if free is None else free + held

    def fits(self, size: int, held: int = 0) -> bool:
        """Whether a full host copy of ``size`` bytes fits (``held``: bytes of a buffer already held)."""
        limit = self.limit(held)
        return limit is None or size <= limit

    def source(self) -> str:
        """Where :meth:`limit` comes from, in words (said with the figures of a streamed save)."""
        if self.override is not None:
            return "set by memory_budget="
        if settings.get("KEEPALIVE_MEMORY_BUDGET") is not None:
            return "set by KEEPALIVE_MEMORY_BUDGET"
        here = self._room_fn()
        return f"{here.source} minus a margin of {format_bytes(here.margin)}"

    @staticmethod
    def piece_bytes(limit: Optional[int]) -> int:
        """The size of a streamed save's bounded buffer: a quarter of the budget, between
        :data:`PIECE_MIN` and :data:`PIECE_MAX` but never above a budget smaller than that (at least
        1 MiB), a whole number of pages (for ``O_DIRECT``)."""
        limit = PIECE_MAX * 4 if limit is None else limit
        piece = min(PIECE_MAX, max(PIECE_MIN, limit // 4), max(limit, 1 << 20))
        return piece - piece % 4096

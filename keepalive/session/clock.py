"""When did the session start: the VM's, the kernel's or this process's start, read from ``/proc``.

A platform's budget runs on one of these clocks (``SessionInfo.clock``):

* ``vm`` (Colab, Paperspace): the budget runs from the machine's start, so kernel restarts do not
  reset it. Read as the start time of PID 1 (``/proc/1/stat``): inside a container that is the
  container's start (the runtime being handed to the user), on a bare VM it is the boot. Falls back
  to the boot time (``time.time() - /proc/uptime``). PID 1 is preferred over the boot time because a
  pooled, pre-booted VM would otherwise look older than the runtime the user was given.
* ``kernel`` (Kaggle, Jupyter, Databricks): the budget restarts with the kernel. Read as the start
  of the current process when it is the kernel, else of the nearest ancestor process that is an
  IPython kernel (so ``!keepalive status`` in a cell reports the kernel's clock).
* ``process``: no kernel found: the start of this process (``/proc/self/stat``), else the time
  keepalive.session was imported.
* ``override``: ``KEEPALIVE_SESSION_START`` or ``configure(start=...)`` (parsed by
  :func:`parse_start`).

>>> parse_start("2025-01-31T09:00:00+01:00") == parse_start("2025-01-31T08:00:00Z")
True
>>> iso_time(0)
'1970-01-01T00:00:00Z'
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import time
from typing import Any, List, Optional, Tuple, Union

__all__ = ["CLOCKS", "CLOCK_MEANING", "parse_start", "iso_time", "read_clock", "clock_starts",
           "read_text", "boot_time", "process_start", "ancestor_kernel"]

CLOCKS = ("vm", "kernel", "process", "override")

#: what each clock counts from, in the words ``keepalive status`` uses
CLOCK_MEANING = {
    "vm": "the VM's (machine's) start: restarting the kernel does not give time back",
    "kernel": "this kernel's start: a kernel restart starts the budget again",
    "process": "this process's start",
    "override": "the time given by KEEPALIVE_SESSION_START / configure(start=...)",
}

_IMPORT_TIME = time.time()  # the last resort of the ``process`` clock (no /proc)


# ------------------------------------------------------------------------------------ /proc reads
def read_text(path: str) -> Optional[str]:
    """The text of a small file (``/proc``, ``/sys``), None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def boot_time() -> Optional[float]:
    """Wall-clock time of the kernel's boot: ``time.time() - /proc/uptime``, else ``btime``."""
    text = read_text("/proc/uptime")
    if text:
        try:
            return time.time() - float(text.split()[0])
        except (ValueError, IndexError):
            pass
    text = read_text("/proc/stat")
    if text:
        m = re.search(r"^btime\s+(\d+)", text, re.M)
        if m:
            return float(m.group(1))
    return None


def _stat_fields(pid: Union[int, str]) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` after the ``(comm)``: index 0 is the state, 1 the ppid, 19 the
    start time in clock ticks since boot."""
    text = read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def process_start(pid: Union[int, str] = "self", boot: Optional[float] = None) -> Optional[float]:
    """Wall-clock start time of process ``pid`` (``/proc/PID/stat``), None without ``/proc``."""
    fields = _stat_fields(pid)
    if not fields or len(fields) < 20:
        return None
    try:
        ticks = int(fields[19])
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    except (ValueError, OSError):
        return None
    boot = boot_time() if boot is None else boot
    if boot is None:
        return None
    return boot + ticks / float(hz or 100)


_KERNEL_CMD = re.compile(r"ipykernel|colab_kernel_launcher|ipykernel_launcher|xpython|spark_kernel")


def ancestor_kernel(max_depth: int = 12) -> Optional[int]:
    """PID of the nearest ancestor process that is an IPython kernel (``!cmd`` in a cell), if any:
    a subprocess started from a cell reports the kernel's clock, not its own."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid is None or pid <= 1:
            return None
        cmd = read_text(f"/proc/{pid}/cmdline")
        if cmd and _KERNEL_CMD.search(cmd.replace("\0", " ")):
            return pid
        fields = _stat_fields(pid)
        if not fields:
            return None
        try:
            pid = int(fields[1])
        except (ValueError, IndexError):
            return None
    return None


# --------------------------------------------------------------------------------------- times
def parse_start(value: Any) -> float:
    """A session start: unix seconds (number or numeric text), an ISO-8601 text (no offset = UTC),
    or a ``datetime``. Raises ``ValueError`` otherwise."""
    if isinstance(value, _dt.datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc)
        return dt.timestamp()
    if isinstance(value, bool):
        raise ValueError(f"not a session start: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        dt = _dt.datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"not a session start: {value!r} (use unix seconds or ISO-8601, "
                         "e.g. 2025-01-31T08:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return dt.timestamp()


def iso_time(t: Optional[float]) -> Optional[str]:
    """Unix seconds as ``YYYY-MM-DDTHH:MM:SSZ`` (UTC), None for None: how reports show times."""
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def read_clock(kind: str, in_kernel: bool, kernel_pid: Optional[int]) -> Tuple[str, float, str]:
    """(clock, start time, how it was read) for a profile's clock ``kind`` (``vm`` / ``kernel`` /
    ``process``), falling back to the next weaker clock where one cannot be read."""
    boot = boot_time()
    if kind == "vm":
        init = process_start(1, boot)
        if init is not None and boot is not None and init >= boot - 1:
            return "vm", init, "start of PID 1 (/proc/1/stat: the container's / VM's init)"
        if boot is not None:
            return "vm", boot, "boot time (time.time() - /proc/uptime)"
        kind = "process"
    if kind == "kernel" and kernel_pid is not None:
        started = process_start(kernel_pid, boot)
        if started is not None:
            who = "this kernel process" if in_kernel else f"the kernel process (pid {kernel_pid})"
            return "kernel", started, f"start of {who} (/proc/{kernel_pid}/stat)"
    started = process_start("self", boot)
    if started is not None:
        return "process", started, f"start of this process (/proc/{os.getpid()}/stat)"
    return "process", _IMPORT_TIME, "time keepalive.session was imported (no /proc)"


def clock_starts(in_kernel: bool, kernel_pid: Optional[int]) -> dict:
    """When each clock started (unix seconds, None where it cannot be read): ``{"vm": ...,
    "kernel": ..., "process": ...}``, so that ``keepalive status`` can show how far apart they are
    (on Colab the VM may have started hours before the kernel)."""
    out = {}
    for kind in ("vm", "kernel", "process"):
        clock, start, _ = read_clock(kind, in_kernel, kernel_pid)
        out[kind] = start if clock == kind else None
    return out

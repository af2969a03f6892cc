"""Durations and sizes, parsed and printed with their units.

Every number keepalive shows a user carries its unit, and binary (GiB) and decimal (GB) sizes are
never mixed: :func:`format_bytes` says which one it prints.
"""
from __future__ import annotations

import re
from typing import Optional, Union

_DURATION_UNITS = {
    "ms": 0.001,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_PART = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_duration(value: Union[str, int, float]) -> float:
    """Seconds in a duration such as ``"90s"``, ``"10min"``, ``"1h30m"``, ``"2.5h"`` or a number.

    A bare number is seconds. Raises ``ValueError`` naming the bad input otherwise.

    >>> parse_duration("1h30min")
    5400.0
    """
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {value!r}")
        return float(value)
    text = str(value).strip().lower()
    if not text:
        raise ValueError("empty duration")
    total, pos = 0.0, 0
    while pos < len(text):
        match = _PART.match(text, pos)
        if not match or match.end() == pos:
            raise ValueError(f"not a duration: {value!r} (use e.g. '90s', '10min', '1h', '1h30m')")
        number, unit = match.groups()
        if unit not in _DURATION_UNITS and unit != "":
            raise ValueError(f"unknown unit {unit!r} in duration {value!r} (s, min, h, d)")
        total += float(number) * _DURATION_UNITS.get(unit, 1.0)
        pos = match.end()
    return total


def format_duration(seconds: Optional[float]) -> str:
    """``3725`` -> ``"1 h 02 min"``; under a minute ``"42 s"``; ``None`` -> ``"n/a"``."""
    if seconds is None:
        return "n/a"
    sign = "-" if seconds < 0 else ""
    seconds = abs(float(seconds))
    if seconds < 60:
        return f"{sign}{seconds:.0f} s" if seconds >= 10 else f"{sign}{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{sign}{hours} h {minutes:02d} min"
    return f"{sign}{minutes} min {secs:02d} s"


def parse_bytes(value: Union[str, int, float]) -> int:
    """Bytes in a size such as ``"10GB"``, ``"5GiB"``, ``"500M"`` or a number.

    >>> parse_bytes("1.5GiB")
    1610612736
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(value), re.I)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. '10GB', '5GiB')")
    number, unit, binary = m.groups()
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def format_bytes(n: Optional[float], *, binary: bool = True) -> str:
    """Sizes with an explicit unit: binary ``GiB`` (default) or decimal ``GB``."""
    if n is None:
        return "n/a"
    base = 1024.0 if binary else 1000.0
    units = ["B", "KiB", "MiB", "GiB", "TiB"] if binary else ["B", "kB", "MB", "GB", "TB"]
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")

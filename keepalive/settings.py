"""Every ``KEEPALIVE_*`` environment variable, in one table: name, default, parser, meaning.

Code never reads ``os.environ`` for a ``KEEPALIVE_*`` variable itself; it asks this module:

>>> from keepalive import settings
>>> settings.get("KEEPALIVE_SPOOL_SLOW", env={"KEEPALIVE_SPOOL_SLOW": "30s"})
30.0
>>> settings.get("KEEPALIVE_SPOOL_SLOW", env={})
10.0
>>> settings.get("KEEPALIVE_RECORD_CELLS", env={"KEEPALIVE_RECORD_CELLS": "Cell"})
'cell'

The environment is parsed once per distinct set of ``KEEPALIVE_*`` values (a notebook that sets a
variable with ``%env`` between two cells is seen at the next read; nothing is re-parsed otherwise). A
value that does not parse is reported once, visibly, and the default is used instead: a typo never
stops a training. ``keepalive status --settings`` prints the table with the values in force.

That report goes through :func:`keepalive.report.warn`, which hands itself in with
:func:`report_with` when imported (report reads ``KEEPALIVE_VERBOSITY`` from this module, so this
module cannot import it).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from .units import parse_bytes, parse_duration

__all__ = ["Setting", "SETTINGS", "get", "is_set", "table", "snapshot", "report_with"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, default (already parsed), parser and meaning."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    kind: str = "str"  # how to write a value, shown in the table


# ------------------------------------------------------------------------------------- parsers
_TRUE = ("1", "true", "yes", "on", "always")
_FALSE = ("0", "false", "no", "off", "never")


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or value == "":
        return False
    raise ValueError(f"not a yes/no value: {text!r} (use 1 or 0)")


def _tristate(text: str) -> Optional[bool]:
    """True / False, or None for ``auto`` (or empty)."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    return _flag(value)


def _limit(text: str) -> Optional[float]:
    """A duration, or None for ``0`` / ``none`` / ``off`` (no limit)."""
    value = text.strip().lower()
    if value in ("0", "none", "off", "no", "unlimited", "inf"):
        return None
    return parse_duration(value)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"{text!r} is not one of {', '.join(allowed)}")
        return value

    return parse


def _spool_mode(text: str) -> str:
    value = text.strip().lower()
    if value in ("always", "on", "1", "true", "yes"):
        return "always"
    if value in ("never", "off", "0", "false", "no"):
        return "never"
    if value in ("", "auto"):
        return "auto"
    raise ValueError(f"{text!r} is not one of auto, always, never")


def _clock(text: str) -> Optional[str]:
    """A clock name, or None for ``auto`` (or empty): the platform's own."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    return _choice("vm", "kernel", "process")(value)


def _path(text: str) -> Optional[str]:
    value = text.strip()
    return os.path.expanduser(value) if value else None


def _text(text: str) -> Optional[str]:
    return text.strip() or None


def _lower(text: str) -> Optional[str]:
    return text.strip().lower() or None


def _positive_int(text: str) -> Optional[int]:
    value = int(text.strip())
    return value if value > 0 else None


def _cloud(text: str) -> Optional[str]:
    """A cloud's name, ``none`` (not a cloud VM), or None for ``auto`` (or empty): detected."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    value = {"gcp": "gce", "google": "gce", "ec2": "aws", "off": "none", "no": "none"}.get(value, value)
    return _choice("gce", "aws", "azure", "none")(value)


def _service_url(text: str) -> Optional[str]:
    """``http://host[:port]`` (no path: each provider's paths are kept), or None (empty)."""
    value = text.strip().rstrip("/")
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http://host[:port] URL")
    if parts.path or parts.query:
        raise ValueError(f"{text!r} has a path; give only http://host[:port] (the paths are each cloud's own)")
    _ = parts.port  # raises ValueError on a port that is not a number
    return value


def _bytes_or_none(text: str) -> Optional[int]:
    value = text.strip()
    return parse_bytes(value) if value else None


class Private:
    """A value that holds secrets (a notification URL's token): shown by its URLs' schemes only
    (``keepalive status --settings`` prints values); ``.text`` is the value itself."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        words = self.text.replace(",", " ").split()
        return " ".join(w.split("://", 1)[0] + "://..." for w in words if "://" in w) or "..."

    __str__ = __repr__


def _private(text: str) -> Optional[Private]:
    value = text.strip()
    return Private(value) if value else None


def _watch(text: str) -> Optional[float]:
    """A duration; None for ``auto`` (or empty): the caller's own default; 0.0 for ``off`` / ``0``."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "off", "no", "none", "never"):
        return 0.0
    return parse_duration(value)


# --------------------------------------------------------------------------------------- table
SETTINGS: Dict[str, Setting] = {s.name: s for s in [
    # where checkpoints go
    Setting("KEEPALIVE_DIR", None, _path, "default folder for runs when DriveCheckpoint() gets no "
            "path (else the mounted Drive's MyDrive/keepalive, /kaggle/working/keepalive on Kaggle, "
            "else ./keepalive-checkpoints)", "path or URL"),
    # the session's clock
    Setting("KEEPALIVE_PLATFORM", None, _lower, "force the detected platform (colab, kaggle, "
            "paperspace, databricks, jupyter, local)", "name"),
    Setting("KEEPALIVE_PROFILE", None, _lower, "pick a platform profile by name (e.g. colab-pro+)",
            "name"),
    Setting("KEEPALIVE_BUDGET", None, _text, "session time limit, e.g. 3h, 45min; 0 or none: no "
            "limit (overrides the platform profile)", "duration"),
    Setting("KEEPALIVE_IDLE", None, _text, "idle timeout, e.g. 90min; 0 or none: none", "duration"),
    Setting("KEEPALIVE_SESSION_START", None, _text, "when the session's clock started (unix seconds "
            "or ISO-8601); overrides the platform's clock", "time"),
    Setting("KEEPALIVE_CLOCK", None, _clock, "which start the session budget counts from: vm (the "
            "machine's start, Colab's rule), kernel (this kernel's start), process; default: the "
            "platform's", "vm|kernel|process"),
    # Kaggle: a run resumed from the previous version's output, the next version pushed
    Setting("KEEPALIVE_KAGGLE_WORKING", "/kaggle/working", lambda t: _path(t) or "/kaggle/working",
            "Kaggle's working folder (kept as a version's output); for tests and other layouts", "path"),
    Setting("KEEPALIVE_KAGGLE_INPUT", "/kaggle/input", lambda t: _path(t) or "/kaggle/input",
            "where Kaggle mounts a notebook's data sources, read only (a run with no checkpoint under "
            "the working folder resumes from its copy there)", "path"),
    Setting("KEEPALIVE_KAGGLE_CHAIN", None, _positive_int, "opt-in: before Kaggle's session limit, "
            "after the final save, push the next version of the notebook (at most this many versions "
            "in the chain); needs KEEPALIVE_KAGGLE_NOTEBOOK", "number"),
    Setting("KEEPALIVE_KAGGLE_NOTEBOOK", None, _text, "the notebook a chain pushes again, as "
            "owner/slug (its URL's last two parts)", "owner/slug"),
    # a cloud VM's preemption notices
    Setting("KEEPALIVE_CLOUD", None, _cloud, "which cloud's preemption / maintenance notices to watch: "
            "gce, aws, azure, none (watch nothing); default auto: detected from the DMI files, never "
            "by a network request", "gce|aws|azure|none|auto"),
    Setting("KEEPALIVE_METADATA_URL", None, _service_url, "replaces the scheme, host and port of the "
            "cloud's metadata service (default http://metadata.google.internal on GCE, "
            "http://169.254.169.254 on AWS and Azure); the paths and headers stay each cloud's own",
            "http://host:port"),
    Setting("KEEPALIVE_DMI_DIR", "/sys/class/dmi/id", lambda t: _path(t) or "/sys/class/dmi/id",
            "for tests: the folder of DMI files (sys_vendor, product_name, ...) the cloud is detected "
            "from", "path"),
    # storage faults
    Setting("KEEPALIVE_SPOOL", "/tmp/keepalive-spool", lambda t: _path(t) or "/tmp/keepalive-spool",
            "root folder of the local spool (checkpoints waiting for upload)", "path"),
    Setting("KEEPALIVE_SPOOL_MODE", "auto", _spool_mode, "auto: spool remote / Drive destinations and "
            "failing local ones; always; never", "auto|always|never"),
    Setting("KEEPALIVE_SPOOL_MAX", None, _bytes_or_none, "most bytes the spool may hold (default: "
            "half the free disk)", "size"),
    Setting("KEEPALIVE_SPOOL_SLOW", 10.0, parse_duration, "a direct local write slower than this "
            "switches the run to the spool", "duration"),
    Setting("KEEPALIVE_FLUSH_TIMEOUT", 120.0, parse_duration, "how long the end of training waits "
            "for uploads", "duration"),
    Setting("KEEPALIVE_HEARTBEAT", 60.0, parse_duration, "how often a training rewrites its session "
            "record in the run folder (its heartbeat: a run silent for 3 beats and 30 s is DIED)", "duration"),
    Setting("KEEPALIVE_MEMORY_BUDGET", None, _bytes_or_none, "host memory a save may use for its copy "
            "of the state (default: what the machine or its container has available, minus a margin); "
            "a larger state is streamed while the training waits", "size"),
    Setting("KEEPALIVE_DRIVE_FLUSH", False, _flag, "on Colab, call drive.flush_and_unmount() at the "
            "end of a run (it unmounts Drive)", "0|1"),
    # what the user sees
    Setting("KEEPALIVE_PROGRESS", None, _tristate, "progress bars for uploads and epochs: auto, 1, 0",
            "auto|1|0"),
    Setting("KEEPALIVE_PROGRESS_MIN_BYTES", 256 << 20, parse_bytes, "uploads smaller than this get no "
            "progress bar", "size"),
    Setting("KEEPALIVE_VERBOSITY", "normal", _choice("quiet", "normal", "debug"), "quiet: only "
            "warnings; normal: one line per resume / stop / problem; debug: also every save",
            "quiet|normal|debug"),
    Setting("KEEPALIVE_NOTIFY", None, _private, "where to send the run's events (started, resumed, "
            "stopped, crashed, stalled, finished): Apprise URLs separated by spaces or commas (ntfy://topic, "
            "discord://..., json://host/path); a checkpointer's notify= replaces it", "URLs"),
    Setting("KEEPALIVE_NOTIFY_STALL", None, _watch, "no training step for this long while the process "
            "lives is told as stalled (once per stall); auto: max(10 min, 20 x the median step time); "
            "off: not watched", "duration|auto|off"),
    Setting("KEEPALIVE_RECORD_CELLS", "all", _choice("all", "cell", "none", "0", "off", "no", "false"),
            "which notebook cells a run records for %resume_training: all (setup + training), cell "
            "(the training cell), none (cells may hold secrets)", "all|cell|none"),
    # benchmarks
    Setting("KEEPALIVE_BENCH_THREADS", None, _positive_int, "CPU threads for `keepalive bench run` "
            "(default: the framework's)", "int"),
]}


# ----------------------------------------------------------------------------- telling the user
def _print_warning(message: str) -> None:
    """The line :func:`keepalive.report.warn` prints and logs, for a value read before
    ``keepalive.report`` handed its ``warn`` in (``import keepalive`` imports it, so only a process
    that bypassed the package could get here)."""
    logging.getLogger("keepalive").warning(message)
    try:
        sys.stderr.write(f"keepalive: warning: {message}\n")
        sys.stderr.flush()
    except (ValueError, OSError):  # a closed stream: the log has it
        pass


_warn: Callable[[str], object] = _print_warning


def report_with(warn: Callable[[str], object]) -> None:
    """Tell the user about a value that does not parse through ``warn(message)`` (always shown, never
    silenced: the default is used instead of what they asked for). :mod:`keepalive.report` passes its
    :func:`~keepalive.report.warn` when it is imported."""
    global _warn
    _warn = warn


# ------------------------------------------------------------------------------------- reading
_LOCK = threading.Lock()
_CACHE: Dict[Tuple[Tuple[str, str], ...], Dict[str, Any]] = {}
_REPORTED: set = set()


def _relevant(env: Mapping[str, str]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("KEEPALIVE_")))


def snapshot(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Every setting's value in force (parsed once per distinct environment)."""
    env = os.environ if env is None else env
    key = _relevant(env)
    with _LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    values: Dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        raw = env.get(name)
        if raw is None:
            values[name] = setting.default
            continue
        try:
            values[name] = setting.parse(raw)
        except (ValueError, TypeError) as exc:
            values[name] = setting.default
            if (name, raw) not in _REPORTED:
                _REPORTED.add((name, raw))
                _warn(f"ignoring {name}={raw!r}: {exc}; using the default ({setting.default!r})")
    with _LOCK:
        if len(_CACHE) > 64:  # tests flip variables often; keep the cache small
            _CACHE.clear()
        _CACHE[key] = values
    return values


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` (a key of :data:`SETTINGS`) in ``env`` (default ``os.environ``)."""
    if name not in SETTINGS:
        raise KeyError(f"unknown setting {name!r}")
    return snapshot(env)[name]


def is_set(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``name`` is present (and non-empty) in the environment."""
    env = os.environ if env is None else env
    return bool((env.get(name) or "").strip())


def table(env: Optional[Mapping[str, str]] = None) -> List[Dict[str, Any]]:
    """One row per setting: ``name``, ``value`` in force, ``default``, ``set`` (from the
    environment), ``kind`` and ``doc`` (``keepalive status --settings``)."""
    env = os.environ if env is None else env
    values = snapshot(env)
    return [{"name": s.name, "value": values[s.name], "default": s.default, "set": is_set(s.name, env),
             "kind": s.kind, "doc": s.doc} for s in SETTINGS.values()]

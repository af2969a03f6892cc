"""Where are we, how long has the session run, how much is left, how long idle, on what hardware.

Everything a save trigger or ``keepalive status`` needs to know about the session:

* :func:`detect` -> :class:`SessionInfo`: the platform (``colab``, ``kaggle``, ``paperspace``,
  ``databricks``, ``jupyter``, ``local``), its session budget and idle timeout (from the
  :data:`PROFILES` table below, each figure with its source), the session start and the clock it
  runs on. Cached: the first call reads the environment and ``/proc``; later calls cost nothing.
* :func:`remaining_seconds`: the cheap per-step question of the save trigger.
* :class:`IdleTracker` / :func:`note_activity`: idle time in a notebook (``pre_run_cell`` /
  ``post_run_cell``), and a warning once per idle period when the platform's idle timeout nears.
* :func:`hardware`: GPU (NVML or ``nvidia-smi``), CPU, RAM (GiB *and* GB, labelled), disk,
  ``/dev/shm``.
* :func:`status_report` / :func:`format_status`: the ``keepalive status`` panel (JSON / text).

Overrides, strongest first: :func:`configure` arguments, then environment variables
``KEEPALIVE_PLATFORM`` (force a platform), ``KEEPALIVE_PROFILE`` (pick a named profile, e.g.
``colab-pro+``), ``KEEPALIVE_BUDGET`` / ``KEEPALIVE_IDLE`` (durations such as ``3h``, ``45min``;
``0`` or ``none`` = no limit), ``KEEPALIVE_SESSION_START`` (unix seconds or ISO-8601; a time
without an offset is UTC), then the profile.

Clocks (``SessionInfo.clock``):

* ``vm`` (Colab, Paperspace): the budget runs from the machine's start, so kernel restarts do not
  reset it. Read as the start time of PID 1 (``/proc/1/stat``): inside a container that is the
  container's start (the runtime being handed to the user), on a bare VM it is the boot. Falls back
  to the boot time (``time.time() - /proc/uptime``). PID 1 is preferred over the boot time because a
  pooled, pre-booted VM would otherwise look older than the runtime the user was given.
* ``kernel`` (Kaggle, Jupyter, Databricks): the budget restarts with the kernel. Read as the start
  of the current process when it is the kernel, else of the nearest ancestor process that is an
  IPython kernel (so ``!keepalive status`` in a cell reports the kernel's clock).
* ``process``: no kernel found: the start of this process (``/proc/self/stat``), else the time
  this module was imported.
* ``override``: ``KEEPALIVE_SESSION_START`` or ``configure(start=...)``.

Importing this module is cheap: it reads nothing and imports no framework, IPython or store.
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from .units import format_bytes, format_duration, parse_duration

log = logging.getLogger("keepalive.session")

_IMPORT_TIME = time.time()

PLATFORMS = ("colab", "kaggle", "paperspace", "databricks", "jupyter", "local")
CLOCKS = ("vm", "kernel", "process", "override")

GIB = 1 << 30
SHM_WARN_BYTES = 1 * GIB

_COLAB_FAQ = "https://research.google.com/colaboratory/faq.html"
_COLAB_SIGNUP = "https://colab.research.google.com/signup"
_KAGGLE_DOCS = "https://www.kaggle.com/docs/notebooks"
_KAGGLE_GPU_DOCS = "https://www.kaggle.com/docs/efficient-gpu-usage"


# ------------------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class PlatformProfile:
    """What one platform (or plan) allows, with where each figure comes from."""

    name: str                              # profile name; KEEPALIVE_PROFILE selects one by it
    platform: str                          # one of PLATFORMS
    budget_seconds: Optional[float]        # session lifetime; None = no limit
    budget_source: str
    idle_timeout_seconds: Optional[float]  # idle disconnect; None = none known
    idle_source: str
    clock: str                             # "vm" | "kernel" | "process": what the budget runs from
    clock_source: str
    persistent_dir: Optional[str] = None   # where files survive the session
    notes: str = ""


PROFILES: Tuple[PlatformProfile, ...] = (
    PlatformProfile(
        "colab", "colab",
        12 * 3600.0, f"free tier: VM lifetime 'can be as much as 12 hours' ({_COLAB_FAQ}); "
                     "not guaranteed, shorter when busy",
        90 * 60.0, "idle disconnect after ~90 min (community figure; the FAQ only says "
                   f"'recycled when idle for a while', {_COLAB_FAQ})",
        "vm", "the budget runs from the VM start; kernel restarts do not reset it",
        "/content/drive/MyDrive",
        "Pro+ cannot be detected from inside the VM: set KEEPALIVE_PROFILE=colab-pro+ or "
        "KEEPALIVE_BUDGET=24h"),
    PlatformProfile(
        "colab-pro+", "colab",
        24 * 3600.0, f"Pro+: up to 24 h with background execution ({_COLAB_SIGNUP})",
        90 * 60.0, "idle disconnect after ~90 min (community figure; background execution may "
                   "outlive it)",
        "vm", "the budget runs from the VM start; kernel restarts do not reset it",
        "/content/drive/MyDrive", "selected only by KEEPALIVE_PROFILE=colab-pro+ or configure(profile=...)"),
    PlatformProfile(
        "kaggle", "kaggle",
        12 * 3600.0, f"12 h per CPU/GPU session ({_KAGGLE_DOCS})",
        20 * 60.0, f"interactive sessions stop after 20 min idle ({_KAGGLE_DOCS}); "
                   f"{_KAGGLE_GPU_DOCS} says 60 min: the shorter figure is used",
        "kernel", "the budget restarts with the kernel",
        "/kaggle/working", "/kaggle/working (20 GB) is kept when the notebook is saved"),
    PlatformProfile(
        "kaggle-tpu", "kaggle",
        9 * 3600.0, f"9 h per TPU session ({_KAGGLE_DOCS})",
        20 * 60.0, f"interactive sessions stop after 20 min idle ({_KAGGLE_DOCS}); "
                   f"{_KAGGLE_GPU_DOCS} says 60 min: the shorter figure is used",
        "kernel", "the budget restarts with the kernel",
        "/kaggle/working"),
    PlatformProfile(
        "paperspace", "paperspace",
        None, "lifetime depends on the plan and the auto-shutdown chosen at "
              "start (not readable here): set KEEPALIVE_BUDGET",
        None, "no idle timeout known",
        "vm", "the notebook's auto-shutdown timer runs from the container start",
        "/storage"),
    PlatformProfile(
        "databricks", "databricks",
        None, "no session limit (cluster auto-termination is configured per cluster: "
              "set KEEPALIVE_BUDGET)",
        None, "no idle timeout known",
        "kernel", "elapsed time runs from the notebook's Python process",
        "/dbfs"),
    PlatformProfile(
        "jupyter", "jupyter",
        None, "a local/self-hosted kernel has no session limit",
        None, "no idle timeout (a server's cull_idle_timeout, if any, is not readable "
              "from the kernel: set KEEPALIVE_IDLE)",
        "kernel", "elapsed time runs from the kernel start"),
    PlatformProfile(
        "local", "local",
        None, "plain Python has no session limit",
        None, "no idle timeout",
        "process", "elapsed time runs from this process's start"),
)

_BY_NAME: Dict[str, PlatformProfile] = {p.name: p for p in PROFILES}


def get_profile(name: str) -> PlatformProfile:
    """The profile called ``name`` (see :data:`PROFILES`); ``KeyError`` listing the names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown keepalive profile {name!r}; known: {', '.join(_BY_NAME)}") from None


# ------------------------------------------------------------------------------------ /proc reads
def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _boot_time() -> Optional[float]:
    """Wall-clock time of the kernel's boot: ``time.time() - /proc/uptime``, else ``btime``."""
    text = _read_text("/proc/uptime")
    if text:
        try:
            return time.time() - float(text.split()[0])
        except (ValueError, IndexError):
            pass
    text = _read_text("/proc/stat")
    if text:
        m = re.search(r"^btime\s+(\d+)", text, re.M)
        if m:
            return float(m.group(1))
    return None


def _stat_fields(pid: Union[int, str]) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` after the ``(comm)``: index 0 is the state, 1 the ppid, 19 the
    start time in clock ticks since boot."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def _process_start(pid: Union[int, str] = "self", boot: Optional[float] = None) -> Optional[float]:
    fields = _stat_fields(pid)
    if not fields or len(fields) < 20:
        return None
    try:
        ticks = int(fields[19])
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    except (ValueError, OSError):
        return None
    boot = _boot_time() if boot is None else boot
    if boot is None:
        return None
    return boot + ticks / float(hz or 100)


_KERNEL_CMD = re.compile(r"ipykernel|colab_kernel_launcher|ipykernel_launcher|xpython|spark_kernel")


def _ancestor_kernel(max_depth: int = 12) -> Optional[int]:
    """PID of the nearest ancestor process that is an IPython kernel (``!cmd`` in a cell), if any."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid is None or pid <= 1:
            return None
        cmd = _read_text(f"/proc/{pid}/cmdline")
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


def _in_kernel() -> bool:
    """True inside an IPython kernel process (without importing anything)."""
    if "ipykernel" not in sys.modules:
        return False
    app_mod = sys.modules.get("ipykernel.kernelapp")
    try:
        return bool(app_mod and app_mod.IPKernelApp.initialized())
    except Exception:  # noqa: BLE001
        return False


def _ipython_shell_kind() -> Optional[str]:
    """Class name of a running IPython shell in this process, without importing IPython."""
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return None
    try:
        shell = ip_mod.get_ipython()
    except Exception:  # noqa: BLE001
        return None
    return type(shell).__name__ if shell is not None else None


# ---------------------------------------------------------------------------------- overrides
def _parse_limit(value: Any) -> Optional[float]:
    """A budget / idle figure: a duration; ``0``, ``none``, ``off`` = no limit (None)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("", "none", "off", "no", "never",
                                                            "unlimited", "inf", "0"):
        return None
    seconds = parse_duration(value)
    if seconds <= 0:
        return None
    return seconds


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


def _iso(t: Optional[float]) -> Optional[str]:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_OVERRIDES: Dict[str, Any] = {}


# ------------------------------------------------------------------------------------ the info
@dataclass
class SessionInfo:
    """What :func:`detect` found. Times are unix seconds; durations seconds."""

    platform: str
    profile: str
    budget_seconds: Optional[float]
    idle_timeout_seconds: Optional[float]
    budget_source: str
    idle_source: str
    start_time: float
    clock: str
    clock_source: str
    evidence: str = ""                    # what identified the platform
    frontend: Optional[str] = None        # colab, vscode, jupyter, ipykernel, ipython, ...
    run_type: Optional[str] = None        # Kaggle: Interactive / Batch
    accelerator: Optional[str] = None     # gpu / tpu / cpu where known
    in_kernel: bool = False               # this process is an IPython kernel
    kernel_pid: Optional[int] = None      # the kernel process the clock was read from
    warnings: List[str] = field(default_factory=list)

    def elapsed_seconds(self, now: Optional[float] = None) -> float:
        return (time.time() if now is None else now) - self.start_time

    def remaining_seconds(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds left of the budget (negative once past it); None without a budget."""
        if self.budget_seconds is None:
            return None
        return self.start_time + self.budget_seconds - (time.time() if now is None else now)

    @property
    def deadline(self) -> Optional[float]:
        return None if self.budget_seconds is None else self.start_time + self.budget_seconds

    def idle_seconds(self) -> float:
        """See :meth:`IdleTracker.idle_seconds` (the module's tracker)."""
        return _TRACKER.idle_seconds()

    def idle_margin_seconds(self) -> Optional[float]:
        if self.idle_timeout_seconds is None:
            return None
        return self.idle_timeout_seconds - self.idle_seconds()

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["session_start"] = _iso(self.start_time)
        out["deadline"] = _iso(self.deadline)
        return out


# ----------------------------------------------------------------------------------- detection
def _colab_module_present() -> bool:
    try:
        return importlib.util.find_spec("google.colab") is not None
    except Exception:  # noqa: BLE001 - no `google` package, or a broken one
        return False


def _accelerator(env: Mapping[str, str]) -> str:
    """``tpu`` where a TPU is attached (Cloud TPU VM variables / device; Kaggle's TPU notebooks are
    TPU VMs), ``gpu`` where an NVIDIA device or ``nvidia-smi`` is present, else ``cpu``."""
    if any(env.get(k) for k in ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG",
                                "KAGGLE_TPU")) or os.path.exists("/dev/accel0"):
        return "tpu"
    if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"):
        return "gpu"
    return "cpu"


def _frontend(env: Mapping[str, str], platform: str, kernel: bool) -> Optional[str]:
    if platform == "colab":
        return "colab"
    if platform == "kaggle":
        return "kaggle"
    if kernel:
        if env.get("VSCODE_PID"):
            return "vscode"
        if env.get("PYCHARM_HOSTED"):
            return "pycharm"
        if env.get("JPY_SESSION_NAME") or env.get("JPY_PARENT_PID") or env.get("JUPYTER_SERVER_ROOT"):
            return "jupyter"
        return "ipykernel"
    kind = _ipython_shell_kind()
    if kind:
        return "ipython"
    return "python"


def _detect(env: Mapping[str, str], overrides: Mapping[str, Any]) -> SessionInfo:
    warnings: List[str] = []
    in_kernel = _in_kernel()
    kernel_pid: Optional[int] = os.getpid() if in_kernel else None
    if kernel_pid is None:
        kernel_pid = _ancestor_kernel()

    # --- platform
    platform, evidence = None, ""
    forced_profile = overrides.get("profile", _UNSET)
    profile_src = "configure(profile=...)"
    if forced_profile is _UNSET or forced_profile is None:
        forced_profile, profile_src = env.get("KEEPALIVE_PROFILE") or None, "KEEPALIVE_PROFILE"
    prof: Optional[PlatformProfile] = None
    if forced_profile:
        if forced_profile in _BY_NAME:
            prof = _BY_NAME[forced_profile]
        else:
            warnings.append(f"{profile_src}={forced_profile!r} is not a known profile "
                            f"({', '.join(_BY_NAME)}); ignored")
    forced = overrides.get("platform", _UNSET)
    forced_src = "configure(platform=...)"
    if forced is _UNSET or forced is None:
        forced, forced_src = (env.get("KEEPALIVE_PLATFORM") or "").strip().lower() or None, "KEEPALIVE_PLATFORM"
    if forced:
        if forced in PLATFORMS:
            platform, evidence = forced, f"{forced_src}={forced}"
        else:
            warnings.append(f"{forced_src}={forced!r} is not one of {', '.join(PLATFORMS)}; ignored")
    if platform is None and prof is not None:
        platform, evidence = prof.platform, f"{profile_src}={prof.name}"
    if platform is None:
        # environment variables first (each set by the platform itself), then weaker evidence
        if env.get("COLAB_RELEASE_TAG"):
            platform, evidence = "colab", "COLAB_RELEASE_TAG"
        elif env.get("KAGGLE_KERNEL_RUN_TYPE"):
            platform, evidence = "kaggle", "KAGGLE_KERNEL_RUN_TYPE"
        elif env.get("PAPERSPACE_NOTEBOOK_REPO_ID"):
            platform, evidence = "paperspace", "PAPERSPACE_NOTEBOOK_REPO_ID"
        elif env.get("DATABRICKS_RUNTIME_VERSION"):
            platform, evidence = "databricks", "DATABRICKS_RUNTIME_VERSION"
        elif os.path.exists("/var/colab/hostname"):
            platform, evidence = "colab", "/var/colab/hostname"
        elif _colab_module_present():
            platform, evidence = "colab", "google.colab importable"
        elif in_kernel:
            platform, evidence = "jupyter", "running inside an IPython kernel"
        elif kernel_pid is not None:
            platform, evidence = "jupyter", f"started from an IPython kernel (pid {kernel_pid})"
        else:
            platform, evidence = "local", "no notebook platform found"

    run_type = env.get("KAGGLE_KERNEL_RUN_TYPE") or None
    accelerator = _accelerator(env) if platform in ("kaggle", "colab") else None

    # --- profile
    if prof is None or prof.platform != platform:
        if prof is not None:
            warnings.append(f"profile {prof.name!r} is for {prof.platform}, not {platform}; ignored")
        name = platform
        if platform == "kaggle" and accelerator == "tpu":
            name = "kaggle-tpu"
        prof = _BY_NAME[name]

    budget, budget_source = prof.budget_seconds, f"{prof.name} profile: {prof.budget_source}"
    idle, idle_source = prof.idle_timeout_seconds, f"{prof.name} profile: {prof.idle_source}"
    if platform == "kaggle" and run_type and run_type.lower() == "batch":
        idle, idle_source = None, ("kaggle profile: a Batch run (Save & Run All) has no browser "
                                   "session, so no idle timeout applies")

    def pick(key: str, env_name: str, current, source, parser):
        value = overrides.get(key, _UNSET)
        if value is not _UNSET:
            try:
                return parser(value), f"configure({key}={value!r})"
            except (ValueError, TypeError) as exc:
                warnings.append(f"configure({key}={value!r}) ignored: {exc}")
        raw = env.get(env_name)
        if raw is not None and raw.strip() != "":
            try:
                return parser(raw), f"{env_name}={raw.strip()}"
            except (ValueError, TypeError) as exc:
                warnings.append(f"{env_name}={raw!r} ignored: {exc}")
        return current, source

    budget, budget_source = pick("budget", "KEEPALIVE_BUDGET", budget, budget_source,
                                 _parse_limit)
    idle, idle_source = pick("idle", "KEEPALIVE_IDLE", idle, idle_source,
                             _parse_limit)

    # --- clock
    start, clock_source = pick("start", "KEEPALIVE_SESSION_START", None, "", parse_start)
    if start is not None:
        clock = "override"
    else:
        clock, start, clock_source = _read_clock(prof.clock, in_kernel, kernel_pid)

    return SessionInfo(
        platform=platform, profile=prof.name, budget_seconds=budget, idle_timeout_seconds=idle,
        budget_source=budget_source, idle_source=idle_source, start_time=start, clock=clock,
        clock_source=clock_source, evidence=evidence,
        frontend=_frontend(env, platform, in_kernel or kernel_pid is not None),
        run_type=run_type if platform == "kaggle" else None, accelerator=accelerator,
        in_kernel=in_kernel, kernel_pid=kernel_pid if clock == "kernel" else None,
        warnings=warnings)


def _read_clock(kind: str, in_kernel: bool, kernel_pid: Optional[int]) -> Tuple[str, float, str]:
    """(clock, start time, how it was read) for a profile's clock kind."""
    boot = _boot_time()
    if kind == "vm":
        init = _process_start(1, boot)
        if init is not None and boot is not None and init >= boot - 1:
            return "vm", init, "start of PID 1 (/proc/1/stat: the container's / VM's init)"
        if boot is not None:
            return "vm", boot, "boot time (time.time() - /proc/uptime)"
        kind = "process"
    if kind == "kernel" and kernel_pid is not None:
        started = _process_start(kernel_pid, boot)
        if started is not None:
            who = "this kernel process" if in_kernel else f"the kernel process (pid {kernel_pid})"
            return "kernel", started, f"start of {who} (/proc/{kernel_pid}/stat)"
    started = _process_start("self", boot)
    if started is not None:
        return "process", started, f"start of this process (/proc/{os.getpid()}/stat)"
    return "process", _IMPORT_TIME, "time keepalive.session was imported (no /proc)"


_INFO: Optional[SessionInfo] = None
_INFO_LOCK = threading.Lock()


def detect(refresh: bool = False) -> SessionInfo:
    """The session as found (cached). ``refresh=True`` re-reads the environment and ``/proc``."""
    global _INFO
    info = _INFO
    if info is not None and not refresh:
        return info
    with _INFO_LOCK:
        if _INFO is None or refresh:
            _INFO = _detect(os.environ, dict(_OVERRIDES))
            for w in _INFO.warnings:
                log.warning(w)
        return _INFO


def configure(*, budget: Any = _UNSET, idle: Any = _UNSET, start: Any = _UNSET,
              platform: Any = _UNSET, profile: Any = _UNSET, reset: bool = False) -> SessionInfo:
    """Set session facts from Python; they beat the environment variables and the profile.

    ``budget`` / ``idle``: a duration (``"3h"``, ``"45min"``, seconds) or ``None`` / ``0`` /
    ``"none"`` for no limit. ``start``: unix seconds, ISO-8601 text or a ``datetime``.
    ``platform``: one of :data:`PLATFORMS`; ``profile``: a :data:`PROFILES` name; ``None`` for these
    three drops the setting again. An argument left out keeps its earlier setting; ``reset=True``
    first clears every earlier setting. Returns the refreshed :class:`SessionInfo`.
    """
    if reset:
        _OVERRIDES.clear()
    for key, value in (("budget", budget), ("idle", idle), ("start", start), ("platform", platform),
                       ("profile", profile)):
        if value is _UNSET:
            continue
        if value is None and key in ("start", "platform", "profile"):
            _OVERRIDES.pop(key, None)      # back to the environment / detection
        else:
            _OVERRIDES[key] = value
    return detect(refresh=True)


def remaining_seconds() -> Optional[float]:
    """Seconds left of the session budget (None without one; negative once past). Cheap: after the
    first detection this is one subtraction."""
    info = _INFO if _INFO is not None else detect()
    if info.budget_seconds is None:
        return None
    return info.start_time + info.budget_seconds - time.time()


def elapsed_seconds() -> float:
    return time.time() - detect().start_time


# ------------------------------------------------------------------------------------- idleness
IdleCallback = Callable[[Dict[str, Any]], None]

#: Called (in the watching thread) with the warning event dict each time an idle warning fires;
#: the notebook widget subscribes here. Exceptions in a callback are logged and swallowed.
idle_warning_callbacks: List[IdleCallback] = []


class IdleTracker:
    """Idle time as a notebook platform sees it: no cell running since the last one ended.

    ``idle_seconds()`` is 0 while a cell runs (between ``pre_run_cell`` and ``post_run_cell``), and
    otherwise the time since the last cell ended or the last :meth:`note_activity` (a training step
    in a background thread counts as activity: keepalive cannot know whether the platform counts
    it). Before anything was recorded, and outside IPython, the process is taken to be running code:
    idle is 0 (a plain script is never idle while it runs; ``keepalive status`` in a subprocess
    therefore reports 0).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 callbacks: Optional[List[IdleCallback]] = None):
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._last_activity: Optional[float] = None
        self._shells: List[Any] = []
        self._warned_for: Optional[float] = None
        self.callbacks: List[IdleCallback] = idle_warning_callbacks if callbacks is None else callbacks
        self.warn_before: Optional[float] = None   # seconds of margin that trigger the warning
        self._watch: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- events
    def pre_run_cell(self, info: Any = None) -> None:
        with self._lock:
            self._running += 1
            self._last_activity = self._clock()

    def post_run_cell(self, result: Any = None) -> None:
        with self._lock:
            self._running = max(0, self._running - 1)
            self._last_activity = self._clock()

    def note_activity(self) -> None:
        """Something (a training step) is running now."""
        self._last_activity = self._clock()

    # -- state
    @property
    def busy(self) -> bool:
        return self._running > 0

    @property
    def registered(self) -> bool:
        return bool(self._shells)

    def idle_seconds(self, now: Optional[float] = None) -> float:
        if self._running > 0:
            return 0.0
        last = self._last_activity
        if last is None:
            return 0.0
        return max(0.0, (self._clock() if now is None else now) - last)

    # -- IPython
    def register(self, ipython: Any = None, watch: bool = True) -> "IdleTracker":
        """Hook ``pre_run_cell`` / ``post_run_cell`` of ``ipython`` (default: the running shell) and,
        with ``watch``, start the idle-warning thread when an idle timeout is known."""
        if ipython is None:
            ip_mod = sys.modules.get("IPython")
            ipython = ip_mod.get_ipython() if ip_mod is not None else None
            if ipython is None:
                raise RuntimeError("IdleTracker.register: no IPython shell is running")
        if any(s is ipython for s in self._shells):
            return self
        ipython.events.register("pre_run_cell", self.pre_run_cell)
        ipython.events.register("post_run_cell", self.post_run_cell)
        self._shells.append(ipython)
        self.note_activity()   # registering happens in a cell: that is activity
        if watch and detect().idle_timeout_seconds is not None:
            self.start_watch()
        return self

    def unregister(self, ipython: Any = None) -> None:
        shells = [s for s in self._shells if ipython is None or s is ipython]
        for shell in shells:
            for name, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
                try:
                    shell.events.unregister(name, fn)
                except ValueError:
                    pass
            self._shells = [s for s in self._shells if s is not shell]
        if not self._shells:
            self.stop_watch()

    # -- warning
    def warn_margin(self, timeout: float) -> float:
        """Idle margin (seconds left) under which the warning fires: ``warn_before`` when set, else
        5 min or a quarter of the timeout, whichever is smaller."""
        if self.warn_before is not None:
            return self.warn_before
        return min(300.0, 0.25 * timeout)

    def check_idle(self, now: Optional[float] = None, info: Optional[SessionInfo] = None
                   ) -> Optional[Dict[str, Any]]:
        """Warn (log + callbacks) once per idle period when the idle timeout is near. Returns the
        event dict when it fired, else None."""
        info = info or detect()
        timeout = info.idle_timeout_seconds
        if timeout is None or self._running > 0 or self._last_activity is None:
            return None
        period = self._last_activity
        idle = self.idle_seconds(now)
        margin = timeout - idle
        if margin > self.warn_margin(timeout) or self._warned_for == period:
            return None
        self._warned_for = period
        message = (f"idle for {format_duration(idle)}: the {info.platform} idle timeout of "
                   f"{format_duration(timeout)} may end this session in about "
                   f"{format_duration(max(0.0, margin))} ({info.idle_source}). Run a cell or "
                   "interact with the notebook to keep it; committed checkpoints are safe.")
        event = {"idle_seconds": idle, "idle_timeout_seconds": timeout, "margin_seconds": margin,
                 "platform": info.platform, "message": message}
        log.warning(message)
        for cb in list(self.callbacks):
            try:
                cb(event)
            except Exception:  # noqa: BLE001 - a widget must never break the watcher
                log.exception("idle warning callback %r failed", cb)
        return event

    def start_watch(self, interval: Optional[float] = None) -> None:
        """Check for the idle warning every ``interval`` seconds (default: a tenth of the warning
        margin, 1..30 s) in a daemon thread."""
        if self._watch is not None and self._watch.is_alive():
            return
        if interval is None:
            timeout = detect().idle_timeout_seconds or 300.0
            interval = min(30.0, max(1.0, self.warn_margin(timeout) / 10.0))
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.check_idle()
                except Exception:  # noqa: BLE001
                    log.debug("idle check failed", exc_info=True)

        self._watch = threading.Thread(target=loop, name="keepalive-idle-watch", daemon=True)
        self._watch.start()

    def stop_watch(self) -> None:
        self._stop.set()
        thread, self._watch = self._watch, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


_TRACKER = IdleTracker()


def tracker() -> IdleTracker:
    """The process's idle tracker (the one the magics register and :func:`note_activity` feeds)."""
    return _TRACKER


def note_activity() -> None:
    """Mark "a cell / training step is running now" (trainers call this each step)."""
    _TRACKER.note_activity()


def idle_seconds() -> float:
    return _TRACKER.idle_seconds()


def track_ipython(ipython: Any = None, watch: bool = True) -> IdleTracker:
    """Register the process's tracker with ``ipython`` (default: the running shell)."""
    return _TRACKER.register(ipython, watch=watch)


def check_idle_warning() -> Optional[Dict[str, Any]]:
    return _TRACKER.check_idle()


# ------------------------------------------------------------------------------------- hardware
def both_units(n: Optional[float]) -> str:
    """``"14.75 GiB (15.84 GB)"``: binary first, decimal in brackets, each labelled."""
    if n is None:
        return "n/a"
    return f"{format_bytes(n)} ({format_bytes(n, binary=False)})"


def _gpu_entry(index: int, name: str, total_b: Optional[float], used_b: Optional[float],
               util: Optional[float]) -> Dict[str, Any]:
    def mib(b):
        return None if b is None else round(b / (1 << 20), 1)

    def gib(b):
        return None if b is None else round(b / GIB, 2)

    return {
        "index": index, "name": name,
        "memory_total_bytes": total_b, "memory_used_bytes": used_b,
        "memory_total_mib": mib(total_b), "memory_used_mib": mib(used_b),
        "memory_total_gib": gib(total_b), "memory_used_gib": gib(used_b),
        "utilization_percent": util,
        "memory": f"{both_units(used_b)} used of {both_units(total_b)}",
    }


def _gpus_nvml() -> List[Dict[str, Any]]:
    import pynvml  # type: ignore

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                util = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:  # noqa: BLE001 - not supported on some devices (MIG)
                util = None
            out.append(_gpu_entry(i, name, float(mem.total), float(mem.used), util))
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _num(text: str) -> Optional[float]:
    try:
        return float(text.strip())
    except ValueError:
        return None   # "[N/A]", "[Not Supported]"


def _gpus_smi(exe: str, timeout: float = 5.0) -> List[Dict[str, Any]]:
    proc = subprocess.run(
        [exe, "--query-gpu=index,name,memory.total,memory.used,utilization.gpu",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nvidia-smi exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}")
    out = []
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        index, rest = line.split(",", 1)
        parts = rest.rsplit(",", 3)
        if len(parts) != 4:
            continue
        name, total, used, util = (p.strip() for p in parts)
        t, u = _num(total), _num(used)
        out.append(_gpu_entry(int(_num(index) or 0), name, None if t is None else t * (1 << 20),
                              None if u is None else u * (1 << 20), _num(util)))
    return out


def gpus() -> Tuple[List[Dict[str, Any]], str]:
    """(GPU list, where it came from: ``pynvml`` / ``nvidia-smi`` / ``none`` / an error text)."""
    errors = []
    if importlib.util.find_spec("pynvml") is not None:
        try:
            return _gpus_nvml(), "pynvml"
        except Exception as exc:  # noqa: BLE001 - no driver: try the next way
            errors.append(f"pynvml: {exc}")
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            return _gpus_smi(exe), "nvidia-smi"
        except Exception as exc:  # noqa: BLE001
            errors.append(f"nvidia-smi: {exc}")
    if not errors:
        return [], "none (no pynvml module, no nvidia-smi on PATH)"
    return [], "none (" + "; ".join(errors) + ")"


def _meminfo() -> Dict[str, int]:
    out = {}
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024
    return out


def _cgroup_int(*paths: str) -> Optional[int]:
    for p in paths:
        text = _read_text(p)
        if text is None:
            continue
        text = text.strip()
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return value if value < (1 << 60) else None
    return None


def _cpu_quota() -> Optional[float]:
    text = _read_text("/sys/fs/cgroup/cpu.max")
    if text:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                return int(parts[0]) / int(parts[1])
            except (ValueError, ZeroDivisionError):
                return None
        return None
    quota = _cgroup_int("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    period = _cgroup_int("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota and period and quota > 0:
        return quota / period
    return None


def _cpu_model() -> Optional[str]:
    text = _read_text("/proc/cpuinfo") or ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.M)
        if m:
            return m.group(1).strip()
    import platform as _platform

    return _platform.processor() or _platform.machine() or None


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _disk(path: str, what: str) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"what": what, "path": path, "free_bytes": None, "total_bytes": None}
    if _is_url(path):
        entry["note"] = "remote storage: free space not known"
        return entry
    probe = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        usage = shutil.disk_usage(probe)
    except OSError as exc:
        entry["note"] = f"not readable: {exc}"
        return entry
    entry.update(measured_at=probe, free_bytes=usage.free, total_bytes=usage.total,
                 free=both_units(usage.free), total=both_units(usage.total))
    return entry


def shm_warning(size_bytes: Optional[float], platform: Optional[str] = None) -> Optional[str]:
    """The /dev/shm advice when it is under 1 GiB (None otherwise)."""
    if size_bytes is None or size_bytes >= SHM_WARN_BYTES:
        return None
    text = (f"/dev/shm is only {both_units(size_bytes)}: PyTorch DataLoader workers pass batches "
            "through it, so num_workers>0 can die with 'bus error' / 'DataLoader worker ... killed'. "
            "Use DataLoader(num_workers=0) or smaller batches")
    if platform == "kaggle":
        text += " (Kaggle's Docker default /dev/shm is 64 MB)"
    else:
        text += ", or give the container more (docker run --shm-size=2g)"
    return text + "."


def vm_disk_path(platform: Optional[str] = None) -> str:
    """The path whose disk holds the session's scratch files: /content on Colab, /kaggle/working
    on Kaggle, else /."""
    platform = platform or detect().platform
    if platform == "colab" and os.path.isdir("/content"):
        return "/content"
    if platform == "kaggle" and os.path.isdir("/kaggle/working"):
        return "/kaggle/working"
    return "/"


def hardware(checkpoint_dir: Optional[str] = None) -> Dict[str, Any]:
    """GPU, CPU, RAM, disk and /dev/shm facts; sizes in bytes plus labelled GiB / GB text.

    Keys: ``gpus`` (list; each with ``name``, ``memory_total_mib`` / ``_gib``, ``memory_used_mib`` /
    ``_gib``, ``utilization_percent``), ``gpu_source``, ``gpu`` (summary text or ``"none"``),
    ``cpu_model``, ``cpu_count``, ``cpu_usable``, ``cpu_quota``, ``ram_total_bytes``,
    ``ram_available_bytes``, ``ram_total_gib`` / ``_gb``, ``ram_available_gib`` / ``_gb``,
    ``ram_total`` / ``ram_available`` (text), ``ram_cgroup_limit_bytes``, ``disks`` (list),
    ``shm_total_bytes``, ``shm_total``, ``warnings``.
    """
    platform = detect().platform
    warnings: List[str] = []
    gpu_list, gpu_source = gpus()
    hw: Dict[str, Any] = {"gpus": gpu_list, "gpu_source": gpu_source,
                          "gpu": "; ".join(f"{g['name']} ({g['memory']})" for g in gpu_list) or "none"}

    # CPU
    try:
        usable = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        usable = os.cpu_count()
    hw.update(cpu_model=_cpu_model(), cpu_count=os.cpu_count(), cpu_usable=usable, cpu_quota=_cpu_quota())

    # RAM
    mem = _meminfo()
    total, avail = mem.get("MemTotal"), mem.get("MemAvailable", mem.get("MemFree"))
    limit = _cgroup_int("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and total is not None and limit >= total:
        limit = None
    hw.update(
        ram_total_bytes=total, ram_available_bytes=avail,
        ram_total_gib=None if total is None else round(total / GIB, 2),
        ram_total_gb=None if total is None else round(total / 1e9, 2),
        ram_available_gib=None if avail is None else round(avail / GIB, 2),
        ram_available_gb=None if avail is None else round(avail / 1e9, 2),
        ram_total=both_units(total), ram_available=both_units(avail),
        ram_cgroup_limit_bytes=limit, ram_cgroup_limit=None if limit is None else both_units(limit))
    if total and avail is not None and avail < 0.1 * total:
        warnings.append(f"low RAM: {both_units(avail)} available of {both_units(total)}")

    # disks
    disks = []
    if checkpoint_dir:
        disks.append(_disk(checkpoint_dir, "checkpoint dir"))
    vm_path = vm_disk_path(platform)
    disks.append(_disk(vm_path, "VM disk"))
    hw["disks"] = disks
    for d in disks:
        if d.get("free_bytes") is not None and d["free_bytes"] < GIB:
            warnings.append(f"low disk: {d['free']} free for the {d['what']} ({d['path']})")

    # /dev/shm
    shm_total = shm_free = None
    if os.path.isdir("/dev/shm"):
        try:
            usage = shutil.disk_usage("/dev/shm")
            shm_total, shm_free = usage.total, usage.free
        except OSError:
            pass
    hw.update(shm_total_bytes=shm_total, shm_free_bytes=shm_free, shm_total=both_units(shm_total))
    w = shm_warning(shm_total, platform)
    if w:
        warnings.append(w)
    hw["warnings"] = warnings
    return hw


# ------------------------------------------------------------------------------- checkpoint dir
def default_checkpoint_dir() -> str:
    """``$KEEPALIVE_DIR``, else ``/content/drive/MyDrive/keepalive`` when Drive is mounted, else
    ``/kaggle/working/keepalive`` on Kaggle, else ``./keepalive-checkpoints`` (made absolute)."""
    env = os.environ.get("KEEPALIVE_DIR")
    if env:
        env = os.path.expanduser(env)
        return env if "://" in env else os.path.abspath(env)
    if os.path.isdir("/content/drive/MyDrive"):
        return "/content/drive/MyDrive/keepalive"
    if detect().platform == "kaggle":
        return "/kaggle/working/keepalive"
    return os.path.abspath("keepalive-checkpoints")


def _storage_warning(platform: str, checkpoint_dir: str) -> Optional[str]:
    if _is_url(checkpoint_dir):
        return None
    path = os.path.abspath(checkpoint_dir[7:] if checkpoint_dir.startswith("file://") else checkpoint_dir)
    if platform == "colab" and not path.startswith("/content/drive/"):
        return (f"checkpoint dir {path} is on the Colab VM's disk and is lost when the runtime is "
                "recycled: mount Drive (drive.mount('/content/drive')) or use a gs:// URL")
    if platform == "kaggle" and not (path == "/kaggle/working" or path.startswith("/kaggle/working/")):
        return (f"checkpoint dir {path} is outside /kaggle/working, the only folder Kaggle keeps "
                "when the session ends")
    return None


def _runs(checkpoint_dir: str, warnings: List[str]) -> List[Dict[str, Any]]:
    try:
        from .store import CheckpointStore, find_runs

        urls = find_runs(checkpoint_dir)
    except Exception as exc:  # noqa: BLE001 - status never crashes
        warnings.append(f"could not list runs under {checkpoint_dir}: {exc}")
        return []
    runs = []
    for url in urls:
        entry: Dict[str, Any] = {"run": url.rstrip("/").rsplit("/", 1)[-1], "url": url,
                                 "newest_step": None, "newest_epoch": None, "newest_created": None,
                                 "checkpoints": 0}
        try:
            store = CheckpointStore(url, keep=None)
            entry["run"] = store.run
            listed = store.list()
            good = [c for c in listed if c.error is None]
            entry["checkpoints"] = len(good)
            if len(listed) != len(good):
                entry["broken"] = len(listed) - len(good)
            if good:
                newest = good[-1]
                entry.update(newest_step=newest.step, newest_epoch=newest.epoch,
                             newest_created=_iso(newest.created), newest=newest.name)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = str(exc)
            warnings.append(f"could not read run {url}: {exc}")
        runs.append(entry)
    return runs


# --------------------------------------------------------------------------------------- report
def status_report(checkpoint_dir: Optional[str] = None) -> Dict[str, Any]:
    """Everything ``keepalive status --json`` prints (JSON-safe)."""
    info = detect()
    now = time.time()
    warnings: List[str] = list(info.warnings)
    if checkpoint_dir is None:
        try:
            checkpoint_dir = default_checkpoint_dir()
        except Exception as exc:  # noqa: BLE001
            warnings.append(f"no default checkpoint dir: {exc}")
            checkpoint_dir = os.path.abspath("keepalive-checkpoints")
    remaining = info.remaining_seconds(now)
    idle = info.idle_seconds()
    if remaining is not None:
        if remaining <= 0:
            warnings.append(f"the session budget ({format_duration(info.budget_seconds)}) is used up "
                            f"by {format_duration(-remaining)}: the runtime may stop at any moment")
        elif remaining < 30 * 60:
            warnings.append(f"only {format_duration(remaining)} of the session budget left")
    if info.idle_timeout_seconds is not None:
        margin = info.idle_timeout_seconds - idle
        if idle > 0 and margin < _TRACKER.warn_margin(info.idle_timeout_seconds):
            warnings.append(f"idle for {format_duration(idle)} of a {format_duration(info.idle_timeout_seconds)} "
                            "idle timeout")
    w = _storage_warning(info.platform, checkpoint_dir)
    if w:
        warnings.append(w)
    try:
        hw = hardware(checkpoint_dir)
    except Exception as exc:  # noqa: BLE001
        hw = {"error": str(exc), "warnings": []}
    warnings.extend(hw.get("warnings", []))
    runs = _runs(checkpoint_dir, warnings)
    from ._version import __version__

    return {
        "platform": info.platform,
        "profile": info.profile,
        "evidence": info.evidence,
        "frontend": info.frontend,
        "run_type": info.run_type,
        "accelerator": info.accelerator,
        "time": _iso(now),
        "time_unix": now,
        "budget_seconds": info.budget_seconds,
        "elapsed_seconds": info.elapsed_seconds(now),
        "remaining_seconds": remaining,
        "budget_source": info.budget_source,
        "deadline": _iso(info.deadline),
        "idle_timeout_seconds": info.idle_timeout_seconds,
        "idle_seconds": idle,
        "idle_source": info.idle_source,
        "clock": info.clock,
        "clock_source": info.clock_source,
        "session_start": _iso(info.start_time),
        "session_start_unix": info.start_time,
        "hardware": hw,
        "checkpoint_dir": checkpoint_dir,
        "runs": runs,
        "pending_uploads": _pending_uploads(),
        "warnings": warnings,
        "keepalive_version": __version__,
    }


def _pending_uploads() -> Optional[Dict[str, Any]]:
    """Checkpoints waiting in the local spool for upload (keepalive/spool.py), None when none do."""
    try:
        from .spool import pending_summary

        return pending_summary()
    except Exception as exc:  # noqa: BLE001 - a status report never fails for it
        return {"error": str(exc)}


def _bar(fraction: float, width: int = 30) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(round(fraction * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def format_status(report: Mapping[str, Any]) -> str:
    """The human panel: every figure with its unit; sizes as ``GiB (GB)``."""
    r = report
    lines = []
    head = f"keepalive status: platform {r.get('platform')}"
    extras = [x for x in (f"profile {r.get('profile')}" if r.get("profile") else None,
                          r.get("run_type") and f"run type {r['run_type']}",
                          r.get("accelerator") and f"accelerator {r['accelerator']}",
                          r.get("frontend") and f"front end {r['frontend']}") if x]
    if extras:
        head += " (" + ", ".join(extras) + ")"
    lines.append(head)

    budget, remaining, elapsed = r.get("budget_seconds"), r.get("remaining_seconds"), r.get("elapsed_seconds")
    lines.append(f"  session   started {r.get('session_start')} (clock: {r.get('clock')}), "
                 f"elapsed {format_duration(elapsed)}")
    if budget is None:
        lines.append("  budget    none (no session limit known)")
    else:
        frac = (remaining or 0.0) / budget if budget else 0.0
        left = (f"{format_duration(remaining)} left" if remaining is not None and remaining >= 0
                else f"over by {format_duration(-(remaining or 0.0))}")
        lines.append(f"  budget    {format_duration(budget)}: {left}, ends {r.get('deadline')}")
        lines.append(f"            {_bar(frac)} {max(0.0, frac) * 100:.0f} % of the session left")
    lines.append(f"            budget from {r.get('budget_source')}")

    idle_to, idle = r.get("idle_timeout_seconds"), r.get("idle_seconds")
    if idle_to is None:
        lines.append(f"  idle      {format_duration(idle)} idle; no idle timeout")
    else:
        lines.append(f"  idle      {format_duration(idle)} idle of a {format_duration(idle_to)} timeout "
                     f"(margin {format_duration(idle_to - (idle or 0.0))})")
    if r.get("idle_source"):
        lines.append(f"            idle timeout from {r.get('idle_source')}")

    hw = r.get("hardware") or {}
    gl = hw.get("gpus") or []
    if gl:
        for g in gl:
            util = g.get("utilization_percent")
            lines.append(f"  GPU {g.get('index')}     {g.get('name')}: {g.get('memory')}, utilisation "
                         f"{'n/a' if util is None else f'{util:.0f} %'}")
    else:
        lines.append(f"  GPU       {hw.get('gpu_source') or 'none (not checked)'}")
    if hw.get("cpu_count") is not None:
        quota = hw.get("cpu_quota")
        lines.append(f"  CPU       {hw.get('cpu_model') or 'unknown model'}: {hw.get('cpu_count')} cores, "
                     f"{hw.get('cpu_usable')} usable"
                     + (f", cgroup quota {quota:.1f} cores" if quota else ""))
    if hw.get("ram_total_bytes") is not None:
        lines.append(f"  RAM       {hw.get('ram_available')} available of {hw.get('ram_total')}"
                     + (f"; container limit {hw['ram_cgroup_limit']}" if hw.get("ram_cgroup_limit") else ""))
    for d in hw.get("disks") or []:
        if d.get("free_bytes") is not None:
            lines.append(f"  disk      {d['what']} {d['path']}: {d['free']} free of {d['total']}")
        else:
            lines.append(f"  disk      {d['what']} {d['path']}: {d.get('note', 'n/a')}")
    if hw.get("shm_total_bytes") is not None:
        lines.append(f"  /dev/shm  {hw.get('shm_total')}")

    lines.append(f"  checkpoints in {r.get('checkpoint_dir')}:")
    runs = r.get("runs") or []
    if not runs:
        lines.append("            no runs yet")
    for run in runs:
        if run.get("error"):
            lines.append(f"            {run['run']}: unreadable ({run['error']})")
        elif run.get("checkpoints"):
            lines.append(f"            {run['run']}: {run['checkpoints']} checkpoint(s), newest step "
                         f"{run.get('newest_step')} epoch {run.get('newest_epoch')} "
                         f"({run.get('newest_created') or 'time unknown'})")
        else:
            lines.append(f"            {run['run']}: no committed checkpoint")
    pending = r.get("pending_uploads")
    if pending is not None:
        from .spool import format_pending

        lines.append(f"  uploads   {format_pending(pending)}")
    for w in r.get("warnings") or []:
        lines.append(f"  WARNING   {w}")
    return "\n".join(lines)


__all__ = [
    "PLATFORMS", "CLOCKS", "PROFILES", "PlatformProfile", "get_profile", "SessionInfo", "detect",
    "configure", "remaining_seconds", "elapsed_seconds", "idle_seconds", "note_activity",
    "IdleTracker", "tracker", "track_ipython", "check_idle_warning", "idle_warning_callbacks",
    "hardware", "gpus", "shm_warning", "both_units", "vm_disk_path", "default_checkpoint_dir",
    "status_report", "format_status", "parse_start",
]

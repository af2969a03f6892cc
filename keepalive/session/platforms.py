"""Which platform runs this session, what it allows, and when the session started.

:func:`detect` returns a :class:`SessionInfo`: the platform (one of :data:`PLATFORMS`), its session
budget and idle timeout (from the :data:`PROFILES` table below, each figure with its source), the
session start and the clock it runs on (:mod:`keepalive.session.clock`). Cached: the first call reads
the environment and ``/proc``; later calls cost nothing, so :func:`remaining_seconds` is cheap enough
for every training step.

Overrides, strongest first: :func:`configure` arguments, then the settings ``KEEPALIVE_PLATFORM``
(force a platform), ``KEEPALIVE_PROFILE`` (pick a named profile, e.g. ``colab-pro+``),
``KEEPALIVE_BUDGET`` / ``KEEPALIVE_IDLE`` (durations such as ``3h``, ``45min``; ``0`` or ``none`` =
no limit), ``KEEPALIVE_CLOCK`` (which start the budget counts from: ``vm``, ``kernel``, ``process``;
on Colab the budget runs from the VM's start, which may be hours before this kernel's),
``KEEPALIVE_SESSION_START`` (unix seconds or ISO-8601; a time without an offset is UTC), then the
profile. A value that makes no sense is reported (``SessionInfo.warnings``, shown once) and
ignored: a typo never stops a training.

>>> get_profile("kaggle").budget_seconds / 3600
12.0
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import report, settings
from ..backends import fuse_mount_of
from ..units import format_duration, parse_duration
from .clock import ancestor_kernel, iso_time, parse_start, read_clock
from .frontend import frontend_name, in_kernel

__all__ = ["PLATFORMS", "PROFILES", "PlatformProfile", "get_profile", "SPOT_VM_MTBF_SECONDS",
           "SPOT_VM_MTBF_SOURCE", "SessionInfo", "detect",
           "configure", "remaining_seconds", "elapsed_seconds", "default_checkpoint_dir", "budget_used_up",
           "storage_warning", "vm_disk_path", "run_index_dir"]

PLATFORMS = ("colab", "kaggle", "paperspace", "databricks", "jupyter", "local")

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
    #: the expected time between unplanned interruptions (a crash, a disconnect, a recycled VM: not
    #: the budget's end, which the deadline trigger saves before); every="auto" saves more often where
    #: it is shorter (Young/Daly, keepalive.autointerval). Not published by any platform: an estimate
    #: on the pessimistic side, since too short a figure costs at most the 1 % budget, too long a one
    #: loses more work per interruption
    mtbf_seconds: float = 24 * 3600.0
    mtbf_source: str = "estimate: a machine of one's own runs for days; a day is assumed"


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
        "KEEPALIVE_BUDGET=24h",
        3 * 3600.0, "estimate: free runtimes are recycled before their lifetime 'when busy' and tabs "
                    f"disconnect ({_COLAB_FAQ}); no rate is published, a few hours is assumed"),
    PlatformProfile(
        "colab-pro+", "colab",
        24 * 3600.0, f"Pro+: up to 24 h with background execution ({_COLAB_SIGNUP})",
        90 * 60.0, "idle disconnect after ~90 min (community figure; background execution may "
                   "outlive it)",
        "vm", "the budget runs from the VM start; kernel restarts do not reset it",
        "/content/drive/MyDrive", "selected only by KEEPALIVE_PROFILE=colab-pro+ or configure(profile=...)",
        12 * 3600.0, "estimate: paid runtimes are not recycled for load like free ones; no rate is "
                     "published, half the 24 h lifetime is assumed"),
    PlatformProfile(
        "kaggle", "kaggle",
        12 * 3600.0, f"12 h per CPU/GPU session ({_KAGGLE_DOCS})",
        20 * 60.0, f"interactive sessions stop after 20 min idle ({_KAGGLE_DOCS}); "
                   f"{_KAGGLE_GPU_DOCS} says 60 min: the shorter figure is used",
        "kernel", "the budget restarts with the kernel",
        "/kaggle/working", "/kaggle/working (20 GB) is kept when the notebook is saved",
        6 * 3600.0, "estimate: a session is rarely cut before its 12 h, but a kernel dies of "
                    "memory or a lost connection; no rate is published, half the lifetime is assumed"),
    PlatformProfile(
        "kaggle-tpu", "kaggle",
        9 * 3600.0, f"9 h per TPU session ({_KAGGLE_DOCS})",
        20 * 60.0, f"interactive sessions stop after 20 min idle ({_KAGGLE_DOCS}); "
                   f"{_KAGGLE_GPU_DOCS} says 60 min: the shorter figure is used",
        "kernel", "the budget restarts with the kernel",
        "/kaggle/working", "",
        4.5 * 3600.0, "estimate: no rate is published, half the 9 h TPU lifetime is assumed"),
    PlatformProfile(
        "paperspace", "paperspace",
        None, "lifetime depends on the plan and the auto-shutdown chosen at "
              "start (not readable here): set KEEPALIVE_BUDGET",
        None, "no idle timeout known",
        "vm", "the notebook's auto-shutdown timer runs from the container start",
        "/storage", "",
        6 * 3600.0, "estimate: no interruption rate is published; a quarter day is assumed"),
    PlatformProfile(
        "databricks", "databricks",
        None, "no session limit (cluster auto-termination is configured per cluster: "
              "set KEEPALIVE_BUDGET)",
        None, "no idle timeout known",
        "kernel", "elapsed time runs from the notebook's Python process",
        "/dbfs", "",
        12 * 3600.0, "estimate: clusters restart for updates and auto-termination; no rate is "
                     "published, half a day is assumed"),
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

#: the expected time between interruptions on a cloud VM (keepalive.session.cloud.detect) that may
#: be a Spot / preemptible one; every="auto" uses it where it is shorter than the profile's
SPOT_VM_MTBF_SECONDS = 2 * 3600.0
SPOT_VM_MTBF_SOURCE = (
    "estimate: a Spot VM is reclaimed whenever the provider needs the capacity back (GCE preemptible "
    "VMs also stop after 24 h at the latest: https://cloud.google.com/compute/docs/instances/preemptible); "
    "the published rates are averages over a region's fleet per month (AWS' Spot Instance Advisor, "
    "'frequency of interruption'), while GPU capacity in demand is reclaimed within hours: 2 h is "
    "assumed. The preemption notice saves at once besides; this figure covers the notice that comes "
    "too late or not at all")


def get_profile(name: str) -> PlatformProfile:
    """The profile called ``name`` (see :data:`PROFILES`); ``KeyError`` listing the names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown keepalive profile {name!r}; known: {', '.join(_BY_NAME)}") from None


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


def _parse_clock(value: Any) -> str:
    """A clock name for ``KEEPALIVE_CLOCK`` / ``configure(clock=...)``: vm, kernel or process."""
    text = str(value).strip().lower()
    if text not in ("vm", "kernel", "process"):
        raise ValueError(f"{value!r} is not one of vm, kernel, process")
    return text


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_OVERRIDES: Dict[str, Any] = {}  # configure()'s settings, stronger than the environment


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
    clock: str                            # vm | kernel | process | override: what the budget runs from
    clock_source: str                     # how the clock's start was read
    clock_reason: str = ""                # why this clock (the profile's rule, or KEEPALIVE_CLOCK)
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

    def idle_margin_seconds(self, idle_seconds: float) -> Optional[float]:
        """Seconds left before the idle timeout after ``idle_seconds`` without activity (the process's
        tracker measures them: :func:`keepalive.session.idle_seconds`); None without a timeout."""
        if self.idle_timeout_seconds is None:
            return None
        return self.idle_timeout_seconds - idle_seconds

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["session_start"] = iso_time(self.start_time)
        out["deadline"] = iso_time(self.deadline)
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


def _platform_from_environment(env: Mapping[str, str], kernel: bool, kernel_pid: Optional[int]
                               ) -> Tuple[str, str]:
    """(platform, evidence): variables each platform sets itself first, then weaker evidence."""
    if env.get("COLAB_RELEASE_TAG"):
        return "colab", "COLAB_RELEASE_TAG"
    if env.get("KAGGLE_KERNEL_RUN_TYPE"):
        return "kaggle", "KAGGLE_KERNEL_RUN_TYPE"
    if env.get("PAPERSPACE_NOTEBOOK_REPO_ID"):
        return "paperspace", "PAPERSPACE_NOTEBOOK_REPO_ID"
    if env.get("DATABRICKS_RUNTIME_VERSION"):
        return "databricks", "DATABRICKS_RUNTIME_VERSION"
    if os.path.exists("/var/colab/hostname"):
        return "colab", "/var/colab/hostname"
    if _colab_module_present():
        return "colab", "google.colab importable"
    if kernel:
        return "jupyter", "running inside an IPython kernel"
    if kernel_pid is not None:
        return "jupyter", f"started from an IPython kernel (pid {kernel_pid})"
    return "local", "no notebook platform found"


class _Choices:
    """What the user asked for (:func:`configure`, then the settings), and the warnings about what
    made no sense (reported once, then ignored: a typo never stops a training)."""

    def __init__(self, env: Mapping[str, str], overrides: Mapping[str, Any]):
        self.env = env
        self.overrides = overrides
        self.warnings: List[str] = []

    def forced(self, key: str, setting: str) -> Tuple[Any, str]:
        """``configure(key=...)`` when given, else the setting: the value and where it came from."""
        value = self.overrides.get(key, _UNSET)
        if value is _UNSET or value is None:
            return settings.get(setting, env=self.env), setting
        return value, f"configure({key}=...)"

    def pick(self, key: str, setting: str, current: Any, source: str, parser: Any) -> Tuple[Any, str]:
        """configure(key=...) first, then the setting, else ``current``; a bad value is a warning."""
        value = self.overrides.get(key, _UNSET)
        if value is not _UNSET:
            try:
                return parser(value), f"configure({key}={value!r})"
            except (ValueError, TypeError) as exc:
                self.warnings.append(f"configure({key}={value!r}) ignored: {exc}")
        raw = settings.get(setting, env=self.env)  # stripped text, None when unset or empty
        if raw is not None:
            try:
                return parser(raw), f"{setting}={raw}"
            except (ValueError, TypeError) as exc:
                self.warnings.append(f"{setting}={raw!r} ignored: {exc}")
        return current, source


def _platform(choices: _Choices, kernel: bool, kernel_pid: Optional[int]
              ) -> Tuple[str, str, Optional[PlatformProfile]]:
    """The platform, the evidence for it, and the profile asked for (None: none, or an unknown one)."""
    prof: Optional[PlatformProfile] = None
    wanted, profile_src = choices.forced("profile", "KEEPALIVE_PROFILE")
    if wanted:
        if wanted in _BY_NAME:
            prof = _BY_NAME[wanted]
        else:
            choices.warnings.append(f"{profile_src}={wanted!r} is not a known profile "
                                    f"({', '.join(_BY_NAME)}); ignored")
    forced, forced_src = choices.forced("platform", "KEEPALIVE_PLATFORM")
    if forced:
        if forced in PLATFORMS:
            return forced, f"{forced_src}={forced}", prof
        choices.warnings.append(f"{forced_src}={forced!r} is not one of {', '.join(PLATFORMS)}; ignored")
    if prof is not None:
        return prof.platform, f"{profile_src}={prof.name}", prof
    platform, evidence = _platform_from_environment(choices.env, kernel, kernel_pid)
    return platform, evidence, prof


def _profile(choices: _Choices, asked: Optional[PlatformProfile], platform: str,
             accelerator: Optional[str]) -> PlatformProfile:
    """The profile asked for when it is this platform's, else the platform's own."""
    if asked is not None and asked.platform == platform:
        return asked
    if asked is not None:
        choices.warnings.append(f"profile {asked.name!r} is for {asked.platform}, not {platform}; ignored")
    name = platform
    if platform == "kaggle" and accelerator == "tpu":
        name = "kaggle-tpu"
    return _BY_NAME[name]


def _limits(choices: _Choices, prof: PlatformProfile, platform: str, run_type: Optional[str]
            ) -> Tuple[Optional[float], str, Optional[float], str]:
    """The session budget and the idle timeout, each with its source."""
    budget, budget_source = prof.budget_seconds, f"{prof.name} profile: {prof.budget_source}"
    idle, idle_source = prof.idle_timeout_seconds, f"{prof.name} profile: {prof.idle_source}"
    if platform == "kaggle" and run_type and run_type.lower() == "batch":
        idle, idle_source = None, ("kaggle profile: a Batch run (Save & Run All) has no browser "
                                   "session, so no idle timeout applies")
    budget, budget_source = choices.pick("budget", "KEEPALIVE_BUDGET", budget, budget_source, _parse_limit)
    idle, idle_source = choices.pick("idle", "KEEPALIVE_IDLE", idle, idle_source, _parse_limit)
    return budget, budget_source, idle, idle_source


def _clock(choices: _Choices, prof: PlatformProfile, kernel: bool, kernel_pid: Optional[int]
           ) -> Tuple[str, float, str, str]:
    """Which start the budget counts from (the profile's, unless a clock or a start is given):
    ``(clock, start, where the start comes from, why this clock)``."""
    wanted, clock_reason = choices.pick("clock", "KEEPALIVE_CLOCK", prof.clock,
                                        f"{prof.name} profile: {prof.clock_source}", _parse_clock)
    if wanted != prof.clock and not clock_reason.startswith(prof.name):
        clock_reason += f" (the {prof.name} profile's budget runs on the {prof.clock} clock)"
    start, clock_source = choices.pick("start", "KEEPALIVE_SESSION_START", None, "", parse_start)
    if start is None:
        clock, start, clock_source = read_clock(wanted, kernel, kernel_pid)
        if clock != wanted:
            clock_reason += f"; the {wanted} clock cannot be read here, so the {clock} clock is used"
        return clock, start, clock_source, clock_reason
    clock_reason = f"the session start is given ({clock_source})"
    now = time.time()
    if start > now + FUTURE_START_TOLERANCE:
        # a start in the future makes every elapsed time negative and the budget larger than
        # it is; the usual cause is a local time read as UTC
        choices.warnings.append(f"{clock_source} is {format_duration(start - now)} in the future "
                                f"({iso_time(start)}); the session is counted from now ({iso_time(now)}) "
                                "instead. Give unix seconds, or ISO-8601 with its offset (a time without "
                                "one is UTC), e.g. 2025-01-31T08:00:00+02:00")
        start, clock_source = now, f"{clock_source}, in the future: now instead"
    return "override", start, clock_source, clock_reason


def _detect(env: Mapping[str, str], overrides: Mapping[str, Any]) -> SessionInfo:
    """The session as ``env`` (the environment) and ``overrides`` (:func:`configure`) describe it."""
    choices = _Choices(env, overrides)
    kernel = in_kernel()
    kernel_pid: Optional[int] = os.getpid() if kernel else ancestor_kernel()
    platform, evidence, asked = _platform(choices, kernel, kernel_pid)
    run_type = env.get("KAGGLE_KERNEL_RUN_TYPE") or None
    accelerator = _accelerator(env) if platform in ("kaggle", "colab") else None
    prof = _profile(choices, asked, platform, accelerator)
    budget, budget_source, idle, idle_source = _limits(choices, prof, platform, run_type)
    clock, start, clock_source, clock_reason = _clock(choices, prof, kernel, kernel_pid)
    return SessionInfo(
        platform=platform, profile=prof.name, budget_seconds=budget, idle_timeout_seconds=idle,
        budget_source=budget_source, idle_source=idle_source, start_time=start, clock=clock,
        clock_source=clock_source, clock_reason=clock_reason, evidence=evidence,
        frontend=frontend_name(env, platform, kernel or kernel_pid is not None),
        run_type=run_type if platform == "kaggle" else None, accelerator=accelerator,
        in_kernel=kernel, kernel_pid=kernel_pid if clock == "kernel" else None,
        warnings=choices.warnings)


#: seconds a given session start may lie ahead of this machine's clock (clock skew) unremarked
FUTURE_START_TOLERANCE = 60.0


def budget_used_up(info: Optional[SessionInfo] = None, now: Optional[float] = None) -> Optional[str]:
    """A line saying that the session budget is already used up, from which clock it counts and
    how to change that (None while some of it is left, or without a budget). On Colab the budget
    counts from the VM's start: a ``KEEPALIVE_BUDGET=2min`` set in a notebook whose VM started 34
    minutes earlier is used up before the first cell trains, and a training then saves and stops
    at its first chance."""
    info = info or detect()
    now = time.time() if now is None else now
    remaining = info.remaining_seconds(now)
    if remaining is None or remaining > 0:
        return None
    budget = format_duration(info.budget_seconds)
    elapsed = format_duration(info.elapsed_seconds(now))
    if info.clock == "override":
        start = f"the given session start ({info.clock_source}), {elapsed} ago"
        change = " (or a later KEEPALIVE_SESSION_START)"
    else:
        start = (f"the start of the {info.clock} clock, {elapsed} ago ({iso_time(info.start_time)}; "
                 f"{info.clock_source})")
        change = " (or KEEPALIVE_CLOCK=kernel to count from this kernel's start)" if info.clock == "vm" else ""
    return (f"the session budget of {budget} ({info.budget_source}) is already used up: it counts from "
            f"{start}. A training saves and stops at its first chance; to train, set a larger "
            f"KEEPALIVE_BUDGET{change}.")


_INFO: Optional[SessionInfo] = None
_INFO_LOCK = threading.Lock()


def detect(refresh: bool = False) -> SessionInfo:
    """The session as found (cached). ``refresh=True`` re-reads the environment and ``/proc``.
    Each problem found (a bad override) is shown once."""
    global _INFO
    info = _INFO
    if info is not None and not refresh:
        return info
    with _INFO_LOCK:
        if _INFO is None or refresh:
            _INFO = _detect(os.environ, dict(_OVERRIDES))
            for w in _INFO.warnings:
                report.warn(w, key=f"session: {w}")
        return _INFO


def configure(*, budget: Any = _UNSET, idle: Any = _UNSET, start: Any = _UNSET,
              platform: Any = _UNSET, profile: Any = _UNSET, clock: Any = _UNSET,
              reset: bool = False) -> SessionInfo:
    """Set session facts from Python; they beat the environment variables and the profile.

    ``budget`` / ``idle``: a duration (``"3h"``, ``"45min"``, seconds) or ``None`` / ``0`` /
    ``"none"`` for no limit. ``start``: unix seconds, ISO-8601 text or a ``datetime``.
    ``platform``: one of :data:`PLATFORMS`; ``profile``: a :data:`PROFILES` name; ``clock``: ``vm``,
    ``kernel`` or ``process`` (which start the budget counts from; default: the profile's);
    ``None`` for these four drops the setting again. An argument left out keeps its earlier setting; ``reset=True``
    first clears every earlier setting. Returns the refreshed :class:`SessionInfo`.
    """
    if reset:
        _OVERRIDES.clear()
    for key, value in (("budget", budget), ("idle", idle), ("start", start), ("platform", platform),
                       ("profile", profile), ("clock", clock)):
        if value is _UNSET:
            continue
        if value is None and key in ("start", "platform", "profile", "clock"):
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
    """Seconds since the session's clock started."""
    return time.time() - detect().start_time


# ------------------------------------------------------------------------------- where files live
def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


#: where a mounted Google Drive's own folder is: Colab's mount point today, and the one older tutorials
#: use (``drive.mount('/content/gdrive')``; before 2020 the folder was "My Drive")
MY_DRIVE_FOLDERS = ("/content/drive/MyDrive", "/content/gdrive/MyDrive", "/content/gdrive/My Drive")


def default_checkpoint_dir() -> str:
    """``KEEPALIVE_DIR``, else ``keepalive`` in the mounted Drive's own folder (``/content/drive/MyDrive``,
    or where an older tutorial mounted it: :data:`MY_DRIVE_FOLDERS`), else ``/kaggle/working/keepalive``
    on Kaggle, else ``./keepalive-checkpoints`` (made absolute)."""
    configured = settings.get("KEEPALIVE_DIR")
    if configured:
        return configured if "://" in configured else os.path.abspath(configured)
    for folder in MY_DRIVE_FOLDERS:
        if os.path.isdir(folder):
            return f"{folder}/keepalive"
    if detect().platform == "kaggle":
        return "/kaggle/working/keepalive"
    return os.path.abspath("keepalive-checkpoints")


def run_index_dir() -> Optional[str]:
    """Where the index of runs lives (``RUNS.json``, :func:`keepalive.runs.record_run`): the default
    checkpoint dir, which outlives a VM reset where one does (Drive on Colab, /kaggle/working). It
    is created for the index when it was chosen (``KEEPALIVE_DIR``), is Drive's or Kaggle's, or this
    is a notebook; a plain script with no ``./keepalive-checkpoints`` gets no index (None) rather
    than a new folder in its working directory."""
    root = default_checkpoint_dir()
    if _is_url(root) or settings.is_set("KEEPALIVE_DIR") or os.path.isdir(root):
        return root
    if root.startswith(("/content/drive/", "/content/gdrive/", "/kaggle/working/")) or detect().platform != "local":
        return root
    return None


def storage_warning(platform: str, checkpoint_dir: str) -> Optional[str]:
    """The advice when ``checkpoint_dir`` does not outlive a ``platform`` session (Colab's VM disk,
    outside Kaggle's /kaggle/working), None when it does or cannot be judged (a URL). A FUSE mount
    (Drive mounted at /content/gdrive as old tutorials do, rclone, gcsfuse) outlives the VM."""
    if _is_url(checkpoint_dir):
        return None
    path = os.path.abspath(checkpoint_dir[7:] if checkpoint_dir.startswith("file://") else checkpoint_dir)
    if platform == "colab" and not path.startswith("/content/drive/") and fuse_mount_of(path) is None:
        return (f"checkpoint dir {path} is on the Colab VM's disk and is lost when the runtime is "
                "recycled: mount Drive (drive.mount('/content/drive')) or use a gs:// URL")
    if platform == "kaggle" and not (path == "/kaggle/working" or path.startswith("/kaggle/working/")):
        return (f"checkpoint dir {path} is outside /kaggle/working, the only folder Kaggle keeps "
                "when the session ends")
    return None


def vm_disk_path(platform: Optional[str] = None) -> str:
    """The path whose disk holds the session's scratch files: /content on Colab, /kaggle/working
    on Kaggle, else /."""
    platform = platform or detect().platform
    if platform == "colab" and os.path.isdir("/content"):
        return "/content"
    if platform == "kaggle" and os.path.isdir("/kaggle/working"):
        return "/kaggle/working"
    return "/"

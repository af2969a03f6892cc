"""Where are we, how long has the session run, how much is left, how long idle, on what hardware.

Everything a save trigger or a status report needs to know about the session, one concept per
module (each importable alone; this package re-exports the public names):

* :mod:`~keepalive.session.platforms` — :func:`detect` -> :class:`SessionInfo`: the platform
  (``colab``, ``kaggle``, ``paperspace``, ``databricks``, ``jupyter``, ``local``), its session budget
  and idle timeout (the :data:`PROFILES` table, each figure with its source), overrides
  (:func:`configure`, ``KEEPALIVE_*`` settings), :func:`remaining_seconds` (the cheap per-step
  question of the save trigger), :func:`default_checkpoint_dir`.
* :mod:`~keepalive.session.clock` — when the session started: the VM's, the kernel's or this
  process's start (``/proc``), or an override (:func:`parse_start`).
* :mod:`~keepalive.session.idle` — :class:`IdleTracker` / :func:`note_activity`: idle time in a
  notebook, and a warning once per idle period when the platform's idle timeout nears.
* :mod:`~keepalive.session.hardware` — :func:`hardware`: GPU (NVML or ``nvidia-smi``), CPU, RAM
  (GiB *and* GB, labelled), disk, ``/dev/shm``.
* :mod:`~keepalive.session.cloud` — :func:`cloud.watcher` / :class:`cloud.NoticeWatcher`: a cloud
  VM's preemption and maintenance notices (GCE, AWS, Azure), detected from the DMI files and watched
  in a daemon thread; :func:`cloud.status` for ``keepalive status``.
* :mod:`~keepalive.session.frontend` — :func:`in_notebook` / :func:`ipython_shell` /
  :func:`in_kernel`: the one place that asks whether we run in a notebook, never importing IPython.

The ``keepalive status`` report, which adds the runs and the spool to these facts, lives above
storage in :mod:`keepalive.status`. Importing this package is cheap: it reads nothing and imports no
framework, IPython or store.
"""
from __future__ import annotations

from . import cloud
from .clock import CLOCKS, iso_time, parse_start
from .frontend import in_kernel, in_notebook, ipython_shell, is_notebook_shell
from .hardware import GIB, SHM_WARN_BYTES, both_units, gpus, hardware, shm_warning
from .hardware import _gpu_entry as _gpu_entry  # one GPU's report entry (tests build reports with it)
from .idle import (
    IdleCallback,
    IdleTracker,
    check_idle_warning,
    idle_seconds,
    idle_warning_callbacks,
    note_activity,
    track_ipython,
    tracker,
)
from .platforms import (
    PLATFORMS,
    PROFILES,
    PlatformProfile,
    SessionInfo,
    budget_used_up,
    configure,
    default_checkpoint_dir,
    detect,
    elapsed_seconds,
    get_profile,
    remaining_seconds,
    storage_warning,
    vm_disk_path,
)

_storage_warning = storage_warning  # the name the magics look up

__all__ = [
    "PLATFORMS", "CLOCKS", "PROFILES", "PlatformProfile", "get_profile", "SessionInfo", "detect",
    "configure", "budget_used_up", "remaining_seconds", "elapsed_seconds", "idle_seconds", "note_activity",
    "IdleTracker", "IdleCallback", "tracker", "track_ipython", "check_idle_warning",
    "idle_warning_callbacks", "hardware", "gpus", "shm_warning", "both_units", "GIB", "SHM_WARN_BYTES",
    "vm_disk_path", "default_checkpoint_dir", "storage_warning", "parse_start", "iso_time",
    "ipython_shell", "in_notebook", "in_kernel", "is_notebook_shell", "cloud",
]

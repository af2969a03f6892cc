"""What the session runs on: GPUs (NVML or ``nvidia-smi``), CPU, RAM, disks and ``/dev/shm``.

Every size is given in bytes and as labelled text in both units (:func:`both_units`: ``GiB`` first,
``GB`` in brackets), because platforms and tools mix them and a 7 % gap is a common surprise.
Probing costs a few milliseconds (``nvidia-smi`` up to a second), so :func:`hardware` is called for a
report, never per step.

>>> both_units(16 * 2 ** 30)
'16.00 GiB (17.18 GB)'
>>> shm_warning(2 * 2 ** 30) is None
True
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Tuple

from ..units import format_bytes
from .clock import read_text
from .platforms import _is_url, detect, vm_disk_path

__all__ = ["GIB", "SHM_WARN_BYTES", "both_units", "gpus", "shm_warning", "hardware"]

GIB = 1 << 30
SHM_WARN_BYTES = 1 * GIB


def both_units(n: Optional[float]) -> str:
    """``"14.75 GiB (15.84 GB)"``: binary first, decimal in brackets, each labelled."""
    if n is None:
        return "n/a"
    return f"{format_bytes(n)} ({format_bytes(n, binary=False)})"


# ------------------------------------------------------------------------------------------ GPUs
def _gpu_entry(index: int, name: str, total_b: Optional[float], used_b: Optional[float],
               util: Optional[float]) -> Dict[str, Any]:
    def mib(b: Optional[float]) -> Optional[float]:
        return None if b is None else round(b / (1 << 20), 1)

    def gib(b: Optional[float]) -> Optional[float]:
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
                util: Optional[float] = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
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


# -------------------------------------------------------------------------------- CPU and memory
def _meminfo() -> Dict[str, int]:
    out = {}
    for line in (read_text("/proc/meminfo") or "").splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024
    return out


def _cgroup_int(*paths: str) -> Optional[int]:
    for p in paths:
        text = read_text(p)
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
    text = read_text("/sys/fs/cgroup/cpu.max")
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
    text = read_text("/proc/cpuinfo") or ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.M)
        if m:
            return m.group(1).strip()
    import platform as _platform

    return _platform.processor() or _platform.machine() or None


# ---------------------------------------------------------------------------------------- disks
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


# ---------------------------------------------------------------------------------------- report
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
    hw.update(_cpu_facts())
    hw.update(_ram_facts(warnings))
    hw["disks"] = _disk_facts(checkpoint_dir, platform, warnings)
    hw.update(_shm_facts(platform, warnings))
    hw["warnings"] = warnings
    return hw


def _cpu_facts() -> Dict[str, Any]:
    try:
        usable: Optional[int] = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return dict(cpu_model=_cpu_model(), cpu_count=os.cpu_count(), cpu_usable=usable, cpu_quota=_cpu_quota())


def _ram_facts(warnings: List[str]) -> Dict[str, Any]:
    mem = _meminfo()
    total, avail = mem.get("MemTotal"), mem.get("MemAvailable", mem.get("MemFree"))
    limit = _cgroup_int("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and total is not None and limit >= total:
        limit = None
    if total and avail is not None and avail < 0.1 * total:
        warnings.append(f"low RAM: {both_units(avail)} available of {both_units(total)}")
    return dict(
        ram_total_bytes=total, ram_available_bytes=avail,
        ram_total_gib=None if total is None else round(total / GIB, 2),
        ram_total_gb=None if total is None else round(total / 1e9, 2),
        ram_available_gib=None if avail is None else round(avail / GIB, 2),
        ram_available_gb=None if avail is None else round(avail / 1e9, 2),
        ram_total=both_units(total), ram_available=both_units(avail),
        ram_cgroup_limit_bytes=limit, ram_cgroup_limit=None if limit is None else both_units(limit))


def _disk_facts(checkpoint_dir: Optional[str], platform: str, warnings: List[str]) -> List[Dict[str, Any]]:
    disks = []
    if checkpoint_dir:
        disks.append(_disk(checkpoint_dir, "checkpoint dir"))
    disks.append(_disk(vm_disk_path(platform), "VM disk"))
    for d in disks:
        if d.get("free_bytes") is not None and d["free_bytes"] < GIB:
            warnings.append(f"low disk: {d['free']} free for the {d['what']} ({d['path']})")
    return disks


def _shm_facts(platform: str, warnings: List[str]) -> Dict[str, Any]:
    shm_total = shm_free = None
    if os.path.isdir("/dev/shm"):
        try:
            usage = shutil.disk_usage("/dev/shm")
            shm_total, shm_free = usage.total, usage.free
        except OSError:
            pass
    w = shm_warning(shm_total, platform)
    if w:
        warnings.append(w)
    return dict(shm_total_bytes=shm_total, shm_free_bytes=shm_free, shm_total=both_units(shm_total))

"""The ``keepalive status`` report: the session's facts (:mod:`keepalive.session`) with the runs
under the checkpoint dir and the uploads waiting in the spool.

It sits above storage on purpose: the session package knows the platform, the clock, idleness and
the hardware and imports nothing from storage; this module combines them with what the store and
the spool hold. The CLI (``keepalive status [--json]``) and the notebook panel
(``%keepalive status``) both print what :func:`status_report` returns, through :func:`format_status`
or as JSON. ``keepalive status --settings`` prints :func:`format_settings`.

A report never fails: what cannot be read becomes a line under ``warnings``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from . import runlog, runs, session
from ._version import __version__
from .memory import MemoryBudget
from .session import cloud as _cloud
from .session.clock import CLOCK_MEANING, ancestor_kernel, clock_starts, iso_time
from .store import describe_processes
from .units import format_duration

__all__ = ["status_report", "format_status", "format_settings", "other_run_state", "state_line", "with_state"]


# ----------------------------------------------------------------------------------------- runs
def _runs(checkpoint_dir: str, warnings: List[str]) -> List[Dict[str, Any]]:
    """One entry per run under ``checkpoint_dir`` (:meth:`keepalive.runs.Run.summary`: its newest
    committed checkpoint and counts); what cannot be read becomes a warning."""
    try:
        found = runs.find_runs(checkpoint_dir)
    except Exception as exc:  # noqa: BLE001 - status never crashes
        warnings.append(f"could not list runs under {checkpoint_dir}: {exc}")
        return []
    entries = []
    for run in found:
        try:
            entry = run.summary()
        except Exception as exc:  # noqa: BLE001
            entry = {"run": run.name, "url": run.url, "newest_step": None, "newest_epoch": None,
                     "newest_created": None, "checkpoints": 0, "error": str(exc)}
        if entry.get("error"):
            warnings.append(f"could not read run {run.url}: {entry['error']}")
        entries.append(with_state(run, entry))
    return entries


def with_state(run: "runs.Run", entry: Dict[str, Any]) -> Dict[str, Any]:
    """``entry`` with the run's state from its session records (:func:`keepalive.runlog.run_summary`:
    ``state`` RUNNING / STOPPED / DIED / FINISHED / NEW, ``state_detail``, ``step``, ``heartbeat_age_s``)."""
    try:
        entry.update(runlog.run_summary(run.url, run.storage_options))
    except Exception as exc:  # noqa: BLE001 - status never crashes
        entry.update(state="UNKNOWN", state_detail=f"session records unreadable: {exc}")
    return entry


#: seconds ``status`` waits for the runs the index records elsewhere (a remote store may not answer)
INDEX_TIMEOUT = 10.0


def _indexed_runs(checkpoint_dir: str, warnings: List[str]) -> List[Dict[str, Any]]:
    """One entry per run the index of runs (``RUNS.json`` in the default checkpoint dir) records
    outside ``checkpoint_dir``: runs opened with an explicit path, found again after a VM reset."""
    try:
        index_dir = session.default_checkpoint_dir()
        recorded = runs.indexed_runs(index_dir, exclude_below=checkpoint_dir)
        answered, silent = runs.answered_within(recorded, INDEX_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - status never crashes
        warnings.append(f"could not read the index of runs: {exc}")
        return []
    for run in silent:
        warnings.append(f"run {run.url} (recorded in the index of runs) did not answer within "
                        f"{INDEX_TIMEOUT:.0f} s")
    entries = []
    for run in sorted(answered, key=lambda r: r.created, reverse=True):
        try:
            entry = run.summary()
            entry["finished"] = run.finished
        except Exception as exc:  # noqa: BLE001
            entry = {"run": run.name, "url": run.url, "checkpoints": 0, "error": str(exc)}
        entries.append(with_state(run, entry))
    return entries


def _cloud_status(warnings: List[str]) -> Optional[Dict[str, Any]]:
    """The cloud's notices (:func:`keepalive.session.cloud.status`): None off a cloud VM (nothing
    asked); on one, the notice endpoint's current answer (one quick try)."""
    try:
        report = _cloud.status()
    except Exception as exc:  # noqa: BLE001 - status never crashes
        warnings.append(f"could not read the cloud's notices: {exc}")
        return None
    if not report.get("cloud"):
        return None
    if report.get("notice"):
        warnings.append(f"the cloud announced: {report['notice'].get('detail')}")
    return report


def _pending_uploads() -> Optional[Dict[str, Any]]:
    """Checkpoints waiting in the local spool for upload, None when none do."""
    try:
        return runs.pending_summary()
    except Exception as exc:  # noqa: BLE001 - a status report never fails for it
        return {"error": str(exc)}


# -------------------------------------------------------------------------------------- clocks
def _clock_starts(info: "session.SessionInfo") -> Dict[str, Optional[str]]:
    """When each clock a budget can run on started (UTC ISO; None where unreadable): the budget's
    clock may start long before this kernel (Colab counts from the VM's start)."""
    try:
        pid = os.getpid() if info.in_kernel else ancestor_kernel()
        return {k: iso_time(v) for k, v in clock_starts(info.in_kernel, pid).items()}
    except Exception:  # noqa: BLE001 - informative only; a report never fails
        return {}


def _training_here() -> List[Dict[str, Any]]:
    """The checkpointers training in this process (the notebook's kernel, for %keepalive status):
    their run and when they save (``every="auto"``: the interval chosen and its figures)."""
    from . import core  # the same layer; only checkpointers alive in this process are asked

    out: List[Dict[str, Any]] = []
    for ckpt in core.active_checkpointers():
        try:
            out.append({"url": ckpt.url, "every": ckpt.trigger.schedule.text, "auto": ckpt.trigger.auto_state()})
        except Exception as exc:  # noqa: BLE001 - a status report never fails for it
            out.append({"url": getattr(ckpt, "url", "?"), "error": str(exc)})
    return out


# --------------------------------------------------------------------------------------- report
def status_report(checkpoint_dir: Optional[str] = None) -> Dict[str, Any]:
    """Everything ``keepalive status --json`` prints (JSON-safe)."""
    info = session.detect()
    now = time.time()
    warnings: List[str] = list(info.warnings)
    if checkpoint_dir is None:
        checkpoint_dir = _default_dir(warnings)
    remaining = info.remaining_seconds(now)
    idle = session.idle_seconds()
    warnings.extend(_time_warnings(info, now, remaining, idle))
    w = session.storage_warning(info.platform, checkpoint_dir)
    if w:
        warnings.append(w)
    try:
        hw = session.hardware(checkpoint_dir)
    except Exception as exc:  # noqa: BLE001
        hw = {"error": str(exc), "warnings": []}
    warnings.extend(hw.get("warnings", []))
    run_entries = _runs(checkpoint_dir, warnings)
    cloud = _cloud_status(warnings)

    return {
        "platform": info.platform,
        "profile": info.profile,
        "evidence": info.evidence,
        "frontend": info.frontend,
        "run_type": info.run_type,
        "accelerator": info.accelerator,
        "time": iso_time(now),
        "time_unix": now,
        "budget_seconds": info.budget_seconds,
        "elapsed_seconds": info.elapsed_seconds(now),
        "remaining_seconds": remaining,
        "budget_source": info.budget_source,
        "deadline": iso_time(info.deadline),
        "idle_timeout_seconds": info.idle_timeout_seconds,
        "idle_seconds": idle,
        "idle_source": info.idle_source,
        "clock": info.clock,
        "clock_source": info.clock_source,
        "clock_reason": info.clock_reason,
        "clock_meaning": CLOCK_MEANING.get(info.clock, info.clock),
        "clock_starts": _clock_starts(info),
        "session_start": iso_time(info.start_time),
        "session_start_unix": info.start_time,
        "hardware": hw,
        "cloud": cloud,
        "training_here": _training_here(),
        "checkpoint_dir": checkpoint_dir,
        "runs": run_entries,
        "other_runs": _indexed_runs(checkpoint_dir, warnings),
        "pending_uploads": _pending_uploads(),
        "largest_async_save_bytes": _largest_async_save(),
        "warnings": warnings,
        "keepalive_version": __version__,
    }



def _largest_async_save() -> Optional[int]:
    """The largest training state whose save can hold a full copy of it and write it in the
    background here (:mod:`keepalive.memory`; None: unknown). A larger one streams."""
    try:
        return MemoryBudget().limit()
    except Exception:  # noqa: BLE001 - status never crashes
        return None


def _save_memory_line(largest: Optional[int]) -> str:
    if largest is None:
        return "  save mem  no memory limit known: every save copies the state and writes it in the background"
    return (f"  save mem  a state up to {session.both_units(largest)} is copied and written in the background "
            "(the memory free now, minus a margin); a larger one is streamed while the training waits")


def _default_dir(warnings: List[str]) -> str:
    try:
        return session.default_checkpoint_dir()
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"no default checkpoint dir: {exc}")
        return os.path.abspath("keepalive-checkpoints")


def _time_warnings(info: session.SessionInfo, now: float, remaining: Optional[float], idle: float) -> List[str]:
    """What the session budget and the idle timeout leave: nothing to say, or little."""
    warnings: List[str] = []
    if remaining is not None:
        if remaining <= 0:
            warnings.append(session.budget_used_up(info, now) or "the session budget is used up")
        elif remaining < 30 * 60:
            warnings.append(f"only {format_duration(remaining)} of the session budget left")
    if info.idle_timeout_seconds is not None:
        margin = info.idle_timeout_seconds - idle
        if idle > 0 and margin < session.tracker().warn_margin(info.idle_timeout_seconds):
            warnings.append(f"idle for {format_duration(idle)} of a "
                            f"{format_duration(info.idle_timeout_seconds)} idle timeout")
    return warnings

# ------------------------------------------------------------------------------------------ text
def _bar(fraction: float, width: int = 30) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(round(fraction * width))
    return "[" + "#" * full + "." * (width - full) + "]"


def _time_lines(r: Mapping[str, Any]) -> List[str]:
    lines = []
    budget, remaining, elapsed = r.get("budget_seconds"), r.get("remaining_seconds"), r.get("elapsed_seconds")
    lines.append(f"  session   started {r.get('session_start')} (clock: {r.get('clock')}), "
                 f"elapsed {format_duration(elapsed)}")
    lines.append(f"  clock     the budget runs on the {r.get('clock')} clock: it counts from "
                 f"{r.get('clock_meaning') or r.get('clock')}")
    if r.get("clock_reason"):
        lines.append(f"            why: {r['clock_reason']}")
    starts = r.get("clock_starts") or {}
    others = [f"{k} {v}" for k, v in starts.items() if v and k != r.get("clock")]
    lines.append("            " + (f"other clocks started: {', '.join(others)}; " if others else "")
                 + "choose with KEEPALIVE_CLOCK=vm|kernel|process")
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
    return lines


def _hardware_lines(hw: Mapping[str, Any]) -> List[str]:
    lines = []
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
    return lines


def _processes(run: Mapping[str, Any]) -> str:
    """", 2 ranks" / ", 2 ranks, DCP shards" for a run written by several torch.distributed processes
    (empty for one process)."""
    said = describe_processes(run.get("world_size"), run.get("sharded"))
    return f", {said}" if said else ""


def other_run_state(run: Mapping[str, Any]) -> str:
    """What a run recorded in the index of runs (an entry of the report's ``other_runs``) holds:
    ``UNFINISHED, 2 checkpoint(s), newest step 40 epoch 1``; the text panel and the widget both
    show it."""
    if run.get("error"):
        return f"unreadable ({run['error']})"
    if run.get("checkpoints"):
        return (f"{'finished' if run.get('finished') else 'UNFINISHED'}, {run['checkpoints']} "
                f"checkpoint(s), newest step {run.get('newest_step')}, {run.get('newest_epoch')} epoch(s) done"
                f"{_processes(run)}")
    return "no committed checkpoint"


def state_line(run: Mapping[str, Any]) -> str:
    """`` -- RUNNING (step 245, heartbeat 12 s ago, 3.1 steps/s ...)``, the end of a run's line, for
    a run whose sessions are recorded; empty for one without (an older keepalive's)."""
    state = run.get("state")
    if not state or state == "NEW":
        return ""
    return f" -- {state} ({run.get('state_detail')})"


def _run_lines(r: Mapping[str, Any]) -> List[str]:
    lines = [f"  checkpoints in {r.get('checkpoint_dir')}:"]
    entries = r.get("runs") or []
    if not entries:
        lines.append("            no runs yet")
    for run in entries:
        if run.get("error"):
            lines.append(f"            {run['run']}: unreadable ({run['error']})")
        elif run.get("checkpoints"):
            lines.append(f"            {run['run']}: {run['checkpoints']} checkpoint(s), newest step "
                         f"{run.get('newest_step')}, {run.get('newest_epoch')} epoch(s) done{_processes(run)} "
                         f"({run.get('newest_created') or 'time unknown'}){state_line(run)}")
        else:
            lines.append(f"            {run['run']}: no committed checkpoint{state_line(run)}")
    others = r.get("other_runs") or []
    if others:
        lines.append("  elsewhere (runs recorded in the index of runs):")
    for run in others:
        lines.append(f"            {run['run']}: {other_run_state(run)} in {run['url']}{state_line(run)}")
    pending = r.get("pending_uploads")
    if pending is not None:
        lines.append(f"  uploads   {runs.format_pending(pending, size=session.both_units)}")
    return lines


def format_status(report: Mapping[str, Any]) -> str:
    """The human panel: every figure with its unit; sizes as ``GiB (GB)``."""
    r = report
    head = f"keepalive status: platform {r.get('platform')}"
    extras = [x for x in (f"profile {r.get('profile')}" if r.get("profile") else None,
                          r.get("run_type") and f"run type {r['run_type']}",
                          r.get("accelerator") and f"accelerator {r['accelerator']}",
                          r.get("frontend") and f"front end {r['frontend']}") if x]
    if extras:
        head += " (" + ", ".join(extras) + ")"
    lines = [head]
    lines += _time_lines(r)
    lines += _hardware_lines(r.get("hardware") or {})
    lines.append(_save_memory_line(r.get("largest_async_save_bytes")))
    lines.append(f"  cloud     {_cloud.describe(r.get('cloud') or {})}")
    for run in r.get("training_here") or []:
        auto = run.get("auto")
        when = (f"auto: every {format_duration(auto['interval_seconds'])}" if auto and auto.get("interval_seconds")
                else f"every {run.get('every')}")
        lines.append(f"  saving    {run.get('url')}: {when}"
                     + (f" ({auto.get('limited_by')})" if auto and auto.get("limited_by") else ""))
    lines += _run_lines(r)
    for w in r.get("warnings") or []:
        lines.append(f"  WARNING   {w}")
    return "\n".join(lines)


def format_settings(rows: Sequence[Mapping[str, Any]]) -> str:
    """``keepalive status --settings``: each ``KEEPALIVE_*`` setting (rows of
    :func:`keepalive.settings.table`) with the value in force, whether the environment set it, and
    what it means."""
    lines = ["keepalive settings (environment variables; * = set here, else the default):"]
    width = max((len(str(row["name"])) for row in rows), default=0)
    for row in rows:
        value = "(none)" if row["value"] is None else repr(row["value"])
        mark = "*" if row["set"] else " "
        origin = "set" if row["set"] else "default"
        lines.append(f"{mark} {str(row['name']):<{width}}  {value}  [{origin}; {row['kind']}]")
        lines.append(f"  {'':<{width}}  {row['doc']}")
    return "\n".join(lines)

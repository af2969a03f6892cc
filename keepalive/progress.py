"""What a user watches while training: a progress bar for long checkpoint writes, and the session
time left next to the training's ETA.

* :func:`upload_progress` gives :class:`keepalive.writer.AsyncWriter` a factory that opens a tqdm bar
  (``tqdm.auto``: a widget in a notebook, text elsewhere) for checkpoints of at least
  ``KEEPALIVE_PROGRESS_MIN_BYTES`` (default 256 MiB) and feeds it the bytes written per chunk; once
  the write is complete one line confirms it (size, time, rate, where). Labels are the run's name,
  shortened (:func:`label`): in JupyterLab a long label squeezes the bar and cuts off the rate.
* :class:`TrainingProgress` shows an epoch bar whose postfix is the session time left (and a warning
  when the ETA lies beyond the session's end). It appears only where the session has a time limit
  (Colab, Kaggle, ``KEEPALIVE_BUDGET``) and the adapter knows the number of epochs, so local runs and
  tests stay quiet.

``KEEPALIVE_PROGRESS=0`` turns every bar off, ``=1`` turns them on even without a session limit.
tqdm is imported only when a bar is actually opened; without tqdm nothing is shown.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional

from . import report, settings
from .units import format_bytes, format_duration

DEFAULT_MIN_BYTES = int(settings.SETTINGS["KEEPALIVE_PROGRESS_MIN_BYTES"].default)


def setting() -> Optional[bool]:
    """``KEEPALIVE_PROGRESS``: True (on), False (off) or None (automatic)."""
    value: Optional[bool] = settings.get("KEEPALIVE_PROGRESS")
    return value


def min_upload_bytes() -> int:
    """``KEEPALIVE_PROGRESS_MIN_BYTES``: smaller uploads get no bar."""
    return int(settings.get("KEEPALIVE_PROGRESS_MIN_BYTES"))


def total_bytes(files: Mapping[str, Any]) -> int:
    """Bytes in a snapshot's ``{name: buffer or [buffers]}``."""
    total = 0
    for content in files.values():
        parts = [content] if isinstance(content, (bytes, bytearray, memoryview)) else content
        for part in parts:
            try:
                total += memoryview(part).nbytes
            except TypeError:
                total += len(part)
    return total


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


#: characters of a run name a bar's label shows: in JupyterLab the label, the bar and tqdm's text
#: (counts, times, rate, postfix) share one line, and a long label squeezes the bar to a stub and
#: cuts the rate off
LABEL_WIDTH = 24


def label(run: str, width: int = LABEL_WIDTH) -> str:
    """A bar's label: the run's name (never its URL), shortened in the middle to ``width``."""
    if len(run) <= width:
        return run
    keep = width - 3
    return run[:(keep + 1) // 2] + "..." + run[len(run) - keep // 2:]


def run_name(url: str) -> str:
    """The run's name, the last folder of its URL or path."""
    return url.rstrip("/").rsplit("/", 1)[-1] or url


def _is_notebook_bar(tqdm: Any) -> bool:
    return any(c.__name__ == "tqdm_notebook" for c in getattr(tqdm, "__mro__", ()))


def _layout(tqdm: Any) -> Dict[str, Any]:
    """Width options for a terminal bar: it follows the terminal's width (a notebook bar gets its
    layout from :func:`_widen`)."""
    return {} if _is_notebook_bar(tqdm) else {"dynamic_ncols": True}


def _widen(bar: Any) -> Any:
    """A notebook bar spans the output's width, the bar taking the room the label and the text
    leave, and the text wraps below it rather than being cut off. (What tqdm's ``ncols="100%"``
    does, without ``ncols``: tqdm's plain-text form of the widget fails on a text ``ncols``.)"""
    container = getattr(bar, "container", None)
    if container is None:
        return bar
    try:
        container.layout.width = "100%"
        container.layout.display = "inline-flex"
        container.layout.flex_flow = "row wrap"
        container.children[1].layout.flex = "2"
    except Exception as exc:  # noqa: BLE001 - another widget layout: tqdm's own
        report.debug(f"progress bar layout unchanged: {exc!r}")
    return bar


class _Bar:
    """The bar of one checkpoint write: short label, the step as its postfix, and once the last
    byte is written one line saying so (the bar itself disappears)."""

    def __init__(self, bar: Any, *, url: str, step: int, total: int):
        self.bar = bar
        self.url, self.step, self.total = url, step, total
        self.done = 0
        self.started = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        try:
            self.bar.update(n)
        except Exception:  # noqa: BLE001 - a display problem must not fail a checkpoint
            pass

    def close(self, result: Any = None) -> None:
        """Close the bar; a write complete in full is confirmed in one line (a failed one is
        reported by the writer). With the write's ``WriteResult`` the line also says where it went:
        the destination, or the local spool that uploads it next (the writer does not pass it yet,
        so the line names no place rather than a wrong one)."""
        try:
            self.bar.close()
        except Exception:  # noqa: BLE001
            pass
        if self.done < self.total:
            return
        where = None
        info = getattr(result, "info", None)
        if info is not None:
            where = (f"the local spool (uploading to {self.url} next)" if getattr(info, "source", None) == "spool"
                     else self.url)
        report.say(confirmation("wrote", self.step, run_name(self.url), self.total,
                                time.monotonic() - self.started, where))


def confirmation(verb: str, step: int, run: str, size: int, seconds: float, where: Optional[str] = None) -> str:
    """The line that confirms a write or an upload a bar showed: ``wrote step 120 of 'pets'
    (267.0 MiB in 12.1 s, 22.1 MiB/s) to gs://bucket/runs/pets``."""
    rate = f", {format_bytes(size / seconds)}/s" if seconds > 0 else ""
    return (f"{verb} step {step} of '{run}' ({format_bytes(size)} in {seconds:.1f} s{rate})"
            + (f" to {where}" if where else ""))


def upload_progress(url: str) -> Optional[Callable[[Mapping[str, Any], int], Optional[_Bar]]]:
    """The writer's ``progress_factory``: ``factory(files, step)`` -> bar (``update`` / ``close``)
    for writes of at least :func:`min_upload_bytes`, else None. None when bars are off."""
    if setting() is False:
        return None

    def factory(files: Mapping[str, Any], step: int) -> Optional[_Bar]:
        try:
            total = total_bytes(files)
            if total < min_upload_bytes():
                return None
            tqdm = _tqdm()
            if tqdm is None:
                return None
            bar = _widen(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                              desc=f"saving {label(run_name(url))}", postfix=f"step {step}",
                              file=sys.stderr, mininterval=0.5, **_layout(tqdm)))
            return _Bar(bar, url=url, step=step, total=total)
        except Exception as exc:  # noqa: BLE001
            report.debug(f"no upload progress bar: {exc!r}")
            return None

    return factory


def _epochs_eta(epochs_left: int, per_epoch: float, remaining: float) -> Any:
    """The ETA of the epochs left, as ``keepalive report`` estimates it (:func:`keepalive.runsummary.estimate_eta`):
    the same arithmetic, with the session's budget for the sessions still needed."""
    from .runsummary import estimate_eta
    from .session import detect

    budget = detect().budget_seconds
    return estimate_eta(max(0, epochs_left), 1.0 / per_epoch, budget_s=budget, session_left_s=remaining)


class TrainingProgress:
    """An epoch bar with the session time left next to tqdm's ETA (see module docstring).

    The core calls :meth:`epoch_end` at every epoch boundary; ``core.total_epochs`` (set by the
    adapter) gives the bar its length.
    """

    def __init__(self, core: Any):
        self.core = core
        self.bar: Any = None
        self.warned = False

    def wanted(self) -> bool:
        on = setting()
        if on is False or getattr(self.core, "total_epochs", None) is None:
            return False
        return on is True or self.core.trigger.remaining() is not None

    def postfix(self) -> str:
        """Short, so the rate stays in view: ``session left 1 h 59 min``, and ``(ETA past it)``
        when the epochs left need longer (said once in full, :meth:`_warn_eta`)."""
        remaining = self.core.trigger.remaining()
        if remaining is None:
            return "no session limit"
        text = f"session left {format_duration(max(0.0, remaining))}"
        total = getattr(self.core, "total_epochs", None)
        per_epoch = self.core.trigger.epoch_seconds
        if total and per_epoch:
            eta = _epochs_eta(total - self.core.counters["epoch"], per_epoch, remaining)
            if eta is not None and eta.seconds > remaining:
                text += " (ETA past it)"
                self._warn_eta(eta, remaining)
        return text

    def _warn_eta(self, eta: Any, remaining: float) -> None:
        if self.warned:
            return
        self.warned = True
        more = f" (about {eta.sessions} more session{'s' if eta.sessions != 1 else ''})" if eta.sessions else ""
        report.warn(f"run '{self.core.store.run}': the epochs left need about {format_duration(eta.seconds)}{more}, "
                    f"the session has {format_duration(max(0.0, remaining))} left; keepalive saves and stops "
                    "before its end (run the cell again in a new session to continue)")

    def epoch_end(self, last: bool = False) -> None:
        try:
            if self.bar is None:
                if not self.wanted():
                    return
                tqdm = _tqdm()
                if tqdm is None:
                    return
                done = self.core.counters["epoch"]
                self.bar = _widen(tqdm(total=self.core.total_epochs, initial=max(0, done - 1), unit="epoch",
                                       desc=label(self.core.store.run), file=sys.stderr, **_layout(tqdm)))
                per_epoch = self.core.trigger.epoch_seconds
                if per_epoch:  # the epoch that just ended counts for tqdm's rate / ETA
                    self.bar.start_t -= per_epoch
                    self.bar.last_print_t -= per_epoch
            self.bar.update(1)
            self.bar.set_postfix_str(self.postfix(), refresh=True)
            if last:
                self.close()
        except Exception as exc:  # noqa: BLE001 - a display problem must not stop training
            report.debug(f"epoch progress failed: {exc!r}")

    def close(self) -> None:
        bar, self.bar = self.bar, None
        if bar is not None:
            try:
                bar.close()
            except Exception:  # noqa: BLE001
                pass


__all__ = ["upload_progress", "TrainingProgress", "total_bytes", "setting", "min_upload_bytes", "label",
           "run_name", "confirmation", "LABEL_WIDTH"]

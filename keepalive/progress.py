"""What a user watches while training: a progress bar for long checkpoint writes, and the session
time left next to the training's ETA.

* :func:`upload_progress` gives :class:`keepalive.writer.AsyncWriter` a factory that opens a tqdm bar
  (``tqdm.auto``: a widget in a notebook, text elsewhere) for checkpoints of at least
  ``KEEPALIVE_PROGRESS_MIN_BYTES`` (default 256 MiB) and feeds it the bytes written per chunk.
* :class:`TrainingProgress` shows an epoch bar whose postfix is the session time left (and a warning
  when the ETA lies beyond the session's end). It appears only where the session has a time limit
  (Colab, Kaggle, ``KEEPALIVE_BUDGET``) and the adapter knows the number of epochs, so local runs and
  tests stay quiet.

``KEEPALIVE_PROGRESS=0`` turns every bar off, ``=1`` turns them on even without a session limit.
tqdm is imported only when a bar is actually opened; without tqdm nothing is shown.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Optional

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


class _Bar:
    """A tqdm bar that never raises into the writer thread."""

    def __init__(self, bar: Any):
        self.bar = bar

    def update(self, n: int) -> None:
        try:
            self.bar.update(n)
        except Exception:  # noqa: BLE001 - a display problem must not fail a checkpoint
            pass

    def close(self) -> None:
        try:
            self.bar.close()
        except Exception:  # noqa: BLE001
            pass


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
            target = url if len(url) <= 48 else "..." + url[-45:]
            return _Bar(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                             desc=f"keepalive: saving step {step} ({format_bytes(total)}) to {target}",
                             file=sys.stderr, mininterval=0.5))
        except Exception as exc:  # noqa: BLE001
            report.debug(f"no upload progress bar: {exc!r}")
            return None

    return factory


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
        remaining = self.core.trigger.remaining()
        if remaining is None:
            return "no session limit"
        text = f"session left {format_duration(max(0.0, remaining))}"
        total = getattr(self.core, "total_epochs", None)
        per_epoch = self.core.trigger.epoch_seconds
        if total and per_epoch:
            eta = (total - self.core.counters["epoch"]) * per_epoch
            if eta > remaining:
                text += " (ETA beyond the session's end: keepalive saves and stops before it)"
        return text

    def epoch_end(self, last: bool = False) -> None:
        try:
            if self.bar is None:
                if not self.wanted():
                    return
                tqdm = _tqdm()
                if tqdm is None:
                    return
                done = self.core.counters["epoch"]
                self.bar = tqdm(total=self.core.total_epochs, initial=max(0, done - 1), unit="epoch",
                                desc=f"keepalive: {self.core.store.run}", file=sys.stderr,
                                dynamic_ncols=True)
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


__all__ = ["upload_progress", "TrainingProgress", "total_bytes", "setting", "min_upload_bytes"]

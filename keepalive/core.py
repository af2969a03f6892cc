"""The framework-neutral checkpointer every adapter is built on.

An adapter (torch loop, Keras callback, fastai callback) does three things only: it says where the
step and epoch boundaries are, it gives a ``capture()`` function returning its objects' state as a
tree, and it restores such a tree into its objects. Everything else lives here: where checkpoints go,
when to save (:mod:`keepalive.trigger`), asynchronous writes (:mod:`keepalive.writer`), resuming from
the newest valid checkpoint with fallback (:mod:`keepalive.resume`), RNG capture
(:mod:`keepalive.rng`), deferred interrupts (Ctrl-C / "Interrupt kernel" and SIGTERM save at the next
step boundary, then take effect), and the one-line messages users see.

The tree a checkpoint holds::

    {"keepalive": {"format": 1, "framework": "torch"},
     "counters":  {"epoch": 3, "step": 1200, "batch": 0, "samples": 153600},
     "objects":   {"model": {...state_dict...}, "optimizer": {...}, ...},   # adapter's capture()
     "data":      {...sampler seed / position...},                          # adapter's capture()
     "rng":       {"python": ..., "numpy": ..., "torch_cpu": ..., ...},
     "extras":    {...user values...}}
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Union

from . import progress as _progress
from . import rng
from . import session as _session
from . import spool as _spool
from .resume import load_newest
from .store import CheckpointInfo, CheckpointStore
from .trigger import Decision, SaveTrigger
from .units import format_duration
from .writer import AsyncWriter

log = logging.getLogger("keepalive")

STATE_FORMAT = 1
Capture = Callable[[], Dict[str, Any]]

_ACTIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def default_dir() -> str:
    """``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``."""
    try:
        from .session import default_checkpoint_dir

        return default_checkpoint_dir()
    except ImportError:  # pragma: no cover - session module absent in a trimmed install
        return os.environ.get("KEEPALIVE_DIR") or os.path.abspath("keepalive-checkpoints")


def resolve_run_url(path: Union[str, os.PathLike, None], run: Optional[str] = None) -> str:
    """The run folder: ``path`` itself, or ``<default dir>/<run or 'default'>`` without a path."""
    if path is None:
        base = default_dir().rstrip("/")
        return f"{base}/{run or 'default'}"
    return os.fspath(path)


def say(message: str) -> None:
    """One line for the user: printed (notebooks show stdout) and logged."""
    log.info(message)
    print(f"keepalive: {message}", flush=True)


class RunViews:
    """Read-only views on ``self.core`` (a :class:`Checkpointer`) that every adapter offers."""

    core: "Checkpointer"

    @property
    def counters(self) -> Dict[str, int]:
        """``epoch``, ``step``, ``batch`` (within the epoch) and ``samples``."""
        return self.core.counters

    @property
    def extras(self) -> Dict[str, Any]:
        """Your own JSON-able values, saved and restored with the state (e.g. the best metric)."""
        return self.core.extras

    @property
    def finished(self) -> bool:
        """True once training ran to its end (and that end is checkpointed)."""
        return self.core.finished

    @property
    def stopped(self) -> bool:
        """True when training ended early to save before the session's deadline."""
        return self.core.stopped

    @property
    def url(self) -> str:
        """The run folder (local path or URL)."""
        return self.core.url


class CheckpointerViews(RunViews):
    """:class:`RunViews` plus ``epoch`` and ``step`` (fastai callbacks read those from the learner)."""

    @property
    def epoch(self) -> int:
        """Epochs completed (the next epoch to run)."""
        return self.core.counters["epoch"]

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.core.counters["step"]


class Checkpointer:
    """Where, when and how a training run is checkpointed and resumed (see module docstring)."""

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, run: Optional[str] = None,
                 every: Union[str, int, None] = "epoch", keep: Optional[int] = 3,
                 keep_every: Optional[int] = None, on_deadline: str = "save_and_stop",
                 deadline_margin: Union[str, float, None] = None, takeover: bool = False,
                 background: bool = True, storage_options: Optional[dict] = None,
                 framework: str = "generic", quiet: bool = False,
                 remaining_fn: Optional[Callable[[], Optional[float]]] = None,
                 spool: Union[str, bool, None] = "auto", flush_timeout: Optional[float] = None,
                 drive_flush: Optional[bool] = None):
        self.url = resolve_run_url(path, run)
        self.store = CheckpointStore(self.url, keep=keep, keep_every=keep_every,
                                     storage_options=storage_options)
        self.trigger = SaveTrigger(every, on_deadline=on_deadline, margin=deadline_margin,
                                   remaining_fn=remaining_fn)
        #: what the writer commits through: the store itself, or a local spool whose checkpoints a
        #: background thread uploads (remote URLs, Drive, failing destinations: keepalive/spool.py)
        self.sink = _spool.SpooledStore(self.store, spool, storage_options=storage_options,
                                        flush_timeout=flush_timeout, drive_flush=drive_flush,
                                        quiet=quiet, remaining_fn=self.trigger.remaining,
                                        on_durable=self.trigger.record_save)
        self.writer = AsyncWriter(self.sink, background=background)
        self.writer.on_commit.append(self._committed)
        if not quiet:
            self.writer.progress_factory = _progress.upload_progress(self.url)
        self.framework = framework
        self.takeover = takeover
        self.quiet = quiet
        self.counters: Dict[str, int] = {"epoch": 0, "step": 0, "batch": 0, "samples": 0}
        self.extras: Dict[str, Any] = {}
        self.metadata: Dict[str, Any] = {"framework": framework}
        self.resumed_from: Optional[CheckpointInfo] = None
        self.finished = False
        self.stopped = False
        self.stop_reason: Optional[str] = None
        self._opened = False
        self._last_saved_step: Optional[int] = None
        self._pending_signal: Optional[int] = None
        self._deferred_save = False
        self._reserved = False
        self._deferred_stop: Optional[str] = None
        self._old_handlers: Dict[int, Any] = {}
        self._in_loop = False
        #: the number of epochs, when the adapter knows it (for the ETA next to the session time)
        self.total_epochs: Optional[int] = None
        self.training_progress = None if quiet else _progress.TrainingProgress(self)
        self._capture_context()
        _ACTIVE.add(self)

    # -------------------------------------------------------------------------------- context
    def _capture_context(self) -> None:
        """Record what produced this run: the notebook cell (via the magics) or the script."""
        if "IPython" in sys.modules:
            try:
                from .magics.context import capture_context

                ctx = capture_context()
                if ctx:
                    self.metadata["context"] = ctx
                    return
            except ImportError:
                pass
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        if script:
            self.metadata["context"] = {"kind": "script", "path": os.path.abspath(script),
                                        "argv": list(sys.argv)}

    def _refresh_context(self) -> None:
        """A save from a training loop: when the loop runs in another notebook cell than the one
        that created this checkpointer (``ckpt = DriveCheckpoint(...)`` in one cell, the loop in the
        next), record the loop's cell as the training cell (the creating one becomes a setup cell)."""
        ctx_mod = sys.modules.get("keepalive.magics.context")
        if ctx_mod is None:
            return
        try:
            key = ctx_mod.current_cell_key()
            if key is not None and key != (self.metadata.get("context") or {}).get("cell_key"):
                ctx = ctx_mod.capture_context()
                if ctx:
                    self.metadata["context"] = ctx
        except Exception as exc:  # noqa: BLE001 - context is informative, never fatal
            log.debug("could not refresh the notebook context: %s", exc)

    # --------------------------------------------------------------------------------- resume
    def load(self, describe: Optional[Callable[[Dict[str, Any]], str]] = None) -> Optional[Dict[str, Any]]:
        """The newest valid checkpoint's state tree (falling back past corrupt ones), or None.

        Sets the counters and extras from it and says in one line what is resumed; ``describe``
        (optional) returns adapter-specific words for that line from the tree (e.g. what is restored).
        """
        found = load_newest(*self.sink.resume_stores())  # the spool and the destination
        # Take the writer lease now, at the start of training: a second session on the same run
        # learns it at once instead of after its first epoch.
        self._open()
        if found is None:
            return None
        info, tree, previous = found
        self.resumed_from = info
        counters = tree.get("counters", {})
        for k in self.counters:
            self.counters[k] = int(counters.get(k, 0))
        self.extras.update(tree.get("extras") or {})
        self._last_saved_step = self.counters["step"]
        self.trigger.saved()
        if not self.quiet:
            age = time.time() - (info.created or time.time())
            redone = ""
            if previous and previous.get("step") is not None and previous["step"] > self.counters["step"]:
                redone = f"; about {previous['step'] - self.counters['step']} step(s) will be redone"
            finished = " (this run had finished)" if (info.manifest or {}).get("metadata", {}).get("finished") else ""
            detail = ""
            if describe is not None:
                try:
                    detail = describe(tree) or ""
                except Exception as exc:  # noqa: BLE001 - words only: never stop a resume for them
                    log.debug("describe() failed: %s", exc)
            say(f"resuming run '{self.store.run}' from {info.name}: epoch {self.counters['epoch']}, "
                f"step {self.counters['step']}, saved {format_duration(age)} ago{redone}{finished}"
                f"{'; ' + detail if detail else ''}")
        return tree

    def restore_rng(self, tree: Mapping[str, Any]) -> None:
        if tree.get("rng"):
            rng.restore(tree["rng"])

    # ----------------------------------------------------------------------------------- save
    def _open(self) -> None:
        if not self._opened:
            # A notebook cell run again builds a new checkpointer for the same run while the old
            # one (same process, its loop over) still holds the writer lease: hand it over.
            for other in list(_ACTIVE):
                if (other is not self and other._opened and not other._in_loop
                        and other.store.url == self.store.url):
                    other.close()
            self.sink.open_for_writing(takeover=self.takeover)
            self._opened = True

    def _committed(self, result) -> None:
        self.trigger.record_save(result.seconds)

    def build_tree(self, capture: Capture) -> Dict[str, Any]:
        tree = {"keepalive": {"format": STATE_FORMAT, "framework": self.framework},
                "counters": dict(self.counters), "extras": dict(self.extras)}
        tree.update(capture())
        tree["rng"] = rng.capture()
        return tree

    def save(self, capture: Capture, *, sync: bool = False, reason: str = "by hand",
             finished: bool = False) -> None:
        """Checkpoint now: the state is copied to host memory, the write goes on in the background."""
        self._open()
        if reason != "by hand":
            self._refresh_context()
        tree = self.build_tree(capture)
        meta = dict(self.metadata, reason=reason, finished=finished, counters=dict(self.counters))
        self.store.lease.progress = dict(self.counters)
        log.info("saving step %d (epoch %d): %s", self.counters["step"], self.counters["epoch"], reason)
        self.writer.submit(tree, step=self.counters["step"], epoch=self.counters["epoch"],
                           metadata=meta, sync=sync)
        self._last_saved_step = self.counters["step"]
        self.trigger.saved()

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the in-flight write (bounded by ``timeout`` seconds when given), then for the
        spooled checkpoints' uploads (bounded by ``timeout`` or ``flush_timeout``)."""
        self.writer.wait(timeout)
        self.sink.flush(timeout, end_of_run=self.finished or self.stopped)

    # ----------------------------------------------------------------------------- boundaries
    def step_boundary(self, capture: Capture, *, can_save: bool = True, steps: int = 1) -> Decision:
        """Call after every optimizer step, with the counters already advanced.

        ``can_save=False`` where the adapter cannot resume inside an epoch: then no checkpoint is
        written here (a pending interrupt takes effect without saving; the last epoch-end checkpoint
        stays the newest). ``steps``: optimizer steps since the previous boundary, where one
        boundary covers several (Keras ``steps_per_execution``); ``every=N`` counts steps.
        """
        self.store.lease.progress = dict(self.counters)
        _session.note_activity()  # a running training is not idle
        self._reserve_snapshot(capture)
        decision = self.trigger.after_step(steps)
        if not can_save:
            # Nothing can be saved here: what came due (a scheduled save, a deadline stop) is done
            # at the next epoch end instead of being lost.
            self._deferred_save = self._deferred_save or decision.save
            if decision.stop:
                self._deferred_stop = decision.reason
            if self._pending_signal is not None:
                pending, self._pending_signal = self._pending_signal, None
                self.uninstall_signal_handlers()
                self._raise_for(pending)
            return Decision()
        return self._act(decision, capture, at_epoch_end=False)

    @staticmethod
    def _raise_for(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _reserve_snapshot(self, capture: Capture) -> None:
        """At the first boundary: prepare the host buffer of the first save in the background."""
        if not self._reserved:
            self._reserved = True
            try:
                self.writer.snapshot.reserve(self.build_tree(capture))
            except Exception as exc:  # noqa: BLE001 - an optimisation only; the save will say more
                log.debug("could not reserve the snapshot buffer: %s", exc)

    def epoch_boundary(self, capture: Capture, *, last: bool = False) -> Decision:
        """Call after every epoch, with the counters already pointing at the next epoch."""
        self._reserve_snapshot(capture)
        decision = self.trigger.after_epoch()
        if self.training_progress is not None:
            self.training_progress.epoch_end(last)
        if self._deferred_save:  # a step/time save came due where none was possible: save here
            self._deferred_save = False
            decision.save = True
            decision.reason = decision.reason or "save due during an epoch that cannot be resumed mid-way"
        if self._deferred_stop and not last:
            decision.save, decision.stop, decision.reason = True, True, self._deferred_stop
            self._deferred_stop = None
        if last:
            self.finished = True
            self._save_if_new(capture, "end of training", sync=True, finished=True)
            return Decision()
        return self._act(decision, capture, at_epoch_end=True)

    def end_of_stage(self, capture: Capture, *, reason: str, epoch_end: bool = True,
                     finished: bool = False) -> Decision:
        """A boundary after which training may go on in another stage (fastai's ``fine_tune`` runs two
        fits, each ending in the framework's own end-of-fit code): save now and wait until the write
        is durable, even when this step was saved before (code that ran since may have changed the
        state). With ``epoch_end`` the boundary also counts as the stage's last epoch end for the
        trigger (timing, deadline: the next stage may not fit in the session) and the progress bar.
        Then acts on a deadline stop and on a pending interrupt as any boundary does. Unlike
        ``epoch_boundary(last=True)`` the run is marked finished only when ``finished`` is given.
        """
        decision = Decision()
        if epoch_end:
            decision = self.trigger.after_epoch()
            if self.training_progress is not None:
                self.training_progress.epoch_end(True)
        self._deferred_save = False
        self.save(capture, sync=True, reason=reason, finished=finished)
        if finished:
            self.finished = True
        return self._act(Decision(stop=decision.stop, reason=decision.reason), capture, at_epoch_end=True)

    def _act(self, decision: Decision, capture: Capture, at_epoch_end: bool) -> Decision:
        pending = self._pending_signal
        if pending is not None:
            name = signal.Signals(pending).name
            self._save_if_new(capture, f"{name} received", sync=True)
            say(f"{name}: saved epoch {self.counters['epoch']}, step {self.counters['step']} to {self.url}")
            self._pending_signal = None
            self.uninstall_signal_handlers()
            self._raise_for(pending)
        if decision.save:
            self._save_if_new(capture, decision.reason, sync=decision.stop)
        if decision.stop:
            self.stopped = True
            self.stop_reason = decision.reason
            say(f"stopping before the session ends: saved epoch {self.counters['epoch']}, step "
                f"{self.counters['step']} to {self.url}. In a new session run the same code again "
                "(or %resume_training) to continue from here.")
        return decision

    def _save_if_new(self, capture: Capture, reason: str, *, sync: bool, finished: bool = False) -> None:
        if self._last_saved_step == self.counters["step"] and not finished:
            if sync:
                self.flush()
            return
        self.save(capture, sync=sync, reason=reason, finished=finished)

    # -------------------------------------------------------------------------------- signals
    def install_signal_handlers(self) -> None:
        """Defer SIGINT and SIGTERM to the next step boundary, where the state is consistent."""
        if threading.current_thread() is not threading.main_thread() or self._old_handlers:
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - not allowed here
                pass
        self._in_loop = True

    def uninstall_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
        self._old_handlers = {}
        self._in_loop = False

    def _on_signal(self, signum, frame) -> None:
        if self._pending_signal is not None:  # asked twice: the user insists, act now
            self.uninstall_signal_handlers()
            self._raise_for(signum)
        self._pending_signal = signum
        print(f"\nkeepalive: {signal.Signals(signum).name} received; saving at the end of this step "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish the in-flight write and release the writer lease."""
        try:
            self.flush()
        finally:
            self.uninstall_signal_handlers()
            if self.training_progress is not None:
                self.training_progress.close()
            self.sink.close()
            self._opened = False


@atexit.register
def _flush_all_at_exit() -> None:
    for ckpt in list(_ACTIVE):
        try:
            ckpt.close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.error("could not finish the last checkpoint of %s: %s", ckpt.url, exc)


__all__ = ["Checkpointer", "CheckpointerViews", "RunViews", "default_dir", "resolve_run_url", "say"]

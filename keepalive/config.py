"""The options every ``DriveCheckpoint`` takes, documented once.

Each adapter (``keepalive.callbacks.torch`` / ``keras`` / ``fastai`` / ...) accepts these as keyword
arguments, or a ready :class:`CheckpointConfig` as ``config=``:

>>> from keepalive.config import CheckpointConfig
>>> cfg = CheckpointConfig("runs/mnist", every="10min", keep=5)
>>> cfg.every, cfg.keep, cfg.on_deadline
('10min', 5, 'save_and_stop')
>>> CheckpointConfig.from_arguments("runs/x", None, {"keep": 2, "model": "m"})[1]
{'model': 'm'}
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig:
    """Where, when and how a training run is checkpointed.

    Args:
        path: the run folder: a local path, a mounted Drive folder (``/content/drive/MyDrive/runs/x``)
            or an fsspec URL (``gs://b/runs/x``, ``s3://...``). Default: ``$KEEPALIVE_DIR``, else the
            mounted Drive's ``MyDrive/keepalive``, else ``./keepalive-checkpoints``, plus ``run``.
        run: the run's name below the default folder when no ``path`` is given (default ``default``).
        every: when to save: ``"epoch"`` (default), an int (optimizer steps), a duration
            (``"90s"``, ``"10min"``, ``"1h"``) or ``"auto"``: the interval that loses least, from what a
            save is measured to cost the training (its stall plus its background write's slowing of
            the steps) and the platform's expected time between interruptions (Young/Daly,
            ``sqrt(2 * MTBF * cost)``; shorter on Colab's free tier and on a cloud VM that may be a
            Spot one), never costing more than 1 % of the training time and never more often than
            once a minute; the first save comes at the first epoch end or after 5 minutes. The
            interval is said once (and again when it changes twofold) and shown by ``keepalive
            status``. Saves inside an epoch happen only where the loop can be resumed there;
            otherwise a due save waits for the epoch end.
        keep: how many recent checkpoints stay (default 3; None keeps all).
        keep_every: also keep every Nth checkpoint.
        on_deadline: what to do when the session's time limit approaches (see ``keepalive status``):
            ``"save_and_stop"`` (default), ``"save"`` or ``"ignore"``.
        on_preempt: what to do on a cloud's preemption notice (GCE / AWS / Azure Spot VMs, watched
            through their metadata service): ``"save_and_stop"`` (default) saves at once, even during an
            evaluation, and stops; ``"save"`` saves and trains on; ``"ignore"``.
        deadline_margin: how long before the deadline to act (a duration; default: at least twice the
            measured save time, and one minute).
        takeover: take the run over from another live session that holds its writer lease.
        background: write checkpoints in a background thread (default); the loop waits only for the
            copy to host memory.
        snapshot: ``"lazy"`` (default): at a save only what may change before the next optimizer step
            is copied at once (random states, counters, buffers such as BatchNorm statistics); the
            parameters and state of the optimizers keepalive watches are copied in the background
            while the next forward and backward run, and that optimizer's step waits only for what
            is not copied yet. A tensor changed in place before its copy is caught by its version
            counter: that save is made again at the next step boundary and the tensor is copied at
            once from then on (said once). ``"blocking"``: every tensor is copied before the loop
            goes on. Saves that must be durable at once (a stop, a signal) always block.
        storage_options: fsspec options for the destination (credentials, endpoint).
        quiet: no news lines (resumed, saved, stopped). Warnings about what cannot be restored exactly
            are still shown.
        spool: ``"auto"`` (default) commits remote / Drive checkpoints to a local spool first and
            uploads them in the background (and switches to it when a local destination fails);
            ``True`` / ``False`` force it.
        flush_timeout: how long the end of training waits for uploads (default 120 s).
        drive_flush: on Colab, call ``drive.flush_and_unmount()`` at the end of the run.
        remaining_fn: seconds left in the session (default: from :mod:`keepalive.session`).
        track_globals: save the loop's own variables (plain values the loop assigns: a best loss, a
            counter, a batch drawn ahead) with each checkpoint and put them back on resume, when the
            loop runs at the top level of a script or notebook cell (default True); the loop-carried
            ones that cannot be saved (objects, a loop inside a function) are named once with the fix.
            False: none are saved, none named.
        track: the names of the loop's variables to save instead (only these, e.g.
            ``["best_val_loss", "patience"]``): globals of the loop's script or cell.
        notify: where to tell of the run's events (started / resumed, stopped, crashed, stalled,
            finished): one Apprise URL (``"ntfy://topic"``, ``"discord://..."``, ``"json://host/path"``,
            ``"mailto://..."``) or a list of them; default ``$KEEPALIVE_NOTIFY``. Sent in the
            background: a failing notifier never slows or breaks the training, and is said once.
        resume_from: another run folder (or URL) to resume from when this run has no checkpoint yet,
            read only: a checkpoint shared read-only, a Kaggle version's ``/kaggle/input/...`` copy,
            a Drive folder moved to a bucket. New checkpoints go to ``path``.
        memory_budget: the host memory a save may use for its copy of the state (bytes, or a size such
            as ``"2GiB"``); default: what the machine (or the container's limit) has available, minus a
            margin. A state that does not fit is streamed to the destination through a bounded buffer.
    """

    path: Union[str, "os.PathLike[str]", None] = None
    run: Optional[str] = None
    every: Union[str, int, None] = "epoch"
    keep: Optional[int] = 3
    keep_every: Optional[int] = None
    on_deadline: str = "save_and_stop"
    on_preempt: str = "save_and_stop"
    deadline_margin: Union[str, float, None] = None
    takeover: bool = False
    background: bool = True
    snapshot: str = "lazy"
    storage_options: Optional[dict] = None
    quiet: bool = False
    spool: Union[str, bool, None] = "auto"
    flush_timeout: Optional[float] = None
    drive_flush: Optional[bool] = None
    remaining_fn: Optional[Callable[[], Optional[float]]] = None
    track_globals: bool = True
    track: Optional[Sequence[str]] = None
    notify: Union[str, Sequence[str], None] = None
    resume_from: Union[str, "os.PathLike[str]", None] = None
    memory_budget: Union[str, int, None] = None

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_arguments(cls, path: Any, config: Optional["CheckpointConfig"],
                       options: Mapping[str, Any]) -> Tuple["CheckpointConfig", Dict[str, Any]]:
        """A config from an adapter's ``path``, ``config=`` and keyword arguments, and the keyword
        arguments that are not options (an adapter's own, e.g. the torch adapter's objects)."""
        names = set(cls.field_names())
        mine = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        base = config if config is not None else cls()
        if path is not None:
            mine["path"] = path
        return dataclasses.replace(base, **mine), rest

    @classmethod
    def strict(cls, path: Any, config: Optional["CheckpointConfig"], options: Mapping[str, Any],
               adapter: str) -> "CheckpointConfig":
        """Like :meth:`from_arguments`, for adapters that take no other keyword arguments."""
        cfg, rest = cls.from_arguments(path, config, options)
        if rest:
            raise cls.unexpected(adapter, sorted(rest)[0], len(rest))
        return cfg

    @classmethod
    def closest(cls, name: str) -> Optional[str]:
        """The option whose name is closest to a misspelled ``name``, if one is close.

        >>> CheckpointConfig.closest("evry"), CheckpointConfig.closest("model")
        ('every', None)
        """
        match = difflib.get_close_matches(name, cls.field_names(), n=1, cutoff=0.7)
        return match[0] if match else None

    @classmethod
    def unexpected(cls, adapter: str, name: str, count: int = 1) -> TypeError:
        """The error for an unknown keyword argument ``name``: the closest option, else all of them.

        >>> print(CheckpointConfig.unexpected("DriveCheckpoint", "evry"))
        DriveCheckpoint() got an unexpected keyword argument 'evry'; did you mean every=?
        """
        more = f" (and {count - 1} more)" if count > 1 else ""
        close = cls.closest(name)
        hint = f"did you mean {close}=?" if close else f"the options are {', '.join(cls.field_names())}"
        return TypeError(f"{adapter}() got an unexpected keyword argument '{name}'{more}; {hint}")

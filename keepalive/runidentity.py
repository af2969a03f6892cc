"""Which run a training is: one run per training, also when one process runs several of them.

An Optuna study calls its objective once per trial in one process; each call that makes an unnamed
``DriveCheckpoint()`` is another training (other hyper-parameters, often another model), so it must
get a run of its own, never the finished run of an earlier trial (which would hand back that trial's
value without training) nor one whose model has other shapes. The run of a trial is named after the
study and the trial's number: ``optuna-<study>-trial-<n>``.

A trial killed mid-training (the process SIGKILLed, the VM preempted) is retried by Optuna when the
study's storage has a heartbeat and a retry callback
(``RDBStorage(heartbeat_interval=..., heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())``):
the retried trial gets a new number and the same parameters, and Optuna records the number of the
original one (``RetryHeartbeatStaleTrialCallback.retried_trial_number``). Its run is the original's:
the retry resumes the killed training where its newest checkpoint left it.

A running trial is found without importing Optuna: only when ``optuna.trial`` is imported already,
by looking for a ``Trial`` among the local variables of the frames that called the checkpointer
(Optuna's own ``_run_trial`` holds one, whatever the objective calls its argument).

Outside Optuna, a script or cell run again with another model or other settings (``--lr 3e-4``, another
weight decay or optimizer) and an unnamed checkpointer finds the run the earlier training finished:
it is another training, never handed that run's result. Another model is told by the adapter's
``check`` (the checkpoint does not fit); other settings by what the adapter records as the code set
them (``Checkpointer.training_settings``, in each checkpoint's ``metadata["settings"]``: for torch the
optimizers' class, learning rate, weight decay, betas, momentum...). Both move the checkpointer to a
run of its own, said in one line. Only a *finished* run is compared: an unfinished one resumes as
ever (other settings are said and the checkpoint's are used, since a scheduler changes them), and a
run the user named is the user's choice.

Also here: the one line said at the first save of a run (:func:`announce_first_save`), so that a
training that is never interrupted still shows that it is protected, and where.

>>> slug("my study/v2"), slug("s")
('my-study-v2-e004', 's')
>>> interval_words("epoch"), interval_words(500), interval_words("10min"), interval_words("auto")
('every epoch', 'every 500 optimizer steps', 'every 10min', 'at an interval chosen from measured save costs')
"""
from __future__ import annotations

import hashlib
import re
import sys
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .errors import StateMismatchError
from .runs import Run, open_run
from .savepath import open_destination
from .trigger import Schedule
from .units import format_duration

__all__ = ["TrialRun", "announce_first_save", "another_training", "by_fit", "differs_from_every_fit",
           "interval_words", "move_to", "newest_of_own_run", "optuna_run", "other_settings", "recorded_fits",
           "running_trial", "slug"]

#: frames looked through for a running trial (Optuna's ``_run_trial`` is a few frames above the
#: objective; a training helper called by the objective adds some)
MAX_FRAMES = 80
#: checkpointers made so far per running trial (the ``Trial`` object: a study made again under the same
#: name numbers its trials from 0 again): a trial with two trainings (a K-fold inside the objective,
#: two stages) gets ``-2``, ``-3`` for the second, third, as an unnamed cell does
_PER_TRIAL: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def slug(name: str, limit: int = 40) -> str:
    """``name`` as a folder name: letters, digits, ``.``, ``_`` and ``-`` kept, the rest made ``-``;
    a name that had to be changed (or shortened) gets a short hash of the original, so that two
    studies named ``a/b`` and ``a b`` keep apart."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "study"
    if clean == name and len(clean) <= limit:
        return clean
    return f"{clean[:limit]}-{hashlib.sha256(name.encode()).hexdigest()[:4]}"


def running_trial(start: Optional[FrameType] = None) -> Any:
    """The ``optuna.trial.Trial`` whose objective runs now (in this thread), or None. Costs nothing
    when Optuna is not imported."""
    module = sys.modules.get("optuna.trial")
    trial_type = getattr(module, "Trial", None)
    if not isinstance(trial_type, type):
        return None
    frame: Optional[FrameType] = start if start is not None else sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        # the usual name first (Optuna's own frame has it), then any local of the frame
        named = frame.f_locals.get("trial")
        if isinstance(named, trial_type):
            return named
        found = next((v for v in frame.f_locals.values() if isinstance(v, trial_type)), None)
        if found is not None:
            return found
        frame = frame.f_back
    return None


def _system_attrs(trial: Any) -> Mapping[str, Any]:
    """The trial's system attributes, where a retry callback records the trial it retries (read from
    the storage: ``Trial`` has no public ``system_attrs`` in Optuna 4+; an older one has)."""
    try:
        return dict(trial.storage.get_trial_system_attrs(trial._trial_id))
    except Exception:  # noqa: BLE001 - an Optuna without these: the attribute of older versions
        try:
            return dict(getattr(trial, "system_attrs", None) or {})
        except Exception:  # noqa: BLE001 - no retry known: the trial is its own original
            return {}


def retried_number(trial: Any) -> Optional[int]:
    """The number of the trial that ``trial`` retries (the first of a series of retries), or None:
    what ``RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)`` answers."""
    attrs = _system_attrs(trial)
    history = attrs.get("retry_history")
    first = history[0] if isinstance(history, list) and history else attrs.get("failed_trial")
    return int(first) if isinstance(first, int) else None


def _running(trial: Any) -> bool:
    """Whether the trial still runs (its state in the study's storage), True when that cannot be read."""
    try:
        return str(trial.storage.get_trial(trial._trial_id).state.name) == "RUNNING"
    except Exception:  # noqa: BLE001 - an Optuna without these: take it as running
        return True


@dataclass(frozen=True)
class TrialRun:
    """The run of an Optuna trial: its name and the line that says why."""

    name: str
    line: str


def _params_words(params: Mapping[str, Any], limit: int = 4) -> str:
    def short(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)[:20]

    items = [f"{k}={short(v)}" for k, v in list(params.items())[:limit]]
    return ", ".join(items) + (", ..." if len(params) > limit else "")


def _has_checkpoint(base: str, name: str) -> bool:
    try:
        return open_run(f"{base}/{name}").newest is not None
    except Exception:  # noqa: BLE001 - an unreadable run: not one to continue
        return False


def _series(base: str, name: str) -> List[str]:
    """The runs named ``name``, ``name.2``, ``name.3``, ... that hold a checkpoint: a study made again
    under the same name (its trials numbered from 0 again) starts the next of the series."""
    found: List[str] = []
    while _has_checkpoint(base, name if not found else f"{name}.{len(found) + 1}"):
        found.append(name if not found else f"{name}.{len(found) + 1}")
    return found


def optuna_run(base: str, trial: Any = None) -> Optional[TrialRun]:
    """The run of the Optuna trial running now (None outside one). A trial's first checkpointer writes
    ``optuna-<study>-trial-<n>``, its k-th ``...-<k>``; a retried trial writes its original's run
    (resumed from its newest checkpoint). A trial that is no retry never takes a run that holds a
    checkpoint already (a study made again under the same name): it starts ``<name>.2`` (``.3``, ...)."""
    trial = trial if trial is not None else running_trial(sys._getframe(1))
    if trial is None:
        return None
    try:
        study, number = str(trial.study.study_name), int(trial.number)
        params = dict(trial.params)
    except Exception:  # noqa: BLE001 - not a trial we can read: the usual unnamed run
        return None
    if not _running(trial):  # a trial left in a variable after study.tell(): not this training's
        return None
    original = retried_number(trial)
    n = _PER_TRIAL[trial] = _PER_TRIAL.get(trial, 0) + 1
    own = original if original is not None else number
    name = f"optuna-{slug(study)}-trial-{own}" + ("" if n == 1 else f"-{n}")
    series = _series(base, name)
    about = f"Optuna trial {number} of study '{study}'" + (f", {_params_words(params)}" if params else "")
    if original is not None:
        name = series[-1] if series else name
        why = (f"{about}: it retries trial {original}, so it resumes trial {original}'s run" if series else
               f"{about}: it retries trial {original}, whose run holds no checkpoint; it starts it")
    elif series:
        taken = series[-1]
        name = f"{name}.{len(series) + 1}"
        why = f"new: {about}; run '{taken}' is an earlier trial {number} of a study of that name"
    else:
        why = f"new: {about}; each trial is its own run"
    return TrialRun(name, f"run '{name}' in {base} ({why})")


# ------------------------------------------------------------- a finished run of another training
#: how many finished runs of other trainings one checkpointer moves past (each move is to a run named
#: after what differs: a chain is as long as the trainings that differ from each other)
MAX_MOVES = 8
#: settings that differ named in the line (the rest is "…")
MAX_SHOWN = 4


def _unnamed(ckpt: Any) -> bool:
    cfg = ckpt.config
    return cfg.path is None and cfg.run is None


def other_settings(now: Optional[Mapping[str, Any]], then: Optional[Mapping[str, Any]]) -> List[str]:
    """What the training's settings ``now`` set otherwise than a checkpoint's ``then`` (both flat, as the
    adapter records them), in words: ``optimizer lr 0.001 → 0.0003``. A setting only one of them
    records is not compared (a later stage's optimizer, a checkpoint of an older keepalive).

    >>> other_settings({"optimizer": "AdamW", "optimizer.lr": 3e-4, "optimizer.betas": (0.9, 0.95)},
    ...                {"optimizer": "AdamW", "optimizer.lr": 1e-3, "optimizer.betas": [0.9, 0.95]})
    ['optimizer lr 0.001 → 0.0003']
    >>> other_settings({"optimizer.lr": 3e-4}, None)
    []
    """
    def plain(value: Any) -> Any:  # a checkpoint's JSON gives lists back
        return list(value) if isinstance(value, tuple) else value

    now, then = now or {}, then or {}
    return [f"{key.replace('.', ' ', 1)} {then[key]} → {now[key]}"
            for key in now if key in then and plain(then[key]) != plain(now[key])]


def by_fit(index: int, settings: Mapping[str, Any]) -> Dict[str, Any]:
    """One fit's settings as recorded for a run of several fits (Keras' and fastai's stages):
    each key prefixed with the fit's index.

    >>> by_fit(1, {"optimizer.lr": 0.01})
    {'fit1.optimizer.lr': 0.01}
    """
    return {f"fit{index}.{key}": value for key, value in settings.items()}


def recorded_fits(settings: Optional[Mapping[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """The per-fit settings a checkpoint recorded with :func:`by_fit`, by fit index."""
    fits: Dict[int, Dict[str, Any]] = {}
    for key, value in (settings or {}).items():
        head, _, rest = key.partition(".")
        if head.startswith("fit") and head[3:].isdigit() and rest:
            fits.setdefault(int(head[3:]), {})[rest] = value
    return fits


def differs_from_every_fit(now: Mapping[str, Any], then: Optional[Mapping[str, Any]]) -> List[str]:
    """What a fit's settings ``now`` set otherwise than each fit a finished run recorded (``then``,
    :func:`by_fit`): nothing when one of them has the same (a fit of that training, whichever: a
    script run again may leave its first fit out), else the differences from the closest one.

    >>> then = {**by_fit(0, {"optimizer.lr": 0.01}), **by_fit(1, {"optimizer.lr": 0.001})}
    >>> differs_from_every_fit({"optimizer.lr": 0.001}, then), differs_from_every_fit({"optimizer.lr": 0.003}, then)
    ([], ['optimizer lr 0.01 → 0.003'])
    """
    closest: Optional[List[str]] = None
    for _, settings in sorted(recorded_fits(then).items()):
        changed = other_settings(now, settings)
        if not changed:
            return []
        if closest is None or len(changed) < len(closest):
            closest = changed
    return closest or []


def another_training(ckpt: Any, found: Optional[Tuple[Any, Any, Any]],
                     check: Optional[Callable[[Any], None]]) -> Optional[str]:
    """Why the finished run ``found`` (``(info, tree, previous)``) is another training than the one
    ``ckpt`` is about to start, in words (``another model than run 'x', which finished (...)``): its
    checkpoint does not fit the objects (``check`` refuses it), or it recorded other settings than the
    code sets now (``other settings than run 'x', which finished: optimizer lr 0.001 → 0.0003``: the
    adapter's ``training_settings``). None when it fits (the same training run again: it is
    complete), when the run has not finished (a resume; a misfit is then refused as ever, other
    settings said), or for a run the user named (a path or ``run=``: the user chose it)."""
    if found is None or not _unnamed(ckpt):
        return None
    info, tree, _ = found
    then = (info.manifest or {}).get("metadata") or {}
    if not then.get("finished"):
        return None
    # the settings first: another optimizer class is said as such, not as the misfit of its state
    if ckpt.settings_differ is not None:  # an adapter of several fits compares fit by fit
        changed = ckpt.settings_differ(then.get("settings"))
    else:
        changed = other_settings(ckpt.training_settings() if ckpt.training_settings is not None else None,
                                 then.get("settings"))
    if changed:
        more = ", …" if len(changed) > MAX_SHOWN else ""
        return f"other settings than run '{ckpt.store.run}', which finished: {', '.join(changed[:MAX_SHOWN])}{more}"
    if check is not None:
        try:
            check(tree)
        except StateMismatchError as exc:
            return f"another model than run '{ckpt.store.run}', which finished ({str(exc).split(';')[0]})"
    return None


def move_to(ckpt: Any, url: str) -> None:
    """Make ``ckpt`` write the run ``url`` instead of its own (before anything was opened or saved)."""
    where = open_destination(url, ckpt.config, remaining_fn=ckpt.trigger.remaining,
                             on_durable=ckpt.trigger.record_save, on_commit=ckpt.on_commit)
    previous = ckpt.spooled
    ckpt.url, ckpt.store, ckpt.spooled, ckpt.writer = url, where.store, where.spooled, where.writer
    ckpt.path.move(where)
    previous.close()


def newest_of_own_run(ckpt: Any, check: Optional[Callable[[Any], None]] = None) -> Any:
    """The newest valid checkpoint of the run ``ckpt`` writes (``(info, tree, previous)`` or None),
    after moving an unnamed checkpointer off a finished run of another training (another model or other
    optimizer settings: a script run again with another ``--lr``, the n-th training of a cell or script
    whose trainings differ from one run to the next) to a run of
    its own, ``<run>-<hash of what differs>``: the same training run again finds that run (and
    resumes it, or finds it complete). Said in one line."""
    found = Run(ckpt.store, spool=ckpt.spooled.local_spool()).load_newest(quiet=ckpt.quiet)
    for _ in range(MAX_MOVES):
        why = another_training(ckpt, found, check)
        if why is None or ckpt.saver.opened:
            return found
        name = f"{ckpt.store.run}-{hashlib.sha256(why.encode()).hexdigest()[:4]}"
        move_to(ckpt, ckpt.url.rsplit("/", 1)[0] + "/" + name)
        ckpt.say(f"run '{name}' (new: {why}; run='name' names a run)")
        found = Run(ckpt.store, spool=ckpt.spooled.local_spool()).load_newest(quiet=ckpt.quiet)
    return found


# ------------------------------------------------------------------------ the first save's line
#: the checkpointers whose first save was announced (a new checkpointer on a run says it again:
#: a cell run again is another training session)
_ANNOUNCED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def interval_words(every: Any) -> str:
    """The schedule of saves in words (``every=`` as given, or the trigger's parsed
    :class:`~keepalive.trigger.Schedule`): ``every epoch``, ``every 500 optimizer steps``, ``every 10 min``."""
    schedule = every if isinstance(every, Schedule) else Schedule(every)
    if schedule.auto:
        return "at an interval chosen from measured save costs"
    if schedule.steps is not None:
        return f"every {schedule.steps} optimizer steps"
    if schedule.seconds is not None:  # the user's own words ("10min"), a bare number of seconds in ours
        text = schedule.text.strip()
        return f"every {text if text[-1:].isalpha() else format_duration(schedule.seconds)}"
    return "every epoch"


def announce_first_save(ckpt: Any, say: Callable[[str], None]) -> None:
    """At the first save of ``ckpt``: ``protecting run 'x' → <folder>, every <interval>`` (once; through
    ``say``, which ``quiet=True`` silences)."""
    if ckpt in _ANNOUNCED:
        return
    _ANNOUNCED.add(ckpt)
    say(f"protecting run '{ckpt.store.run}' → {ckpt.url}, {interval_words(ckpt.trigger.schedule)}")

"""A fastai ``Learner``'s state as plain trees, and back (for the fastai ``DriveCheckpoint``).

``objects``: the model, the optimizer (fastai's ``Optimizer``: per-parameter state and the
hyper-parameters of each group; an ``OptimWrapper``: the torch optimizer's ``state_dict``) and the
mixed-precision ``GradScaler``. Beside them, what fastai keeps in callbacks and loaders: the freeze
state, each ``DataLoader``'s ``random.Random`` (restored by :mod:`._fastai_data`, when an epoch's data
begins), the ``Recorder`` history (losses, learning rates, metric values, the smoothed loss), the
``ParamScheduler``'s record, and the tracker callbacks' (``SaveModelCallback``, ``EarlyStoppingCallback``,
``ReduceLROnPlateau``) best value, patience counter and last saved file. fastcore ``L`` and ``Path``
values become lists and strings in the tree. Nothing is loaded before :func:`check_fits` passes. Also
which fit of the run a fit call is (:class:`FitLog`: recognised by its notebook cell, so that it survives
a restart in which earlier cells are not run again) and the words for a position in the run.
"""
from __future__ import annotations

import hashlib
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from fastai.callback.progress import CSVLogger
from fastai.callback.schedule import ParamScheduler
from fastai.callback.tracker import TrackerCallback
from fastai.learner import Learner
from fastai.optimizer import Optimizer, OptimWrapper
from fastcore.foundation import L

from .. import notebook, rng
from ..errors import StateMismatchError
from ..plan import by_plan, changes, fingerprint, plain
from ..state import frozen_copy  # loaded tensors are views on the file buffer: what is kept gets copies
from . import _compat_fastai as fc
from ._fastai_data import dl_rngs
from .torchstate import check_module, check_optimizer, value_summary

__all__ = ["capture_objects", "check_fits", "restore", "capture_callbacks", "describe", "phase_words",
           "fine_tune_phase", "epochs", "where_words", "cell_identity", "FitLog", "RunHere", "run_here",
           "fit_plan", "plan_changes", "valid_split", "restore_loggers", "write_loggers", "summary",
           "optimizer_tensors"]


# --------------------------------------------------------------------------------- conversions
def _plain(x: Any) -> Any:
    """fastcore ``L`` and ``Path`` values as lists and strings, recursively (for the state tree)."""
    if isinstance(x, L):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _float_array(values: Any) -> np.ndarray:
    try:
        return np.asarray([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        return np.asarray([], dtype=np.float64)


# ------------------------------------------------------------------------------------ objects
def capture_objects(learn: Learner) -> Dict[str, Any]:
    opt = learn.opt
    if isinstance(opt, Optimizer):
        sd = opt.state_dict()
        opt_state = {"state": list(sd["state"]), "hypers": [dict(h) for h in sd["hypers"]]}
        # what a wrapper adds (Lookahead, ranger's: its step count and slow weights)
        opt_state.update({k: v for k, v in sd.items() if k not in ("state", "hypers")})
    else:
        opt_state = opt.state_dict()
    objects = {"model": learn.model.state_dict(), "optimizer": _plain(opt_state)}
    scaler = getattr(learn, "scaler", None)
    if scaler is not None:
        objects["scaler"] = scaler.state_dict()
    return objects


def optimizer_tensors(learn: Learner) -> List[Any]:
    """The tensors only the optimizer's step changes: its parameters and its per-parameter state (a
    lazy snapshot copies them in the background until the next step). fastai's ``Optimizer`` (and
    ``Lookahead`` over one) or an ``OptimWrapper``'s torch optimizer; read without creating entries
    in the state's defaultdict (that would add empty states to the checkpoint)."""
    opt = getattr(learn, "opt", None)
    if isinstance(opt, OptimWrapper):
        inner = opt.opt
        params = [p for group in inner.param_groups for p in group["params"]]
        states = list(inner.state.values())
    elif isinstance(opt, Optimizer):
        params = [p for group in opt.param_lists for p in group]
        states = list(opt.state.values())
    else:
        return []
    return params + [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]


def check_fits(learn: Learner, tree: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything is changed, a checkpoint (at ``where``) that does not fit the learner."""
    framework = tree.get("keepalive", {}).get("framework")
    if framework != "fastai":
        raise StateMismatchError(f"checkpoint {where} was written by keepalive's {framework!r} adapter, not "
                                 "the fastai one; use another run (path or run=)")
    objects = tree.get("objects", {})
    if "model" not in objects or "optimizer" not in objects:
        raise StateMismatchError(f"checkpoint {where} holds no model/optimizer state")
    check_module("model", learn.model, objects["model"], where)
    opt, saved = learn.opt, objects["optimizer"]
    if isinstance(opt, Optimizer):
        _check_fastai_optimizer(opt, saved)
    elif isinstance(opt, OptimWrapper):
        check_optimizer("optimizer", opt.opt, saved)


def _check_fastai_optimizer(opt: Optimizer, saved: Dict[str, Any]) -> None:
    groups, state = saved.get("hypers", []), saved.get("state", [])
    if len(groups) != len(opt.param_lists):
        raise StateMismatchError(f"optimizer: the checkpoint has {len(groups)} parameter group(s), the "
                                 f"learner {len(opt.param_lists)} (another splitter or model). Nothing "
                                 "was loaded.")
    params = [p for p, *_ in opt.all_params()]
    if len(state) != len(params):
        raise StateMismatchError(f"optimizer: the checkpoint has state for {len(state)} parameters, the "
                                 f"learner has {len(params)}. Nothing was loaded.")
    for i, (s, p) in enumerate(zip(state, params)):
        for k, v in (s or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise StateMismatchError(f"optimizer: state '{k}' of parameter {i} has shape "
                                         f"{tuple(v.shape)} in the checkpoint, the parameter "
                                         f"{tuple(p.shape)}. Nothing was loaded.")


def restore(learn: Learner, tree: Mapping[str, Any], warn: Optional[Callable[[str, str], Any]] = None) -> None:
    """A checked tree's objects and callbacks' state into the learner (not the RNGs: the caller knows
    when). ``warn(message, key)`` (inside a fit) is told when a tracker's saved file did not survive."""
    _load_objects(learn, tree["objects"], tree["fastai"].get("frozen_idx"))
    _restore_callbacks(learn, tree["fastai"], warn)


def _loaded(value: Any, device: Any) -> Any:
    """A saved value as the optimizer keeps it: tensors copied onto the parameters' device (the loaded
    ones are views on the file buffer), lists as lists."""
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, (list, tuple)):
        return [_loaded(v, device) for v in value]
    return frozen_copy(value)


def _load_objects(learn: Learner, objects: Dict[str, Any], frozen_idx: Optional[int]) -> None:
    learn.model.load_state_dict(objects["model"])
    opt, saved = learn.opt, objects["optimizer"]
    if isinstance(opt, Optimizer):
        params = [p for p, *_ in opt.all_params()]
        state = [{k: (v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else frozen_copy(v))
                  for k, v in s.items()} for s, p in zip(saved["state"], params)]
        extra = {k: _loaded(v, params[0].device) for k, v in saved.items() if k not in ("state", "hypers")}
        opt.load_state_dict({"state": state, "hypers": L([dict(h) for h in saved["hypers"]]), **extra})
    else:
        opt.load_state_dict(frozen_copy(saved))
    if frozen_idx is not None and getattr(opt, "frozen_idx", 0) != frozen_idx and hasattr(opt, "freeze_to"):
        opt.freeze_to(frozen_idx)
    scaler = getattr(learn, "scaler", None)
    if scaler is not None and objects.get("scaler"):
        scaler.load_state_dict(objects["scaler"])


# -------------------------------------------------------------------------------- callbacks
def _trackers(learn: Learner) -> Dict[str, TrackerCallback]:
    """The tracker callbacks by class name (``Name#1``, ``Name#2`` for further ones of a class)."""
    out: Dict[str, TrackerCallback] = {}
    for cb in learn.cbs:
        if isinstance(cb, TrackerCallback):
            name = type(cb).__name__
            key, n = name, 1
            while key in out:
                key, n = f"{name}#{n}", n + 1
            out[key] = cb
    return out


def _scheduler(learn: Learner) -> Optional[ParamScheduler]:
    return next((cb for cb in learn.cbs if isinstance(cb, ParamScheduler)
                 and getattr(cb, "hps", None) is not None), None)


def capture_callbacks(learn: Learner) -> Dict[str, Any]:
    """Freeze state, loaders' RNGs, Recorder, trackers and the ParamScheduler's record."""
    out: Dict[str, Any] = {
        "frozen_idx": getattr(learn.opt, "frozen_idx", None),
        "dl_rngs": dl_rngs(learn),  # restored by the caller, when the data of an epoch begins
        "recorder": _capture_recorder(learn),
        "trackers": {key: {a: _plain(cb.__dict__[a]) for a in fc.TRACKER_ATTRS if a in cb.__dict__}
                     for key, cb in _trackers(learn).items()},
    }
    sched = _scheduler(learn)
    if sched is not None:
        out["scheduler_hps"] = {k: _float_array(v) for k, v in sched.hps.items()}
    loggers = capture_loggers(learn)
    if loggers:
        out["loggers"] = loggers
    return out


def _capture_recorder(learn: Learner) -> Optional[Dict[str, Any]]:
    rec = getattr(learn, "recorder", None)
    if rec is None or not hasattr(rec, "lrs"):
        return None
    losses = [torch.as_tensor(v).detach().reshape(()).cpu() for v in rec.losses]
    out = {
        "lrs": _float_array(rec.lrs),
        "iters": [int(i) for i in rec.iters],
        "losses": torch.stack(losses) if losses else torch.zeros(0),
        "values": [_plain(list(v)) for v in rec.values],
        "metric_names": _plain(list(getattr(rec, "metric_names", []))) or None,
        "smooth_count": int(rec.smooth_loss.count),
        "smooth_val": torch.as_tensor(rec.smooth_loss.val).detach().clone(),
        "smooth_loss": (torch.as_tensor(learn.smooth_loss).detach().clone()
                        if getattr(learn, "smooth_loss", None) is not None else None),
    }
    hps = getattr(rec, "hps", None)
    if isinstance(hps, dict):
        out["hps"] = {k: _float_array(v) for k, v in hps.items()}
    return out


def _restore_callbacks(learn: Learner, saved: Dict[str, Any],
                       warn: Optional[Callable[[str, str], Any]]) -> None:
    rec, rs = getattr(learn, "recorder", None), saved.get("recorder")
    if rec is not None and rs:
        rec.lrs = list(rs["lrs"])
        rec.iters = [int(i) for i in rs["iters"]]
        rec.losses = list(frozen_copy(rs["losses"]).unbind(0)) if len(rs["losses"]) else []
        rec.values = [L(v) for v in rs["values"]]
        if rs.get("metric_names") is not None:
            rec.metric_names = L(rs["metric_names"])
        rec.smooth_loss.count = int(rs["smooth_count"])
        rec.smooth_loss.val = frozen_copy(rs["smooth_val"])
        if rs.get("smooth_loss") is not None:
            learn.smooth_loss = frozen_copy(rs["smooth_loss"])
        if rs.get("hps") is not None:
            rec.hps = {k: list(v) for k, v in rs["hps"].items()}
    live = _trackers(learn)
    for key, state in (saved.get("trackers") or {}).items():
        cb = live.get(key)
        if cb is None:
            continue
        for attr, value in state.items():
            cb.__dict__[attr] = Path(value) if attr == "last_saved_path" and value is not None else frozen_copy(value)
        saved_path = cb.__dict__.get("last_saved_path")
        if warn is not None and saved_path is not None and not Path(saved_path).exists():
            warn(f"{type(cb).__name__}'s file {saved_path} did not survive the restart (keep learn.path "
                 "on persistent storage, e.g. Drive); its best value is restored, but the file it loads "
                 "at the end of the fit is rewritten only by a better epoch", f"tracker-file:{key}")
    hps: Any = saved.get("scheduler_hps")
    for cb in learn.cbs if hps is not None else ():
        live_hps = getattr(cb, "hps", None) if isinstance(cb, ParamScheduler) else None
        if live_hps is not None and set(live_hps) == set(hps):
            cb.hps = {k: list(v) for k, v in hps.items()}


# -------------------------------------------------------------------------------- summary
def summary(learn: Learner) -> Tuple[Any, ...]:
    """A cheap, comparable summary of what :func:`capture_objects` and :func:`capture_callbacks` read
    beside the model's and optimizer's tensors (whose version counters the core compares itself):
    the optimizer's hyper-parameters, the freeze state, the GradScaler's scale, the Recorder's and the
    ParamScheduler's records (by length: they only grow), the trackers' values and the loggers' files.
    Equal summaries at a boundary and during an evaluation: the state is still that boundary's."""
    opt = learn.opt
    hypers = tuple(tuple(sorted((str(k), value_summary(v)) for k, v in h.items())) for h in getattr(opt, "hypers", ()))
    scaler = getattr(learn, "scaler", None)
    scale = tuple(value_summary(getattr(scaler, name, None)) for name in ("_scale", "_growth_tracker")) \
        if scaler is not None else None
    rec = getattr(learn, "recorder", None)
    recorder = None
    if rec is not None and hasattr(rec, "lrs"):
        recorder = (len(rec.lrs), len(rec.iters), len(rec.losses), len(rec.values), int(rec.smooth_loss.count),
                    value_summary(getattr(learn, "smooth_loss", None)))
    sched = _scheduler(learn)
    hps = tuple((k, len(v)) for k, v in sched.hps.items()) if sched is not None else None
    trackers = tuple((key, tuple(value_summary(cb.__dict__.get(a)) for a in fc.TRACKER_ATTRS))
                     for key, cb in _trackers(learn).items())
    loggers = []
    for key, cb in _csv_loggers(learn).items():
        f = cb.__dict__.get("file")
        loggers.append((key, f.tell() if f is not None and not f.closed else None))
    return (hypers, getattr(opt, "frozen_idx", None), scale, recorder, hps, trackers, tuple(loggers))


# ------------------------------------------------------------------------------------ loggers
def _csv_loggers(learn: Learner) -> Dict[str, CSVLogger]:
    """The ``CSVLogger`` callbacks by their file (``CSVLogger:history.csv``)."""
    return {f"CSVLogger:{cb.fname}": cb for cb in learn.cbs if isinstance(cb, CSVLogger)}


def _log_file(learn: Learner, cb: CSVLogger) -> Path:
    return Path(learn.path) / cb.fname


def capture_loggers(learn: Learner) -> Dict[str, str]:
    """What each ``CSVLogger`` has written so far. Its header is written unflushed at ``before_fit``
    (the lines are flushed one by one): flushed here, so that the text read holds it."""
    out: Dict[str, str] = {}
    for key, cb in _csv_loggers(learn).items():
        f = cb.__dict__.get("file")
        if f is not None and not f.closed:
            f.flush()
        path = _log_file(learn, cb)
        out[key] = path.read_text() if path.exists() else ""
    return out


def restore_loggers(learn: Learner, saved: Mapping[str, Any]) -> None:
    """Inside a resumed fit (after ``before_fit``, which truncated the file with ``append=False`` or
    appended a header with ``append=True``): each ``CSVLogger``'s open file holds the saved text again,
    as the uninterrupted run's did at the checkpoint; the next epochs' lines follow it."""
    for key, text in (saved.get("loggers") or {}).items():
        cb = _csv_loggers(learn).get(key)
        f = cb.__dict__.get("file") if cb is not None else None
        if f is None or f.closed:
            continue
        f.seek(0)
        f.truncate()
        f.write(str(text))
        f.flush()


def write_loggers(learn: Learner, saved: Mapping[str, Any]) -> None:
    """At a fit's end restored from a checkpoint (its fit is skipped: no callback runs): each
    ``CSVLogger``'s file as the uninterrupted run left it there (a later fit of the killed session may
    have truncated it, or written lines that run again)."""
    for key, text in (saved.get("loggers") or {}).items():
        cb = _csv_loggers(learn).get(key)
        if cb is None:
            continue
        path = _log_file(learn, cb)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(text))


# --------------------------------------------------------------------------------------- plans
#: where a schedule is sampled (fractions of the fit) to tell two schedules apart
_SCHEDULE_POINTS = [i / 20 for i in range(21)]


def _schedule_values(scheds: Mapping[str, Callable[[float], Any]]) -> List[Any]:
    """A ``ParamScheduler``'s functions at fixed points of the fit: equal settings, equal values (the
    settings themselves live in closures). The global RNGs are left as they were (a sampled function
    could draw)."""
    with rng.unchanged():
        try:
            return [[name, [np.asarray(f(pos), dtype=np.float64).ravel().tolist() for pos in _SCHEDULE_POINTS]]
                    for name, f in sorted(scheds.items())]
        except Exception:  # noqa: BLE001 - a schedule that cannot be sampled is no plan value
            return [[name, repr(f)] for name, f in sorted(scheds.items())]


def fit_plan(learn: Learner, phase: Optional[int]) -> Dict[str, Any]:
    """What the code asks of a fit starting now (before its ``before_fit``): its epochs, fine_tune's
    phase, and its hyper-parameter schedule (the ``ParamScheduler`` of ``fit_one_cycle``,
    ``fit_flat_cos``, ``fine_tune``..., sampled: ``lr_max``, ``div``, ``pct_start``... all change it) or,
    without one, its learning rates. Saved with the fit (:class:`FitLog`) and in ``core.plan``."""
    out: Dict[str, Any] = {"epochs": int(learn.n_epoch), "phase": phase}
    scheds = [cb.scheds for cb in learn.cbs if isinstance(cb, ParamScheduler) and getattr(cb, "scheds", None)]
    if scheds:
        sampled = [_schedule_values(s) for s in scheds]
        out["schedule"] = fingerprint(sampled)
        peaks = [max(values) for one in sampled for name, points in one if name == "lr" and isinstance(points, list)
                 for values in points if values]
        if peaks:  # the schedule's peak learning rate, in words where the fingerprint has none
            out["lr_max"] = float(f"{max(peaks):.7g}")
    else:
        try:
            out["lr"] = plain([float(h["lr"]) for h in learn.opt.hypers])
        except (AttributeError, KeyError, TypeError):
            pass
    return out


FIT_PLAN_KEYS = ("epochs", "phase", "schedule", "lr")


def fit_settings(plan: Mapping[str, Any]) -> Dict[str, Any]:
    """A fit's settings as the code set them, from its plan: its hyper-parameter schedule (or learning
    rates) and fine_tune's phase, not its epochs (more epochs train a finished run on). Recorded per
    fit with each checkpoint, compared with a finished unnamed run's (:mod:`keepalive.runidentity`)."""
    names = {"lr_max": "lr_max", "schedule": "hyper-parameter schedule", "lr": "lr", "phase": "fine_tune phase"}
    return {names[key]: plan[key] for key in names if plan.get(key) is not None}


def plan_changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any]) -> List[Tuple[str, Any, Any]]:
    """How a fit's plan differs from a saved one (none when the saved one is unknown)."""
    return changes(saved, now, FIT_PLAN_KEYS)


def valid_split(learn: Learner) -> Optional[str]:
    """A fingerprint of the validation set's indices: fastai ``Datasets`` (a ``DataBlock``) keep the
    split (``splits``), a ``TabularPandas`` keeps its rows' index; None for another dataset (its code
    decides; nothing to compare). ``RandomSplitter()`` without a seed splits differently in each process."""
    dls = getattr(learn, "dls", None)
    try:
        ds = dls.valid.dataset if dls is not None and len(dls.loaders) > 1 else None
    except (AttributeError, IndexError, TypeError):
        return None
    splits = getattr(ds, "splits", None)
    if isinstance(splits, (list, tuple, L)) and len(splits) > 1:
        return fingerprint(int(i) for i in splits[1])
    index = getattr(getattr(ds, "items", None), "index", None)
    if index is not None and hasattr(index, "tolist"):
        return fingerprint(index.tolist())
    return None


# --------------------------------------------------------------------------------------- fits
def cell_identity() -> Tuple[Optional[str], Optional[str]]:
    """(a hash of the running notebook cell's source, that cell execution's key); (None, None) outside
    IPython. The hash ignores trailing whitespace, so re-sending the same cell gives the same hash."""
    key = notebook.current_cell_key()
    source = notebook.current_cell_source()
    if not source or not source.strip():
        return None, key
    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha256(text.encode()).hexdigest()[:16], key


#: the notebook cell execution that started the last fit, and the fits it started (whatever callback)
_CELL_FITS: Dict[str, Any] = {"key": None, "fits": 0}


@dataclass
class RunHere:
    """What this process did on one run (its URL) with one learner, whatever callback objects did it.

    ``fits`` counts the fits started outside a notebook cell (since the learner began on this run or
    an interrupted fit: a script counts them all again, and re-running it builds another learner).
    ``live`` is set while the learner holds the state of the run's newest checkpoint, the end of a
    fit this process trained (or whose end it restored) and nothing interrupted since: the fits then
    recorded and the counters. A callback new to the run then starts the next stage from the learner
    as it is (the user's ``unfreeze()`` in between included) instead of loading that end again.
    """

    learner: "weakref.ref[Learner]"
    fits: Dict[str, Any] = field(default_factory=lambda: {"key": None, "fits": 0})
    live: Optional[Dict[str, Any]] = None


_RUNS_HERE: Dict[str, RunHere] = {}


def run_here(url: str, learn: Learner) -> RunHere:
    """This process' record of run ``url`` with ``learn`` (a new one for another learner)."""
    here = _RUNS_HERE.get(url)
    if here is None or here.learner() is not learn:
        here = _RUNS_HERE[url] = RunHere(weakref.ref(learn))
    return here


class FitLog:
    """The run's fit calls in order, each identified so that it is recognised after a restart.

    A fit is ``{"cell": hash of its notebook cell's source, "key": that cell execution, "index": its
    number within the execution, "phase": fine_tune's 1 / 2 or None, "plan": :func:`fit_plan`}``;
    outside a notebook cell and key are None and the index counts the fits of this learner on this run
    in the process (:class:`RunHere`: a script runs them all again; one callback per fit counts as
    one callback for all). The list is saved with every checkpoint: fit N of the run is its entry N.
    Why not count the process's fits: after a restart a notebook user runs the setup cell and only
    the cell that was training (as ``%resume_training`` does); that cell's fit must still be
    recognised as the run's fit N. Where the place (cell, index) names a fit whose plan differs and
    another recorded fit has this plan, the plan wins: a script re-run with its first ``fit`` commented
    out is the second fit, not the first one again.
    """

    def __init__(self) -> None:
        self.entries: List[Dict[str, Any]] = []
        self.cursor = 0             # entries before it are matched or passed in this process
        self._counter: Dict[str, Any] = {"key": None, "fits": 0}  # the counter of the last fit

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        """Start over from a checkpoint's ``fastai`` tree (None: a new run)."""
        entries: Any = (saved or {}).get("fits")
        if entries is None and saved is not None:  # written before fits were recorded: by number
            entries = [{"cell": None, "key": None, "index": i + 1}
                       for i in range(int(saved["position"]["fit"]))]
        self.entries = [dict(e) for e in entries or []]
        self.cursor = 0

    def next_id(self, here: RunHere, plan: Dict[str, Any]) -> Dict[str, Any]:
        """The identity of a fit call starting now (``here``: the process' record of the run)."""
        cell, key = cell_identity()
        counter = self._counter = here.fits if key is None else _CELL_FITS
        if counter["key"] != key:
            counter["key"], counter["fits"] = key, 0
        counter["fits"] += 1
        return {"cell": cell, "key": key, "index": counter["fits"], "plan": dict(plan)}

    def restart_cell(self) -> None:
        """The fit was interrupted: running the cell again starts over from its first fit."""
        self._counter["fits"] = 0

    def plan_of(self, n: int) -> Optional[Dict[str, Any]]:
        """The plan recorded for the run's fit ``n`` (None: unknown)."""
        return self.entries[n - 1].get("plan") if 0 < n <= len(self.entries) else None

    def replan(self, n: int, plan: Dict[str, Any]) -> None:
        """The run's fit ``n`` goes on under the code's plan (it changed between sessions)."""
        if 0 < n <= len(self.entries):
            self.entries[n - 1]["plan"] = dict(plan)

    def _prefer_plan(self, candidates: List[int], at: Optional[int], plan: Optional[Dict[str, Any]]) -> Optional[int]:
        """``at`` (the entry at the fit's place) unless its plan differs from ``plan`` and a candidate's
        equals it (:func:`keepalive.plan.by_plan`; an entry without a plan, written before
        plans were recorded, is the fit at its place). No candidate with this plan: ``at`` still (the
        plan changed: said at the resume)."""
        places = ([at] if at is not None else []) + [j for j in candidates if j != at]
        hit = by_plan({j: self.entries[j].get("plan") for j in places}, at, plan, FIT_PLAN_KEYS,
                      unknown_is_same=True)
        return at if hit is None else hit

    def find(self, fit: Dict[str, Any]) -> Optional[int]:
        """The run's number of ``fit`` among the entries from the cursor on, or None (a new fit).

        The same execution first (``%resume_training`` re-runs the recorded one), then the same cell
        source and index: the same cell run twice in a run is matched in order; by plan where the fit
        at that place has another plan.
        """
        rest = range(self.cursor, len(self.entries))
        hit = next((j for j in rest if fit["key"] is not None and self.entries[j].get("key") == fit["key"]
                    and int(self.entries[j].get("index", 0)) == fit["index"]), None)
        if hit is None:
            cell = [j for j in rest if self.entries[j].get("cell") == fit["cell"]]
            at = next((j for j in cell if int(self.entries[j].get("index", 0)) == fit["index"]), None)
            hit = self._prefer_plan(cell, at, fit.get("plan"))
        if hit is None:
            return None
        self.cursor = hit + 1
        return hit + 1

    def find_like(self, fit: Dict[str, Any], current: int, phase: Optional[int]) -> Optional[int]:
        """A fit of a cell the run has not seen (another cell, or the same one edited, e.g. a demo
        cell that interrupted itself and a plain cell that resumes): the run's fit at the same place,
        and of the same ``fine_tune`` phase, in the cell execution of the checkpoint's fit ``current``
        (by plan where the fit at that place has another plan: a cell whose first fit was removed)."""
        if not 0 < current <= len(self.entries):
            return None
        e = self.entries[current - 1]
        same = [j for j, x in enumerate(self.entries)
                if x.get("key") == e.get("key") and x.get("cell") == e.get("cell")]
        at = same[fit["index"] - 1] if 0 < fit["index"] <= len(same) else None
        j = self._prefer_plan([j for j in same if j >= self.cursor], at, fit.get("plan"))
        if j is None:
            return None
        was = self.entries[j].get("phase")
        if j < self.cursor or (phase is not None and was is not None and was != phase):
            return None
        self.cursor = j + 1
        return j + 1

    def add(self, fit: Dict[str, Any], phase: Optional[int]) -> int:
        """A new fit of the run: its number."""
        self.entries.append(dict(fit, phase=phase))
        self.cursor = len(self.entries)
        return len(self.entries)

    def pass_all(self) -> None:
        """Every recorded fit is behind us: later fits are new ones."""
        self.cursor = len(self.entries)

    def upto(self, n: int) -> List[Dict[str, Any]]:
        """The entries of fits 1..n (for a checkpoint taken in fit n)."""
        return [dict(e) for e in self.entries[:n]]


# ---------------------------------------------------------------------------------- positions
def fine_tune_phase(learn: Learner) -> Optional[int]:
    """1 or 2 when this fit is called by ``learn.fine_tune`` (frozen / unfrozen fit), else None."""
    code = getattr(getattr(Learner, fc.FINE_TUNE, None), "__code__", None)
    phase = 1 if getattr(learn.opt, "frozen_idx", 0) > 0 else 2
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code and frame.f_locals.get("self") is learn:
            return phase
        frame = frame.f_back
    return None


def phase_words(phase: Optional[int], more: str = "") -> str:
    """`` (fine_tune's frozen fit, ...)`` for fine_tune's fits 1 / 2 and ``more``; empty if neither."""
    names = {1: "fine_tune's frozen fit", 2: "fine_tune's unfrozen fit"}
    words = [w for w in (names.get(phase or 0), more) if w]
    return f" ({', '.join(words)})" if words else ""


def epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


def where_words(epochs_done: int, n_epoch: int, batches_done: int = 0, n_iter: int = 0) -> str:
    """A position inside a fit, in the one numbering every fastai message uses: counts of work done
    (as keepalive's counters), never indices: "2 of 5 epochs done" is what the resume line's position
    calls "at the end of epoch 1" (epochs numbered from 0, as fastai's table numbers them)."""
    words = f"{epochs_done} of {n_epoch} epochs done"
    if batches_done:
        words += f", {batches_done} of {n_iter} batches into the next"
    return words


def describe(tree: Mapping[str, Any]) -> str:
    """Where a checkpoint is, in words (for the "resuming run ..." line)."""
    pos = (tree.get("fastai") or {}).get("position")
    if not pos:
        return ""
    where = f"fit {pos['fit']}{phase_words(pos.get('phase'))}"
    if pos.get("done"):
        return f"end of {where}"
    return f"{where}: {where_words(pos['epoch'], pos['n_epoch'], pos['batch'], pos['n_iter'])}"

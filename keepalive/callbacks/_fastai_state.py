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
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from fastai.callback.schedule import ParamScheduler
from fastai.callback.tracker import TrackerCallback
from fastai.learner import Learner
from fastai.optimizer import Optimizer, OptimWrapper
from fastcore.foundation import L

from .. import notebook
from ..errors import StateMismatchError
from ..state import frozen_copy  # loaded tensors are views on the file buffer: what is kept gets copies
from . import _compat_fastai as fc
from ._fastai_data import dl_rngs
from .torchstate import check_module, check_optimizer

__all__ = ["capture_objects", "check_fits", "restore", "capture_callbacks", "describe", "phase_words",
           "fine_tune_phase", "epochs", "where_words", "cell_identity", "FitLog"]


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
    else:
        opt_state = opt.state_dict()
    objects = {"model": learn.model.state_dict(), "optimizer": _plain(opt_state)}
    scaler = getattr(learn, "scaler", None)
    if scaler is not None:
        objects["scaler"] = scaler.state_dict()
    return objects


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


def _load_objects(learn: Learner, objects: Dict[str, Any], frozen_idx: Optional[int]) -> None:
    learn.model.load_state_dict(objects["model"])
    opt, saved = learn.opt, objects["optimizer"]
    if isinstance(opt, Optimizer):
        params = [p for p, *_ in opt.all_params()]
        state = [{k: (v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else frozen_copy(v))
                  for k, v in s.items()} for s, p in zip(saved["state"], params)]
        opt.load_state_dict({"state": state, "hypers": L([dict(h) for h in saved["hypers"]])})
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


class FitLog:
    """The run's fit calls in order, each identified so that it is recognised after a restart.

    A fit is ``{"cell": hash of its notebook cell's source, "key": that cell execution, "index": its
    number within the execution, "phase": fine_tune's 1 / 2 or None}``; outside a notebook cell and key
    are None and the index counts this callback's fits (a script runs them all again). The list is
    saved with every checkpoint: fit N of the run is its entry N. Why not count the process's fits:
    after a restart a notebook user runs the setup cell and only the cell that was training (as
    ``%resume_training`` does); that cell's fit must still be recognised as the run's fit N.
    """

    def __init__(self) -> None:
        self.entries: List[Dict[str, Any]] = []
        self.cursor = 0             # entries before it are matched or passed in this process
        self._own: Dict[str, Any] = {"key": None, "fits": 0}  # outside a notebook
        self._counter = self._own   # the counter of the last fit

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        """Start over from a checkpoint's ``fastai`` tree (None: a new run)."""
        entries: Any = (saved or {}).get("fits")
        if entries is None and saved is not None:  # written before fits were recorded: by number
            entries = [{"cell": None, "key": None, "index": i + 1}
                       for i in range(int(saved["position"]["fit"]))]
        self.entries = [dict(e) for e in entries or []]
        self.cursor = 0

    def next_id(self) -> Dict[str, Any]:
        """The identity of a fit call starting now."""
        cell, key = cell_identity()
        counter = self._counter = self._own if key is None else _CELL_FITS
        if counter["key"] != key:
            counter["key"], counter["fits"] = key, 0
        counter["fits"] += 1
        return {"cell": cell, "key": key, "index": counter["fits"]}

    def restart_cell(self) -> None:
        """The fit was interrupted: running the cell again starts over from its first fit."""
        self._counter["fits"] = 0

    def find(self, fit: Dict[str, Any]) -> Optional[int]:
        """The run's number of ``fit`` among the entries from the cursor on, or None (a new fit).

        The same execution first (``%resume_training`` re-runs the recorded one), then the same cell
        source and index: the same cell run twice in a run is matched in order.
        """
        rest = range(self.cursor, len(self.entries))

        def same(j: int, field: str) -> bool:
            e = self.entries[j]
            return e.get(field) == fit[field] and int(e.get("index", 0)) == fit["index"]

        hit = next((j for j in rest if fit["key"] is not None and same(j, "key")), None)
        if hit is None:
            hit = next((j for j in rest if same(j, "cell")), None)
        if hit is None:
            return None
        self.cursor = hit + 1
        return hit + 1

    def find_like(self, fit: Dict[str, Any], current: int, phase: Optional[int]) -> Optional[int]:
        """A fit of a cell the run has not seen (another cell, or the same one edited, e.g. a demo
        cell that interrupted itself and a plain cell that resumes): the run's fit at the same place,
        and of the same ``fine_tune`` phase, in the cell execution of the checkpoint's fit ``current``."""
        if not 0 < current <= len(self.entries):
            return None
        e = self.entries[current - 1]
        same = [j for j, x in enumerate(self.entries)
                if x.get("key") == e.get("key") and x.get("cell") == e.get("cell")]
        if not 0 < fit["index"] <= len(same):
            return None
        j = same[fit["index"] - 1]
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
    (as keepalive's counters: "epoch 2" in a resume line is 2 epochs done), never 0-based indices."""
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

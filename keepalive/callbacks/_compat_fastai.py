"""The fastai internals the fastai adapter relies on (``fastai.py``, ``_fastai_state.py``,
``_fastai_data.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with fastai 2.8.12 (fastcore 2.2). The range is fastai 2.8.x: the event routing through
``Learner._with_events``, the ``DataLoader`` / ``_FakeLoader`` split and the tracker callbacks' attributes
are older than 2.8, but 2.8 is the first release tested with torch 2.x loaders as used here.
"""
from __future__ import annotations

from typing import Any, Callable, List

from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger, ProgressCallback
from fastai.callback.schedule import ParamScheduler
from fastai.callback.tracker import EarlyStoppingCallback, ReduceLROnPlateau, SaveModelCallback, TrackerCallback
from fastai.callback.training import GradientAccumulation
from fastai.data import load
from fastai.learner import AvgSmoothLoss, Learner
from fastai.optimizer import Optimizer, OptimWrapper

from ._compat import Framework, Internal, Package, code_consts, code_names, given, has, local, module_has, param, uses

__all__ = ["COMPAT", "WITH_EVENTS", "FIT_EVENT", "EPOCH_EVENT", "BATCH_EVENT", "STEP_EVENT", "VALIDATE_EVENT",
           "FINE_TUNE", "TRACKER_ATTRS", "ORDER_METHODS"]

#: the Learner method every event runs through: replaced on the learner instance while attached
WITH_EVENTS = "_with_events"
#: the event names the Learner passes to it for a fit, an epoch and a batch
FIT_EVENT, EPOCH_EVENT, BATCH_EVENT = "fit", "epoch", "batch"
#: the events around the optimizer step (before_step callbacks, Learner._step, after_step) and
#: around an epoch's validation (before_validate callbacks, its batches, after_validate)
STEP_EVENT, VALIDATE_EVENT = "step", "validate"
#: the Learner method whose frame says a fit is fine_tune's frozen or unfrozen one
FINE_TUNE = "fine_tune"
#: what the tracker callbacks (SaveModelCallback, EarlyStoppingCallback, ReduceLROnPlateau) keep
TRACKER_ATTRS = ("best", "wait", "new_best", "last_saved_path")
#: the DataLoader methods that make an epoch's order: a loader overriding one cannot be positioned
ORDER_METHODS = ("get_idxs", "shuffle_fn", "sample", "create_batches", "chunkify", "randomize")

_TRACKERS = {"best": TrackerCallback, "new_best": TrackerCallback, "wait": EarlyStoppingCallback,
             "last_saved_path": SaveModelCallback}


def _passes(event: str) -> Callable[[], bool]:
    """The Learner's code hands this event name to ``_with_events``."""
    return lambda: event in code_consts(Learner) and WITH_EVENTS in code_names(Learner)


def _stored(get: Callable[[], Any], name: str) -> Callable[[], bool]:
    """The class ``get()`` reads or sets ``name``, also through fastcore's ``store_attr('a,b,...')``."""
    return lambda: name in code_names(get()) or any(name in k.replace(" ", "").split(",")
                                                    for k in code_consts(get()))


def _base_optimizer() -> Any:
    from fastai.optimizer import _BaseOptimizer

    return _BaseOptimizer


def _fake_loader() -> Any:
    return load._FakeLoader


def _internals() -> List[Internal]:
    F, S, D = "fastai.py", "_fastai_state.py", "_fastai_data.py"
    rows = [
        Internal(f"Learner.{WITH_EVENTS}", "every event (fit, epoch, batch) runs through it: replaced on the "
                 "learner instance while the callback is attached", f"{F}: DriveCheckpoint.learn, _EventsHook",
                 lambda: has(lambda: Learner, WITH_EVENTS)()
                 and param(lambda: getattr(Learner, WITH_EVENTS), "f", "event_type", "ex", "final")(),
                 token="WITH_EVENTS"),
        Internal(f"Learner event '{FIT_EVENT}'", "a fit call, as _with_events sees it", f"{F}: DriveCheckpoint._events",
                 _passes(FIT_EVENT), token="FIT_EVENT"),
        Internal(f"Learner event '{EPOCH_EVENT}'", "an epoch, as _with_events sees it",
                 f"{F}: DriveCheckpoint._events", _passes(EPOCH_EVENT), token="EPOCH_EVENT"),
        Internal(f"Learner event '{BATCH_EVENT}'", "a batch, as _with_events sees it",
                 f"{F}: DriveCheckpoint._events", _passes(BATCH_EVENT), token="BATCH_EVENT"),
        Internal(f"Learner event '{STEP_EVENT}'", "the optimizer step, as _with_events sees it (before any "
                 "before_step callback): a lazy snapshot's background copy is settled there",
                 f"{F}: DriveCheckpoint._events", _passes(STEP_EVENT), token="STEP_EVENT"),
        Internal(f"Learner event '{VALIDATE_EVENT}'", "an epoch's validation, as _with_events sees it (before "
                 "any before_validate callback): a lazy snapshot's background copy is settled there",
                 f"{F}: DriveCheckpoint._events", _passes(VALIDATE_EVENT), token="VALIDATE_EVENT"),
        Internal("Optimizer.param_lists / state", "fastai's optimizer's parameters and per-parameter state, "
                 "copied in the background by a lazy snapshot until the next step event",
                 f"{S}: optimizer_tensors", lambda: uses(lambda: Optimizer, "param_lists", "state")()
                 and uses(lambda: OptimWrapper, "opt")(), token="param_lists"),
        Internal(f"Learner.{FINE_TUNE} local 'self'", "the frame walked up to: a fit inside fine_tune is its "
                 "frozen or unfrozen phase", f"{S}: fine_tune_phase",
                 local(lambda: getattr(Learner, FINE_TUNE), "self", unwrap=False), token="FINE_TUNE"),
        Internal("Learner.add_cb / remove_cb set cb.learn", "the callback's learn setter installs and removes "
                 "its _with_events hook", f"{F}: DriveCheckpoint.learn",
                 lambda: "learn" in code_names(Learner.add_cb) and "learn" in code_names(Learner.remove_cb),
                 token="@learn.setter"),
        Internal("Callback._stateattrs", "attributes left out when a learner is pickled (learn.export())",
                 f"{F}: DriveCheckpoint", has(lambda: Callback, "_stateattrs")),
        Internal("_BaseOptimizer.frozen_idx", "the freeze state (saved, restored; fine_tune's phase)",
                 f"{S}: capture_callbacks, fine_tune_phase", uses(_base_optimizer, "frozen_idx")),
        Internal("GradientAccumulation.count", "micro-batches accumulated (no save while any are pending), found "
                 "as learn.gradient_accumulation", f"{F}: DriveCheckpoint._step_end",
                 lambda: uses(lambda: GradientAccumulation, "count")()
                 and GradientAccumulation().name == "gradient_accumulation", token='"gradient_accumulation"'),
        Internal("AvgSmoothLoss.count", "the smoothed loss' step count (saved, restored)", f"{S}: _capture_recorder",
                 uses(lambda: AvgSmoothLoss, "count"), token="smooth_loss.count"),
        Internal("AvgSmoothLoss.val", "the smoothed loss' value (saved, restored)", f"{S}: _capture_recorder",
                 uses(lambda: AvgSmoothLoss, "val"), token="smooth_loss.val"),
        Internal("ParamScheduler.hps", "the schedule's record of hyper-parameters (saved, restored)",
                 f"{S}: capture_callbacks", uses(lambda: ParamScheduler, "hps"), token="sched.hps"),
        Internal("DataLoader._DataLoader__idxs", "the epoch's order, computed in the main process",
                 f"{D}: _indices", uses(lambda: load.DataLoader, "_DataLoader__idxs")),
        Internal("DataLoader.offs", "a worker's share of the batches (set by fastai's _wif)", f"{D}: _indices",
                 lambda: "offs" in code_names(load.DataLoader) and "offs" in code_names(load._wif), token="dl.offs"),
        Internal("DataLoader.rng", "the loader's random.Random: its epoch order (saved, restored)",
                 f"{D}: dl_rngs", uses(lambda: load.DataLoader, "rng"), token='"rng"'),
        Internal("DataLoader.fake_l", "the _FakeLoader torch's DataLoader iterates (its class is swapped)",
                 f"{D}: positionable, install", uses(lambda: load.DataLoader, "fake_l")),
        Internal("fastai.data.load._FakeLoader", "subclassed: iterates an epoch from any batch",
                 f"{D}: _PositionedLoader", module_has("fastai.data.load", "_FakeLoader")),
        Internal("_FakeLoader._index_sampler", "what torch's iterator counts batches with (replaced: its first "
                 "next(), once the iterator is made, puts back a resumed step's random state)",
                 f"{D}: _Counter, install", has(_fake_loader, "_index_sampler"), token="fl._index_sampler"),
        Internal("fastai.data.load._wif", "seeds each worker (set_seed) and sets its share of the batches: "
                 "a resumed epoch's workers get the saved states over it", f"{D}: _WorkerStates",
                 module_has("fastai.data.load", "_wif"), token="_wif"),
        Internal("CSVLogger.file", "the open log file (its text saved; rewritten at a resume: before_fit "
                 "truncated it)", f"{S}: capture_loggers, restore_loggers", uses(lambda: CSVLogger, "file"),
                 token='"file"'),
        Internal("CSVLogger.fname", "the log file's name under learn.path", f"{S}: _csv_loggers, _log_file",
                 uses(lambda: CSVLogger, "fname"), token="cb.fname"),
        Internal("ParamScheduler.scheds", "the fit's schedule functions, sampled for the fit's plan",
                 f"{S}: fit_plan", uses(lambda: ParamScheduler, "scheds"), token="cb.scheds", required=False),
        Internal("ProgressCallback.mbar", "the epoch bar, shown from the resumed epoch (display only)",
                 f"{F}: DriveCheckpoint._begin", uses(lambda: ProgressCallback, "mbar"), required=False),
    ]
    rows += [Internal(f"_FakeLoader.{a}", "read by the positioned loader", f"{D}: _indices, positionable",
                      _stored(_fake_loader, a), token=t)
             for a, t in (("d", "self.d"), ("num_workers", "fake_l.num_workers"),
                          ("persistent_workers", "persistent_workers"))]
    rows += [Internal(f"{_TRACKERS[a].__name__}.{a}", "tracker state (saved, restored)", f"{S}: capture_callbacks",
                      uses(given(_TRACKERS[a]), a), token="TRACKER_ATTRS")
             for a in TRACKER_ATTRS]
    rows += [Internal("ReduceLROnPlateau.wait", "tracker state (saved, restored)", f"{S}: capture_callbacks",
                      uses(lambda: ReduceLROnPlateau, "wait"), token="TRACKER_ATTRS")]
    rows += [Internal(f"DataLoader.{m}", "compared with fastai's own: an override makes another order",
                      f"{D}: positionable", has(lambda: load.DataLoader, m), token="ORDER_METHODS")
             for m in ORDER_METHODS]
    return rows


COMPAT = Framework("fastai", [Package("fastai", "fastai", ">=2.8,<2.9")], _internals)

"""The fastai internals the fastai adapter relies on (``fastai.py``, ``_fastai_state.py``,
``_fastai_data.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with fastai 2.8.12 (fastcore 2.2). The range is fastai 2.8.x: the event routing through
``Learner._with_events``, the ``DataLoader`` / ``_FakeLoader`` split and the tracker callbacks' attributes
are older than 2.8, but 2.8 is the first release tested with torch 2.x loaders as used here.
"""
from __future__ import annotations

from typing import Tuple

from fastai.callback.progress import CSVLogger, ProgressCallback
from fastai.callback.schedule import ParamScheduler
from fastai.callback.tracker import EarlyStoppingCallback, ReduceLROnPlateau, SaveModelCallback, TrackerCallback
from fastai.callback.training import GradientAccumulation
from fastai.learner import AvgSmoothLoss

from ._compat import Check, Framework, Internal, Package, has, local, param, says, stores, uses

__all__ = ["COMPAT", "INTERNALS", "WITH_EVENTS", "FIT_EVENT", "EPOCH_EVENT", "BATCH_EVENT", "STEP_EVENT",
           "VALIDATE_EVENT", "FINE_TUNE", "TRACKER_ATTRS", "ORDER_METHODS"]

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

# where the internals live, as the checks name them ("module:Class", imported when a check runs),
# and the adapter's files that use them
_LEARNER = "fastai.learner:Learner"
_LOAD = "fastai.data.load"
_LOADER, _FAKE = f"{_LOAD}:DataLoader", f"{_LOAD}:_FakeLoader"
_F, _S, _D = "fastai.py", "_fastai_state.py", "_fastai_data.py"


def _passes(event: str) -> Tuple[Check, Check]:
    """The Learner's code hands this event name to ``_with_events``."""
    return says(_LEARNER, event), uses(_LEARNER, WITH_EVENTS)


def _accumulation_named() -> bool:
    """GradientAccumulation is found on the learner as ``learn.gradient_accumulation``."""
    return GradientAccumulation().name == "gradient_accumulation"


#: the internals, as a table: name, what the adapter does with it, where, the check
INTERNALS = (
    Internal(f"Learner.{WITH_EVENTS}", "every event (fit, epoch, batch) runs through it: replaced on the "
             "learner instance while the callback is attached", f"{_F}: DriveCheckpoint.learn, _EventsHook",
             (has(_LEARNER, WITH_EVENTS), param(f"{_LEARNER}.{WITH_EVENTS}", "f", "event_type", "ex", "final")),
             token="WITH_EVENTS"),
    Internal(f"Learner event '{FIT_EVENT}'", "a fit call, as _with_events sees it", f"{_F}: DriveCheckpoint._events",
             _passes(FIT_EVENT), token="FIT_EVENT"),
    Internal(f"Learner event '{EPOCH_EVENT}'", "an epoch, as _with_events sees it",
             f"{_F}: DriveCheckpoint._events", _passes(EPOCH_EVENT), token="EPOCH_EVENT"),
    Internal(f"Learner event '{BATCH_EVENT}'", "a batch, as _with_events sees it",
             f"{_F}: DriveCheckpoint._events", _passes(BATCH_EVENT), token="BATCH_EVENT"),
    Internal(f"Learner event '{STEP_EVENT}'", "the optimizer step, as _with_events sees it (before any "
             "before_step callback): a lazy snapshot's background copy is settled there",
             f"{_F}: DriveCheckpoint._events", _passes(STEP_EVENT), token="STEP_EVENT"),
    Internal(f"Learner event '{VALIDATE_EVENT}'", "an epoch's validation, as _with_events sees it (before "
             "any before_validate callback): a lazy snapshot's background copy is settled there",
             f"{_F}: DriveCheckpoint._events", _passes(VALIDATE_EVENT), token="VALIDATE_EVENT"),
    Internal("Optimizer.param_lists / state", "fastai's optimizer's parameters and per-parameter state, "
             "copied in the background by a lazy snapshot until the next step event", f"{_S}: optimizer_tensors",
             (uses("fastai.optimizer:Optimizer", "param_lists", "state"), uses("fastai.optimizer:OptimWrapper", "opt")),
             token="param_lists"),
    Internal(f"Learner.{FINE_TUNE} local 'self'", "the frame walked up to: a fit inside fine_tune is its "
             "frozen or unfrozen phase", f"{_S}: fine_tune_phase",
             local(f"{_LEARNER}.{FINE_TUNE}", "self", unwrap=False), token="FINE_TUNE"),
    Internal("Learner.add_cb / remove_cb set cb.learn", "the callback's learn setter installs and removes "
             "its _with_events hook", f"{_F}: DriveCheckpoint.learn",
             (uses(f"{_LEARNER}.add_cb", "learn"), uses(f"{_LEARNER}.remove_cb", "learn")), token="@learn.setter"),
    Internal("Callback._stateattrs", "attributes left out when a learner is pickled (learn.export())",
             f"{_F}: DriveCheckpoint", has("fastai.callback.core:Callback", "_stateattrs")),
    Internal("_BaseOptimizer.frozen_idx", "the freeze state (saved, restored; fine_tune's phase)",
             f"{_S}: capture_callbacks, fine_tune_phase", uses("fastai.optimizer:_BaseOptimizer", "frozen_idx")),
    Internal("GradientAccumulation.count", "micro-batches accumulated (no save while any are pending), found "
             "as learn.gradient_accumulation", f"{_F}: DriveCheckpoint._step_end",
             (uses(GradientAccumulation, "count"), _accumulation_named), token='"gradient_accumulation"'),
    Internal("AvgSmoothLoss.count", "the smoothed loss' step count (saved, restored)", f"{_S}: _capture_recorder",
             uses(AvgSmoothLoss, "count"), token="smooth_loss.count"),
    Internal("AvgSmoothLoss.val", "the smoothed loss' value (saved, restored)", f"{_S}: _capture_recorder",
             uses(AvgSmoothLoss, "val"), token="smooth_loss.val"),
    Internal("ParamScheduler.hps", "the schedule's record of hyper-parameters (saved, restored)",
             f"{_S}: capture_callbacks", uses(ParamScheduler, "hps"), token="sched.hps"),
    Internal("DataLoader._DataLoader__idxs", "the epoch's order, computed in the main process",
             f"{_D}: _indices", uses(_LOADER, "_DataLoader__idxs")),
    Internal("DataLoader.offs", "a worker's share of the batches (set by fastai's _wif)", f"{_D}: _indices",
             (uses(_LOADER, "offs"), uses(f"{_LOAD}:_wif", "offs")), token="dl.offs"),
    Internal("DataLoader.rng", "the loader's random.Random: its epoch order (saved, restored)",
             f"{_D}: dl_rngs", uses(_LOADER, "rng"), token='"rng"'),
    Internal("DataLoader.fake_l", "the _FakeLoader torch's DataLoader iterates (its class is swapped)",
             f"{_D}: positionable, install", uses(_LOADER, "fake_l")),
    Internal("fastai.data.load._FakeLoader", "subclassed: iterates an epoch from any batch",
             f"{_D}: _PositionedLoader", has(_LOAD, "_FakeLoader")),
    Internal("_FakeLoader._index_sampler", "what torch's iterator counts batches with (replaced: its first "
             "next(), once the iterator is made, puts back a resumed step's random state)",
             f"{_D}: _Counter, install", has(_FAKE, "_index_sampler"), token="fl._index_sampler"),
    Internal("fastai.data.load._wif", "seeds each worker (set_seed) and sets its share of the batches: "
             "a resumed epoch's workers get the saved states over it", f"{_D}: _PositionedLoader",
             has(_LOAD, "_wif"), token="_wif"),
    Internal("CSVLogger.file", "the open log file (its text saved; rewritten at a resume: before_fit "
             "truncated it)", f"{_S}: capture_loggers, restore_loggers", uses(CSVLogger, "file"), token='"file"'),
    Internal("CSVLogger.fname", "the log file's name under learn.path", f"{_S}: _csv_loggers, _log_file",
             uses(CSVLogger, "fname"), token="cb.fname"),
    Internal("ParamScheduler.scheds", "the fit's schedule functions, sampled for the fit's plan",
             f"{_S}: fit_plan", uses(ParamScheduler, "scheds"), token="cb.scheds", required=False),
    Internal("ProgressCallback.mbar", "the epoch bar, shown from the resumed epoch (display only)",
             f"{_F}: DriveCheckpoint._begin", uses(ProgressCallback, "mbar"), required=False),
    *(Internal(f"_FakeLoader.{a}", "read by the positioned loader", f"{_D}: _indices, positionable",
               stores(_FAKE, a), token=t)
      for a, t in (("d", "self.d"), ("num_workers", "fake_l.num_workers"),
                   ("persistent_workers", "persistent_workers"))),
    *(Internal(f"{_TRACKERS[a].__name__}.{a}", "tracker state (saved, restored)", f"{_S}: capture_callbacks",
               uses(_TRACKERS[a], a), token="TRACKER_ATTRS")
      for a in TRACKER_ATTRS),
    Internal("ReduceLROnPlateau.wait", "tracker state (saved, restored)", f"{_S}: capture_callbacks",
             uses(ReduceLROnPlateau, "wait"), token="TRACKER_ATTRS"),
    *(Internal(f"DataLoader.{m}", "compared with fastai's own: an override makes another order",
               f"{_D}: positionable", has(_LOADER, m), token="ORDER_METHODS")
      for m in ORDER_METHODS),
)


COMPAT = Framework("fastai", [Package("fastai", "fastai", ">=2.8,<2.9")], INTERNALS)

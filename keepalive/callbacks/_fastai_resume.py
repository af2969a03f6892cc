"""A checkpoint put into the running fastai fit it belongs to (for the fastai ``DriveCheckpoint``).

At the fit's start (after every callback's ``before_fit``): the learner's state, the loggers' files,
the training iterations and the epochs to skip; at an epoch end the loaders' and the global RNGs at
once, inside an epoch at the start of that epoch's training (:func:`resume_epoch`: the schedule's
position, the batches already done, the loader's random states). A fit whose plan changed since the
checkpoint follows the code from the work done (:class:`keepalive.plan.Resumed`), said once.

Why a module of its own: restoring is one job with its own order (what must wait for which event);
the callback's hooks only say when.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from fastai.learner import Learner

from ..core import Checkpointer
from ..plan import Resumed, schedule_position
from ..statetree import StateTree
from . import _fastai_data as data
from . import _fastai_state as state
from ._fastai_fits import FitState, ValidSplit, plan_words

__all__ = ["restore_in_fit", "resume_epoch"]


def restore_in_fit(core: Checkpointer, log: state.FitLog, learn: Learner, st: FitState, tree: StateTree) -> None:
    """Put a loaded tree into the running fit ``st``: model, optimizer, schedule position, callbacks'
    states, Recorder, the DataLoaders' and global RNGs (inside an epoch: at its saved batch, later)."""
    fa = tree["fastai"]
    pos = fa["position"]
    if pos["batch"]:  # inside an epoch: this loader must start there exactly
        data.check_resumable(pos["n_iter"], st.n_iter, st.why_not)
    _say_plan_changes(core, log, learn, st, tree)
    state.restore(learn, tree, warn=lambda msg, key: core.warn(msg, key=key))
    state.restore_loggers(learn, fa)
    ValidSplit.check(core, tree)
    learn.train_iter = int(pos["train_iter"])
    st.skip_until = st.epochs_done = int(pos["epoch"])
    if pos["batch"]:
        st.resume_mid = tree
    else:
        data.set_dl_rngs(learn, fa.get("dl_rngs"))
        core.restore_rng(tree)
    where = state.where_words(pos["epoch"], learn.n_epoch, pos["batch"], pos["n_iter"])
    core.say(f"fit {st.index}{state.phase_words(st.phase)} continues: {where}")


def _say_plan_changes(core: Checkpointer, log: state.FitLog, learn: Learner, st: FitState, tree: StateTree) -> None:
    """The resumed fit's plan is not the checkpoint's: the code's wins (fastai runs the fit's
    epochs and schedule as the code gives them; the position is the work done), said once."""
    pos = tree["fastai"]["position"]
    saved = log.plan_of(st.index) or dict(tree.get("plan") or {}) or {"epochs": pos["n_epoch"]}
    resumed = Resumed(saved=saved, now=st.plan, done=int(pos["epoch"]), keys=state.FIT_PLAN_KEYS)
    log.replan(st.index, st.plan)
    if not resumed.changed:
        return
    was = int(saved.get("epochs", pos["n_epoch"]))
    where = state.where_words(min(pos["epoch"], learn.n_epoch), learn.n_epoch, pos["batch"], pos["n_iter"])
    if resumed.complete:
        outcome = f"{state.epochs(pos['epoch'])} are done, so the fit ends here"
    else:
        outcome = f"the fit goes on from {where} with the code's schedule at that point"
    core.warn(f"fit {st.index}{state.phase_words(st.phase)} was planned otherwise before the restart "
              f"({plan_words(resumed.changed)}): the code's plan wins, {outcome}. To finish the saved "
              f"plan instead, run the fit as before the restart ({state.epochs(was)}, the same "
              "learning rates); to train the new plan from the start, use another run (path or run=).",
              key=f"fastai-plan-{st.index}")


def resume_epoch(core: Checkpointer, learn: Learner, st: FitState, mid: StateTree) -> Optional[Dict[str, Any]]:
    """The training of the epoch a mid-epoch checkpoint ``mid`` is in begins: the schedule's
    position, the batches done, the loader's random states as saved. The epoch's start RNGs (for the
    next checkpoints of this epoch)."""
    pos = mid["fastai"]["position"]
    # the schedule's position: as saved, or (the code changed the fit's epochs) the same work done
    # placed on the code's epochs
    learn.pct_train = schedule_position(saved_epochs=pos["n_epoch"], epochs=learn.n_epoch,
                                        saved_position=pos["pct_train"], steps_done=pos["train_iter"],
                                        steps_per_epoch=st.n_iter)
    st.iter_offset = int(pos["batch"])
    start = mid["fastai"]["epoch_start"]
    workers = mid["fastai"].get("workers")
    num_workers = st.dl.fake_l.num_workers
    if "rng" not in start and num_workers > 0:
        core.warn("this checkpoint was written by an older keepalive, which seeded DataLoader workers "
                  "per batch: the resumed epoch has the saved order, but its random draws differ "
                  "from the uninterrupted run's", key="fastai-old-epoch-start")
    if workers and int(start.get("workers", num_workers)) != num_workers:
        core.warn(f"the checkpoint was written with {start['workers']} DataLoader workers, this "
                  f"training has {num_workers}: the rest of the resumed epoch's "
                  "augmentation in workers differs from the uninterrupted run's (the order is "
                  "the same)", key="fastai-workers-changed")
    return data.resume_epoch(learn, st.dl, start, st.iter_offset, workers, lambda: core.restore_rng(mid))

"""The checkpoint of a running fastai fit, as a state tree (for the fastai ``DriveCheckpoint``).

The learner's objects and callbacks' state (:mod:`._fastai_state`), and the ``fastai`` part that says
where the fit stands: the run's fits recorded so far (:class:`._fastai_state.FitLog`), the position
(fit, phase, epochs and batches done, the schedule's position) and, inside an epoch, the random states
the epoch's data began with and those the loader's workers start the next batches from.

Why a module of its own: what a checkpoint of fastai holds is read in one place, apart from the hooks
that decide when one is taken.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from fastai.learner import Learner

from ..core import Checkpointer
from ..statetree import Captured
from . import _fastai_data as data
from . import _fastai_state as state
from ._fastai_fits import At, FitState

__all__ = ["FORMAT", "fit_tree"]

FORMAT = 2  # 2: the run's fits are recorded ("fits"); 1 numbered them by process


def fit_tree(core: Checkpointer, log: state.FitLog, learn: Learner, st: FitState, kind: str,
             at: Optional[At] = None) -> Captured:
    """The running fit's checkpoint at a ``kind`` of boundary ("step", "epoch", "fit": its end);
    ``at``: where the boundary the capture was made for left the fit (else read from the learner)."""
    objects = state.capture_objects(learn)
    train_iter, pct_train = int(getattr(learn, "train_iter", 0)), float(getattr(learn, "pct_train", 0.0))
    if at is not None:
        epoch, batch, train_iter, pct_train = at.epoch, at.batch, at.train_iter, at.pct_train
    elif kind == "step":
        epoch, batch = learn.epoch, learn.iter + 1
    elif kind == "epoch":
        epoch, batch = learn.epoch + 1, 0
    else:
        epoch, batch = st.epochs_done, 0
    fa: Dict[str, Any] = {
        "format": FORMAT,
        "fits": log.upto(st.index),
        "position": {"fit": st.index, "phase": st.phase, "done": kind == "fit", "epoch": epoch,
                     "batch": batch, "n_epoch": int(learn.n_epoch), "n_iter": st.n_iter,
                     "train_iter": train_iter, "pct_train": pct_train},
        **state.capture_callbacks(learn),
    }
    if at is not None and at.dl_rngs is not None:
        fa["dl_rngs"] = at.dl_rngs
    if kind == "step":
        fa["epoch_start"] = st.epoch_start
        workers = data.worker_states(st.dl, batch, st.n_iter)
        if workers is None:
            core.warn("a DataLoader worker did not start the batches after this checkpoint's in "
                      f"{data.STATE_WAIT_S:.0f} s: a resume from it replays the order, but not the "
                      "random draws (augmentation) in workers", key="fastai-worker-states")
        elif workers:
            fa["workers"] = workers
    return {"objects": objects, "fastai": fa}

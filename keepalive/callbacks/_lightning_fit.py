"""Where a Lightning fit starts and where it ends, as the Lightning adapter sees it.

The checkpoint that fits this module (:func:`check_fits`), the position the training data resumes from
(:func:`position_data`), a fit that had finished (:func:`finished_fit`), the last epoch of this fit's plan
(:func:`is_last_epoch`) and the deadline's clean stop (:func:`stop`). The adapter
(:mod:`keepalive.callbacks.lightning`) calls them at setup and at its boundaries.
"""
from __future__ import annotations

from typing import Any, Dict

from ..core import Checkpointer
from ..errors import StateMismatchError
from ..statetree import StateTree
from . import _lightning_data as data
from . import _lightning_messages as lmsg
from ._lightning_attach import StandIns
from .torchstate import check_module


def describe(tree: StateTree) -> str:
    """Words of its own for the core's resume line: none (the line says where the checkpoint lies, in
    epochs numbered as ``trainer.current_epoch`` numbers them, :func:`keepalive.runs.position`)."""
    return ""


def check_fits(tree: StateTree, pl_module: Any, where: str) -> None:
    """The checkpoint was written by this adapter and holds this module's parameters (else nothing loads)."""
    lt = tree.get("lightning")
    if not isinstance(lt, dict) or "checkpoint" not in lt:
        raise StateMismatchError(f"checkpoint {where} was not written by the Lightning DriveCheckpoint "
                                 f"(framework {tree.get('keepalive', {}).get('framework')!r}); use "
                                 "another run (path or run=)")
    check_module("model", pl_module, lt["checkpoint"].get("state_dict", {}), where)


def position_data(core: Checkpointer, train_data: data.TrainData, lt: Dict[str, Any], saved: Dict[str, Any]) -> None:
    """Tell the training loaders where the resumed pass starts: at the saved batch inside an epoch, or at
    the next epoch's order."""
    counters = core.counters
    if counters["batch"] and "loaders" not in saved:
        # a mid-epoch checkpoint of an older keepalive, which rebuilt the loader on its own order
        # (and had Lightning save that loader's state, which your loader cannot take)
        lt["checkpoint"].get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
        lmsg.tell_old_position(core, counters["epoch"], counters["batch"])
        train_data.resume_at(None, None)
    elif counters["batch"]:
        train_data.resume_at(saved["loaders"], None)
    else:
        train_data.resume_at(None, saved.get("generators"))


def reloads_loaders(trainer: Any, epoch: int) -> bool:
    """Lightning builds the training loaders anew for ``epoch`` (``reload_dataloaders_every_n_epochs``,
    counted from the fit's first epoch as an uninterrupted fit counts)."""
    n = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
    return n > 0 and epoch > 0 and epoch % n == 0


def finished_fit(core: Checkpointer, trainer: Any, lt: Dict[str, Any]) -> None:
    """The checkpoint is a fit's last: it ended early (EarlyStopping), or this plan has no more epochs."""
    if lt.get("should_stop"):
        trainer.should_stop = True  # it ended early (EarlyStopping): no more epochs now
    max_epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    if lt.get("should_stop") or (max_epochs is not None and core.counters["epoch"] >= max_epochs):
        core.already_complete(max_epochs)


def is_last_epoch(trainer: Any) -> bool:
    """The epoch that just ended is the fit's last (its epochs, its steps, or a stop Lightning accepts)."""
    fit_loop = trainer.fit_loop
    max_epochs, max_steps = fit_loop.max_epochs, fit_loop.max_steps
    if max_epochs not in (None, -1) and fit_loop.epoch_progress.current.processed >= max_epochs:
        return True
    if max_steps not in (None, -1) and trainer.global_step >= max_steps:
        return True
    return bool(trainer.should_stop and fit_loop._can_stop_early)


def stop(trainer: Any, stand_ins: StandIns) -> None:
    """The deadline: the state is saved; end the fit cleanly now (no validation first). The settings
    changed for that are put back when the fit ends (``stand_ins``)."""
    trainer.should_stop = True
    # a stop Lightning would refuse before min_epochs / min_steps, and a validation before it stops
    for obj, name, value in ((trainer.fit_loop, "min_epochs", 0), (trainer.fit_loop.epoch_loop, "min_steps", None),
                             (trainer, "limit_val_batches", 0)):
        stand_ins.change(obj, name, value)

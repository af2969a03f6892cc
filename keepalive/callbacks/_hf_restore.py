"""A loaded checkpoint put into the ``Trainer`` of one ``train()`` call: whether it fits (else nothing is
loaded), then the objects, the Trainer's state, the subclass's counters and where the data continues.

What a tree holds and how each part goes back: :mod:`keepalive.callbacks._hf_state` (objects, Trainer),
:mod:`keepalive.callbacks._hf_counters` (a subclass's own counters), :mod:`keepalive.callbacks._hf_position`
(the epoch order). The adapter (:mod:`keepalive.callbacks.transformers`) keeps what this returns: the
best model's weights, and where the training continues.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Type

from transformers import Trainer, TrainerState

from ..core import Checkpointer
from ..statetree import StateTree
from . import _hf_messages as hfmsg
from . import _hf_resume as hfresume
from . import _hf_state as hfstate
from ._hf_counters import SubclassCounters
from ._hf_position import DataPosition

__all__ = ["Restored", "load", "count_from_trainers", "check_fits", "put_back"]


class Restored(NamedTuple):
    """What the adapter keeps of a restored checkpoint."""

    best: Optional[hfstate.Best]     # the best model's trainable weights (load_best_model_at_end)
    complete: bool                   # the run had finished: nothing is trained
    resume: Optional[Dict[str, Any]]  # the epoch and batch the training continues at, and their replay
    rng_tree: Optional[Dict[str, Any]]  # the random states to put back at that point


def load(core: Checkpointer, trainer: Trainer, state: TrainerState, own: Optional[hfresume.TrainersResume],
         check: Callable[[StateTree], None], restore: Callable[[StateTree], None]) -> Tuple[bool, Optional[int]]:
    """Restore keepalive's newest checkpoint (``check``: whether it fits, ``restore``: put it back) unless
    the Trainer's own (``own``) is newer. Returns whether one was restored, and the step of keepalive's
    newest when the Trainer's won (None: keepalive has none)."""
    tree, newer = hfresume.load_newest(core, own, check)  # may refuse: nothing changed
    if tree is None:
        return False, newer
    hfresume.tell_plan(core, state)
    restore(tree)
    if own is not None:
        # keepalive's replaced what the Trainer loaded: as in a resume of keepalive's alone, the loss
        # average and the token rate cover the whole run
        trainer._initial_global_step = 0
        trainer._initial_num_input_tokens_seen = 0
        hfresume.say_replaced(core, own, hfresume.saved_step(tree))
    return True, newer


def count_from_trainers(core: Checkpointer, own: hfresume.TrainersResume, position: DataPosition,
                        keepalives: Optional[int]) -> None:
    """The Trainer resumed from its own checkpoint and keepalive's is older (at step ``keepalives``) or
    absent: keepalive's counters start where the Trainer's resume starts, and the user reads so."""
    c = core.counters
    c["epoch"], c["step"], c["batch"] = own.epoch, own.step, own.batches
    c["samples"] = position.batch_size * (own.epoch * position.steps_in_epoch + own.batches)
    hfresume.tell_continued(core, own, keepalives)


def check_fits(core: Checkpointer, trainer: Trainer, tree: StateTree, position: DataPosition) -> None:
    """The checkpoint's model, optimizer and data position fit this training (else it raises: nothing
    is loaded)."""
    where = core.loaded_url
    hfstate.check_trainer_fits(trainer, tree, where)
    hfresume.check_position_fits(tree.get("data") or {}, where=where, world=int(trainer.args.world_size),
                                 now=position.shape(trainer.args), positionable=position.positionable,
                                 obstacle=core.mid_epoch_obstacle)


def put_back(core: Checkpointer, trainer: Trainer, tree: StateTree, position: DataPosition,
             counters: Optional[SubclassCounters], skip: Type[Any]) -> Restored:
    """Model (its trainable part), optimizer, scheduler, scaler, ``TrainerState``, running loss sums,
    callbacks (``skip``: the checkpointing callback's class), the subclass's counters, the epoch order."""
    state = trainer.state
    hfstate.restore_objects(trainer, tree.get("objects") or {})
    hf = tree.get("hf") or {}
    best = hfstate.restore_trainer(trainer, state, hf, skip)
    if counters is not None:
        counters.restore(hf.get("counters"))
    data = tree.get("data") or {}
    position.restore_order(data)
    if hf.get("finished") and state.global_step < state.max_steps and hfresume.plan_extended(core):
        # a longer plan than the finished run's ("one more epoch"): continue from its final state
        hfstate.continue_finished(trainer, state)
    elif hf.get("finished"):
        hfmsg.say_already_complete(core, state.global_step)
        return Restored(best, True, None, None)
    resume = {"epoch": int(data.get("epoch", 0)), "batch": int(data.get("batch", 0)),
              "replay": data.get("replay") or {}}
    return Restored(best, False, resume, {"rng": tree.get("rng")})  # only the RNGs: the tensors are loaded

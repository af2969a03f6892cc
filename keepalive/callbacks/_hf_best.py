"""The best model of a ``Trainer`` run with ``load_best_model_at_end``: its trainable weights kept in
keepalive's checkpoint, and the Trainer's load of it at the end of ``train()``.

When the Trainer saves the new best checkpoint, its weights are kept (:func:`keep_best`), so that the best
model outlives a local ``output_dir`` lost with the VM. At the end of ``train()`` the Trainer loads the best
weights into the model, in place: :class:`BestModelLoader` stands in for that load. It first lets the
background copy of keepalive's last save finish (:func:`settle_before_loading`, as an optimizer step does:
that save must hold the last step's weights, and a copy that saw the best ones loaded would drop it and
say so), then loads from the Trainer's folder, or, when that folder is gone, from keepalive's checkpoint.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from transformers import Trainer, TrainerState, TrainingArguments

from ..core import Checkpointer
from . import _compat_transformers as hfc
from . import _hf_messages as hfmsg
from . import _hf_state as hfstate

__all__ = ["BestModelLoader", "keep_best", "settle_before_loading"]


def keep_best(trainer: Trainer, args: TrainingArguments, state: TrainerState,
              held: Optional[hfstate.Best]) -> Optional[hfstate.Best]:
    """The Trainer saved its own checkpoint: when it is the new best one, its trainable weights (on the
    CPU) and folder; else what was held."""
    best = state.best_model_checkpoint
    if not args.load_best_model_at_end or not best or state.best_global_step != state.global_step:
        return held
    if held is not None and held[0] == best:
        return held
    return best, {k: v.detach().to("cpu", copy=True)
                  for k, v in hfstate.trainable_state(hfstate.model_of(trainer)).items()}


def settle_before_loading(core: Checkpointer) -> None:
    """Before the best weights are copied into the model: the last save's background copy is finished."""
    core.settle_snapshot()


class BestModelLoader:
    """Stands in for ``trainer._load_best_model`` (``hfc.LOAD_BEST_MODEL``) during one ``train()`` call
    (see the module). ``active``: the callback is in this ``train()`` call; ``held``: the weights kept."""

    def __init__(self, core: Checkpointer, trainer: Trainer, active: Callable[[], bool],
                 held: Callable[[], Optional[hfstate.Best]]):
        self.core, self.trainer, self.active, self.held = core, trainer, active, held

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        load = getattr(type(trainer), hfc.LOAD_BEST_MODEL).__get__(trainer)
        if not self.active() or getattr(trainer, hfc.LOAD_BEST_MODEL) is not self:
            return load(*args, **kwargs)
        settle_before_loading(self.core)
        path = trainer.state.best_model_checkpoint
        if not path or os.path.isdir(path):
            return load(*args, **kwargs)
        held = self.held()
        if held is not None and held[0] == path:
            hfstate.load_weights(hfstate.model_of(trainer), held[1])
            hfmsg.say_best_loaded(self.core, trainer, path)
            return None
        hfmsg.tell_best_lost(self.core, path)
        return None

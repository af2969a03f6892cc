"""What of a ``transformers.Trainer`` a checkpoint holds, and how it is put back.

The objects (the model's trainable part, the optimizer, the LR scheduler, the grad scaler), the fields of
``TrainerState`` that make the run (:data:`~keepalive.callbacks._compat_transformers.STATE_FIELDS`), the
Trainer's running loss sums (so the first loss logged after a resume is the one an uninterrupted run
logs), the state of stateful callbacks (``EarlyStoppingCallback``'s patience) and the best model's
trainable weights. The adapter (:mod:`keepalive.callbacks.transformers`) decides when; this module knows
only what and where.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type

import torch
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState

from ..adapter import check_fits
from ..errors import StateMismatchError
from ..state import frozen_copy  # loaded tensors are views on the file buffer: what is kept gets copies
from ..statetree import StateTree
from . import _compat_transformers as hfc
from .torchstate import check_optimizer, state_summary

FORMAT = 1
#: the best model's trainable weights: (its Trainer checkpoint folder, weights)
Best = Tuple[str, Dict[str, Any]]


def model_of(trainer: Trainer) -> torch.nn.Module:
    if trainer.model is None:
        raise RuntimeError("the Trainer has no model")
    return trainer.model


def inner_optimizer(opt: Any) -> torch.optim.Optimizer:
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one


def trainable_state(model: torch.nn.Module) -> Dict[str, Any]:
    """What trains: with frozen parameters (PEFT / LoRA, a frozen backbone), only the rest."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_weights(model: torch.nn.Module, weights: Dict[str, Any]) -> Any:
    """Copy saved weights (a trainable part) into the model, each onto its parameter's device."""
    return model.load_state_dict({k: v.to(device=_device_of(model, k), copy=True) for k, v in weights.items()},
                                 strict=False)


def _device_of(model: torch.nn.Module, key: str) -> Any:
    try:
        return model.get_parameter(key).device
    except (AttributeError, TypeError):
        try:
            return model.get_buffer(key).device
        except (AttributeError, TypeError):
            return next(model.parameters()).device


def trainer_objects(trainer: Trainer) -> Dict[str, Any]:
    """The stateful objects of the training, by name: model, optimizer, scheduler, scaler."""
    objects: Dict[str, Any] = {"model": trainer.model, "optimizer": trainer.optimizer}
    if trainer.lr_scheduler is not None and hasattr(trainer.lr_scheduler, "state_dict"):
        objects["scheduler"] = trainer.lr_scheduler
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        objects["scaler"] = scaler
    return objects


# ------------------------------------------------------------------------------ stateful callbacks
def _exportable(trainer: Trainer, skip: Type[Any]) -> List[Any]:
    return [cb for cb in trainer.callback_handler.callbacks
            if isinstance(cb, ExportableState) and not isinstance(cb, skip)]


def callback_states(trainer: Trainer, skip: Type[Any]) -> Dict[str, Any]:
    """Stateful callbacks' attributes (EarlyStoppingCallback's patience counter, ...), by class and rank;
    ``skip``: the checkpointing callback's own class."""
    out: Dict[str, Any] = {}
    for cb in _exportable(trainer, skip):
        name = type(cb).__name__
        out.setdefault(name, []).append(dict((cb.state() or {}).get("attributes") or {}))
    return out


def restore_callback_states(trainer: Trainer, saved: Dict[str, Any], skip: Type[Any]) -> None:
    ranks: Dict[str, int] = {}
    for cb in _exportable(trainer, skip):
        name = type(cb).__name__
        i = ranks[name] = ranks.get(name, -1) + 1
        states = saved.get(name) or []
        if i < len(states):
            for attr, value in states[i].items():
                setattr(cb, attr, frozen_copy(value))


# ----------------------------------------------------------------------------------- capture
def capture(trainer: Trainer, *, finishing: bool, best: Optional[Best], skip: Type[Any]
            ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The tree's ``objects`` (state dicts) and ``hf`` (the Trainer's state beside them) parts."""
    objects = {name: (trainable_state(obj) if name == "model" else obj.state_dict())
               for name, obj in trainer_objects(trainer).items()}
    st = trainer.state
    hf = {
        "format": FORMAT,
        "state": {name: getattr(st, name) for name in hfc.STATE_FIELDS},
        "trainer": {"tr_loss": trainer._tr_loss.detach(),
                    "total_loss_scalar": float(trainer._total_loss_scalar),
                    "globalstep_last_logged": int(trainer._globalstep_last_logged),
                    "current_flos": float(trainer.current_flos)},
        "callbacks": callback_states(trainer, skip),
        "classes": {"model": type(trainer.model).__name__},
        "finished": finishing,
    }
    if best is not None:
        hf["best"] = {"path": best[0], "model": best[1]}
    return objects, hf


def fingerprint(trainer: Trainer, best: Optional[Best], skip: Type[Any]) -> Tuple[Any, ...]:
    """What :func:`capture` reads beside tensors, cheaply: changes when the Trainer's state moves on."""
    st = trainer.state
    return (state_summary(trainer.lr_scheduler), len(st.log_history), st.best_metric, st.best_global_step,
            st.best_model_checkpoint,
            st.total_flos, st.num_input_tokens_seen, float(trainer._total_loss_scalar),
            int(trainer._globalstep_last_logged), float(trainer.current_flos),
            repr(callback_states(trainer, skip)), best[0] if best is not None else None)


# ----------------------------------------------------------------------------------- restore
def check_trainer_fits(trainer: Trainer, tree: StateTree, where: str) -> None:
    """The checkpoint's model and optimizer fit this Trainer's (else nothing is loaded, said why)."""
    saved = tree.get("objects") or {}
    was = ((tree.get("hf") or {}).get("classes") or {}).get("model")
    if was is not None and was != type(trainer.model).__name__:
        raise StateMismatchError(f"model: the checkpoint {where} holds a {was}, this Trainer trains a "
                                 f"{type(trainer.model).__name__}. Nothing was loaded. Use another run "
                                 "(path or run=) for another model.")
    check_fits("model", trainable_state(model_of(trainer)), saved.get("model", {}), where=where,
               lacks="the model (or its trainable part, e.g. the LoRA adapters) differs")
    check_optimizer("optimizer", inner_optimizer(trainer.optimizer), saved.get("optimizer", {}))


def restore_objects(trainer: Trainer, objects: Dict[str, Any]) -> None:
    """Model (its trainable part), optimizer, scheduler, scaler."""
    live = trainer_objects(trainer)
    missing = load_weights(model_of(trainer), objects["model"])
    if missing.unexpected_keys:
        raise StateMismatchError(f"model: unexpected keys {missing.unexpected_keys[:3]} in the checkpoint")
    for name in ("optimizer", "scheduler", "scaler"):
        if name in live and name in objects:
            live[name].load_state_dict(frozen_copy(objects[name]))


def restore_trainer(trainer: Trainer, state: TrainerState, hf: Dict[str, Any], skip: Type[Any]
                    ) -> Optional[Best]:
    """``TrainerState``, the running loss sums and the stateful callbacks; returns the best weights kept."""
    for name, value in (hf.get("state") or {}).items():
        if name in hfc.STATE_FIELDS:
            setattr(state, name, frozen_copy(value))
    acc = hf.get("trainer") or {}
    if "tr_loss" in acc:
        trainer._tr_loss = acc["tr_loss"].to(device=trainer.args.device, copy=True)
        trainer._total_loss_scalar = float(acc["total_loss_scalar"])
        trainer._globalstep_last_logged = int(acc["globalstep_last_logged"])
        trainer.current_flos = float(acc["current_flos"])  # type: ignore[assignment]
    restore_callback_states(trainer, hf.get("callbacks") or {}, skip)
    best = hf.get("best")
    return (best["path"], frozen_copy(best["model"])) if best else None


def continue_finished(trainer: Trainer, state: TrainerState) -> None:
    """A longer plan than the finished run's ("one more epoch") continues from its final state, as the
    Trainer continues its own end-of-training checkpoint."""
    # the loss the Trainer's summary added at the end is not counted twice
    trainer._total_loss_scalar -= float(trainer._tr_loss.item())
    # a longer run logs one summary, at its end
    state.log_history = [e for e in state.log_history if "train_runtime" not in e]

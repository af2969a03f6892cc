"""What a plain-PyTorch ``DriveCheckpoint`` keeps of each step boundary for a save during an evaluation.

The loop people write (``for x, y in ckpt.batches(loader): ...`` then ``sched.step()`` then
``evaluate()``) changes state beside the tensors between its last step and its evaluation: the
scheduler's step count, the learning rate it writes into the optimizer's groups. A save made during
that evaluation (a SIGTERM, a cloud's notice, the deadline) takes that state as it was at the boundary,
from :class:`RegisteredState`, a :class:`keepalive.pauses.BoundaryPart`: the resumed loop steps the
scheduler again and evaluates, as the uninterrupted one did. What it keeps at each boundary is copied
without a tensor and only where it changed (a scheduler by its step count, an optimizer's groups by
their values); the tensors themselves (weights, buffers, optimizer state) are the core's to check by
their version counters. An object whose state cannot be copied stays in the adapter's fingerprint
(:meth:`TorchBoundary.unkept`): a change of it refuses the save, as before.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .. import pauses
from ..core import Checkpointer
from ..statetree import StateTree
from ._torch_objects import TorchObjects
from .torchstate import state_summary

__all__ = ["PAUSE_HINT", "RegisteredState", "TorchBoundary"]

#: what to change so that a save during an evaluation is possible (said with a refusal)
PAUSE_HINT = ("To have it saved at once during an evaluation, change the state's tensors (an EMA update, a "
              "forward pass in training mode that updates BatchNorm statistics) after the evaluation, not "
              "between the training batches and it")


def _scheduler_token(obj: Any) -> Optional[Tuple[Any, ...]]:
    """A scheduler's step counts and last learning rates (what a step changes), or None for an object
    that is no scheduler (its whole state is compared)."""
    inner = getattr(obj, "scheduler", obj)  # accelerate's wrapper
    if not isinstance(inner, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return None
    return inner.last_epoch, getattr(inner, "_step_count", None), id(getattr(inner, "_last_lr", None))


def _groups(opt: torch.optim.Optimizer, before: Optional[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The optimizer's hyperparameters per group (``state_dict()['param_groups']`` without ``params``),
    sharing what ``before`` holds where they did not change."""
    out = []
    for i, group in enumerate(opt.param_groups):
        was = before[i] if before is not None and i < len(before) else None
        out.append(pauses.kept_copy(group, was, leave=("params",)))
    return out


class RegisteredState(pauses.BoundaryPart):
    """The registered objects' state beside their tensors, at a step boundary: each optimizer's groups
    (their learning rates) and each other object's ``state_dict()`` but models' (tensors only)."""

    name = "the registered objects' state"

    def __init__(self, objects: TorchObjects, unkept: Set[str]):
        self.objects, self.unkept = objects, unkept

    def keep(self, before: Any) -> Dict[str, Tuple[str, Any, Any]]:
        """name -> (kind, token, kept): ``groups`` of an optimizer, ``state`` of another object."""
        was: Dict[str, Tuple[str, Any, Any]] = before or {}
        kept: Dict[str, Tuple[str, Any, Any]] = {}
        for name, obj in self.objects.objects.items():
            if isinstance(obj, torch.nn.Module):
                continue
            prev = was.get(name)
            if isinstance(obj, torch.optim.Optimizer):
                kept[name] = ("groups", None, _groups(obj, prev[2] if prev is not None else None))
                continue
            token = _scheduler_token(obj)
            if token is not None and prev is not None and prev[1] == token:
                kept[name] = prev  # not stepped since: nothing to copy
                continue
            try:
                kept[name] = ("state", token, pauses.kept_copy(obj.state_dict(), prev[2] if prev else None))
                self.unkept.discard(name)
            except pauses.Uncopyable:
                self.unkept.add(name)  # compared by the fingerprint instead: a change refuses the save
        return kept

    def put(self, tree: StateTree, kept: Dict[str, Tuple[str, Any, Any]]) -> None:
        objects = tree.get("objects")
        if not isinstance(objects, dict):
            return
        for name, (kind, _, value) in kept.items():
            if name not in objects:
                continue
            if kind == "state":
                objects[name] = value
                continue
            groups = objects[name].get("param_groups") if isinstance(objects[name], dict) else None
            if isinstance(groups, list) and len(groups) == len(value):
                for group, hyper in zip(groups, value):
                    group.update(hyper)


class TorchBoundary:
    """The torch adapter's part of the saves between steps: registers :class:`RegisteredState` with
    the core, and says what no part keeps (:meth:`unkept`, the objects half of the adapter's
    fingerprint)."""

    def __init__(self, core: Checkpointer, objects: TorchObjects):
        self.objects = objects
        self._unkept: Set[str] = set()
        core.between_steps.add_part(RegisteredState(objects, self._unkept))
        core.pause_hint = PAUSE_HINT

    def unkept(self) -> Tuple[Any, ...]:
        """A cheap summary of the registered objects whose state the part could not copy (compared
        with the last boundary's: a change refuses a save between steps)."""
        return tuple(state_summary(self.objects.objects[name]) for name in sorted(self._unkept)
                     if name in self.objects.objects)

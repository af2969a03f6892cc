"""The objects a plain-PyTorch ``DriveCheckpoint`` saves, and a loaded checkpoint put back into them.

:class:`TorchObjects` registers models, optimizers, schedulers, scalers, private random generators and
objects without ``state_dict()`` that carry a position (saved by their plain attributes:
:class:`~keepalive.callbacks.torchstate.PlainObject`) under names (a DDP / ``torch.compile`` wrapper
unwrapped, FSDP2's sharded objects handed to the core's DCP part), gives their part of a checkpoint
(``objects`` and the ``torch`` section), and puts a checked checkpoint back: each state into the object
registered in the same generation (a later stage may register another object under a name),
``requires_grad`` as saved, a scheduler the code now builds with other settings replanned with the
checkpoint's progress, and an object registered only after the resume (a stage-2 optimizer) restored
then.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import distributed as _distributed
from .. import plan as _plan
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import StateTree
from .torchstate import (
    PlainObject,
    RandomState,
    changed_hyperparameters,
    check_objects,
    class_name,
    frozen_parameters,
    hyperparameters,
    optimizer_settings,
    restore_gradients,
    restore_requires_grad,
    schedule_lrs,
    schedule_settings,
    scheduler_with_settings,
    state_summary,
    unwrap_module,
    unwrapped_keys,
    watch_steps,
)

__all__ = ["SCHEDULERS", "TorchObjects"]

SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _holds_dtensors(obj: Any) -> bool:
    """FSDP2: whether ``obj`` has DTensor parameters; without ``torch.distributed.tensor``
    imported there are none, and keepalive.dcp (which imports torch's DCP) is not imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from ..dcp import holds_dtensors

    return holds_dtensors(obj)


class TorchObjects:
    """The registered objects of one ``DriveCheckpoint`` (``objects``: name -> object)."""

    def __init__(self, core: Checkpointer):
        self.core = core
        self.after_resume = False  # the resume has run: a name registered again is a new object
        self.objects: Dict[str, Any] = {}
        self.optimizers: List[torch.optim.Optimizer] = []
        self.hparams: Dict[str, List[Dict[str, Any]]] = {}  # optimizer settings as the code set them
        #: the same, flat, per registration (a later generation of a name as ``name@2``): what tells this
        #: training from a finished run's (recorded in each checkpoint's metadata: keepalive.runidentity)
        self.settings: Dict[str, Any] = {}
        core.training_settings = self.compared_settings
        #: how many times each name was registered: a stage may register a new object under a name
        #: (the saved generation tells which object a checkpoint's state belongs to)
        self.generation: Dict[str, int] = {}
        self.saved_generation: Dict[str, int] = {}
        #: the loaded checkpoint's states of names not registered (in that generation) at the resume:
        #: restored when they are registered (a stage-2 optimizer), told at the first save otherwise
        self.unrestored: Dict[str, Any] = {}
        self.saved_torch: Dict[str, Any] = {}  # the loaded checkpoint's "torch" section
        self.live_states: Dict[str, Any] = {}  # schedulers' states as the code built them
        #: schedulers' settings as the code built them (the plan's "<name>.<setting>" values)
        self.schedule: Dict[str, Dict[str, Any]] = {}

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """See :meth:`keepalive.callbacks.torch.DriveCheckpoint.register`."""
        if isinstance(obj, dict):
            for k, v in obj.items():
                self.register(f"{name}.{k}", v)
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self.register(f"{name}.{i}", v)
            return
        if RandomState.wraps(obj):
            obj = RandomState(obj)
        # DDP, torch.compile: the wrapped module's state (no "module." / "_orig_mod." prefix), so a
        # checkpoint of a DDP run resumes in a plain one (another world size), and one written with
        # torch.compile resumes without it, and the other way round
        obj = unwrap_module(obj)
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            if CheckpointConfig.closest(name) is not None:  # a misspelled option, not an object
                raise CheckpointConfig.unexpected("DriveCheckpoint", name)
            obj = self._plain(name, obj)
        self._keep(name, obj)
        # Registered again before the resume: the fix of an object a checkpoint did not fit, the same
        # one; after it (a further stage): another object, whose state a later checkpoint holds
        if self.after_resume or name not in self.generation:
            self.generation[name] = self.generation.get(name, 0) + 1
        if isinstance(obj, torch.optim.Optimizer):
            self.optimizers.append(obj)
            self.hparams[name] = hyperparameters(obj)
            self._record_settings(name, obj)
            watch_steps(self.core, obj)  # steps are the optimizer's steps, counted by its step hook
        if isinstance(obj, SCHEDULERS):  # its settings are the code's plan (compared on a resume)
            self.schedule[name] = schedule_settings(obj)
            for key in [k for k in self.core.plan if k.startswith(f"{name}.")]:
                del self.core.plan[key]
            self.core.plan.update({f"{name}.{k}": v for k, v in self.schedule[name].items()})
        if self.after_resume and name in self.unrestored and name in self.objects:
            self.restore_late(name, obj)

    def _record_settings(self, name: str, opt: torch.optim.Optimizer) -> None:
        """Keep the optimizer's settings as the code set them (a later generation of the name beside the
        first: a rerun compares the first stage's), and put them in the checkpoints' metadata."""
        generation = self.generation.get(name, 1)
        key = name if generation == 1 else f"{name}@{generation}"
        self.settings = {k: v for k, v in self.settings.items()
                         if k != key and not k.startswith((f"{key}.", f"{key}["))}
        self.settings.update(optimizer_settings(key, opt, self.hparams[name]))
        self.core.metadata["settings"] = dict(self.settings)  # a new dict: a save in flight keeps its own

    def compared_settings(self) -> Optional[Dict[str, Any]]:
        """The settings that tell this training from a finished run's, or None while a model registered
        here was trained to its loop's end on this run in this process (a further stage, a cell run
        again with its model: that run goes on as before)."""
        if any(self.core.trained_in_a_fit_here(m) for m in self.modules()):
            return None
        return dict(self.settings)

    def _plain(self, name: str, obj: Any) -> PlainObject:
        """An object without ``state_dict()`` saved by its plain attributes (``DataLoaderLite``'s
        position), or refused with the line that makes it savable."""
        refusal = PlainObject.refusal(name, obj)
        if refusal is not None:
            raise TypeError(refusal)
        wrapped = PlainObject(name, obj, self.core.warn)
        kept = f"; not saved (they must not change): {', '.join(sorted(wrapped.kept))}" if wrapped.kept else ""
        self.core.say(f"{name}: a {type(obj).__name__} without state_dict(): its attributes "
                      f"{', '.join(wrapped.saved_names())} are saved and put back on a resume{kept}")
        group = _distributed.GROUP
        if group.active:  # registered objects are rank 0's in a checkpoint; a loader's position is not
            self.core.warn(
                f"{name}: under {group.world_size} processes the checkpoint holds rank 0's {type(obj).__name__} "
                f"attributes ({', '.join(wrapped.saved_names())}), and every rank resumes with them: a "
                "position that differs by rank (build-nanogpt's current_position, process_rank) is then rank "
                "0's on every rank. Register it only where the ranks' values are the same, or set each rank's "
                "position from ckpt.step after ckpt.resume().", key=f"plain-ranks:{name}")
        return wrapped

    def _keep(self, name: str, obj: Any) -> None:
        if _holds_dtensors(obj):
            # FSDP2: sharded state is saved and loaded through torch.distributed.checkpoint
            # by the core (keepalive.dcp), not in rank 0's tensors
            from ..dcp import ShardedObjects

            if self.core.dcp_objects is None:
                self.core.dcp_objects = ShardedObjects()
            self.core.dcp_objects.add(name, obj)
            return
        replaced = self.objects.get(name)
        if replaced is not None and any(replaced is o for o in self.optimizers):
            self.optimizers[:] = [o for o in self.optimizers if o is not replaced]
        self.objects[name] = obj

    def restore_late(self, name: str, obj: Any) -> None:
        """``name`` is registered after the resume and the loaded checkpoint holds its state (a
        stage-2 optimizer): checked and restored now, as it would have been at the resume."""
        if self.saved_generation.get(name, 1) != self.generation[name]:
            return  # the checkpoint's state belongs to another object registered under this name
        state = self.unrestored.pop(name)
        tree: StateTree = {"objects": {name: state}, "torch": self.saved_torch}
        self._unwrap_saved({name: obj}, tree)
        if isinstance(obj, SCHEDULERS):
            self.live_states[name] = obj.state_dict()
        check_objects({name: obj}, tree, self._where())
        self._load(name, obj, tree["objects"][name])
        self._replan(name, obj, tree["objects"][name])
        if isinstance(obj, torch.optim.Optimizer):
            for _, text in changed_hyperparameters({name: self.hparams[name]}, self.saved_torch.get("hparams")):
                self.core.warn(text, key=f"hparams:{name}")
        self.core.say(f"{name}: registered after the resume; its state is restored from the checkpoint")

    def modules(self) -> List[torch.nn.Module]:
        return [obj for obj in self.objects.values() if isinstance(obj, torch.nn.Module)]

    # ---------------------------------------------------------------------------- the checkpoint
    def states(self) -> Dict[str, Any]:
        """The ``objects`` part of a checkpoint: each object's ``state_dict()``."""
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def section(self) -> Dict[str, Any]:
        """The ``torch`` part of a checkpoint: what a resume checks and restores beside the states."""
        return {"classes": {n: class_name(o) for n, o in self.objects.items()},
                "hparams": self.hparams,
                "registered": {n: self.generation.get(n, 1) for n in self.objects},
                "frozen": {n: frozen_parameters(o) for n, o in self.objects.items()
                           if isinstance(o, torch.nn.Module)}}

    def summary(self) -> Tuple[Any, ...]:
        """What :meth:`states` reads beside tensors (schedulers, scalers, generators), cheaply."""
        return tuple(state_summary(obj) for obj in self.objects.values()
                     if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)))

    def tell_unrestored(self) -> None:
        """At the first save after a resume: the states of names this run has not registered."""
        if not self.unrestored:
            return
        names = sorted(self.unrestored)
        self.core.warn(
            f"the checkpoint resumed from holds {names}, which this run has not registered: "
            f"{'their states are' if len(names) > 1 else 'its state is'} not restored, and this "
            f"checkpoint lacks {'them' if len(names) > 1 else 'it'}. Register it before the loop that "
            f"uses it (ckpt.register('{names[0]}', ...)).", key="unrestored")
        self.unrestored = {}

    def check_schedule_end(self, last: bool) -> None:
        """A OneCycleLR at the end of its total_steps while the training goes on: its next step()
        raises in torch; say why and what to change, once, before that."""
        if last:
            return
        for name, obj in self.objects.items():
            if isinstance(obj, torch.optim.lr_scheduler.OneCycleLR) and obj.last_epoch >= obj.total_steps:
                self.core.warn(
                    f"{name}: OneCycleLR's schedule ends at its total_steps={obj.total_steps} and the training "
                    f"goes on (ckpt.epochs({self.core.total_epochs})): its next step() raises torch's \"Tried "
                    f"to step {obj.total_steps + 1} times\" ValueError. Build it with total_steps covering the "
                    "whole run (e.g. epochs * len(loader)); on a resume the code's total_steps is used, with "
                    "the checkpoint's progress.", key=f"onecycle-end:{name}")

    # --------------------------------------------------------------------------------- resume
    def check_fits(self, tree: StateTree) -> None:
        """Raise if the loaded ``tree`` does not fit the objects (before anything is loaded)."""
        where = self._where()
        current = self._current(tree)
        self._unwrap_saved(current, tree)
        # the code's schedulers as built, read before anything is loaded into them
        self.live_states = {n: o.state_dict() for n, o in current.items() if isinstance(o, SCHEDULERS)}
        check_objects(current, tree, where)
        if self.core.dcp_objects:  # FSDP2: the checkpoint must hold their DCP part
            from ..dcp import check_saved

            check_saved(tree, self.core.dcp_objects, where)

    def restore(self, tree: StateTree) -> None:
        """Put a checked tree's states into the objects (their gradients pending at an epoch's end too)."""
        objects = tree.get("objects", {})
        self.saved_torch = dict(tree.get("torch") or {})
        loaded = [name for name in self._current(tree) if name in objects]
        for name in loaded:
            self._load(name, self.objects[name], objects[name])
        for name in loaded:  # after the optimizers: a changed schedule sets their learning rates
            self._replan(name, self.objects[name], objects[name])
        self.unrestored = {n: state for n, state in objects.items() if n not in loaded and
                           self.saved_generation.get(n, 1) > self.generation.get(n, 0)}
        where = self.core.resumed_from
        if self.core.dcp_objects and where is not None:  # FSDP2: a collective, DCP reshards if needed
            self.core.steps_paused = True  # DCP steps the optimizer once to create its state
            try:
                self.core.dcp_objects.load(where.url, storage_options=self.core.spooled.storage_options)
            finally:
                self.core.steps_paused = False
        restore_gradients(self.objects, (tree.get("data") or {}).get("pending_grads"))
        for name, text in changed_hyperparameters(self.hparams, self.saved_torch.get("hparams")):
            self.core.warn(text, key=f"hparams:{name}")

    def _where(self) -> str:
        return self.core.loaded_url

    def _current(self, tree: StateTree) -> Dict[str, Any]:
        """The registered objects the checkpoint's states belong to: a name registered again by a later
        stage holds, in the checkpoint, the state of the generation registered when it was saved."""
        saved = tree.get("objects", {})
        self.saved_generation = {k: int(v) for k, v in
                                 ((tree.get("torch") or {}).get("registered") or {}).items()}
        return {n: o for n, o in self.objects.items()
                if n not in saved or self.saved_generation.get(n, 1) == self.generation.get(n, 1)}

    @staticmethod
    def _unwrap_saved(objects: Dict[str, Any], tree: StateTree) -> None:
        """Modules' saved states with a DDP / torch.compile wrapper's key prefix that the live module
        lacks (a checkpoint written before keepalive unwrapped them): the prefix goes."""
        saved = tree.get("objects", {})
        for name, obj in objects.items():
            if isinstance(obj, torch.nn.Module) and isinstance(saved.get(name), dict):
                saved[name] = unwrapped_keys(obj.state_dict(), saved[name])

    def _load(self, name: str, obj: Any, state: Any) -> None:
        """Put a checked saved state into ``obj``, with its parameters' ``requires_grad`` as saved (the
        loop may have frozen or unfrozen them: that is state the code set, not the object's)."""
        obj.load_state_dict(state)
        frozen = (self.saved_torch.get("frozen") or {}).get(name)
        if frozen is not None and isinstance(obj, torch.nn.Module):
            changed = restore_requires_grad(obj, frozen)
            if changed:
                self.core.say(f"{name}: requires_grad of {changed} parameter(s) set as saved (the run had "
                              "frozen or unfrozen them after your code set them)")

    def _replan(self, name: str, obj: Any, state: Any) -> None:
        """A scheduler that the code now builds with other settings than the run that wrote the
        checkpoint (T_max 5 -> 8): the code's settings win, with the checkpoint's progress, and its
        learning rates are those the new settings give at that progress; said in one line."""
        if not isinstance(obj, SCHEDULERS) or not self.core.saved_plan:
            return
        prefix = f"{name}."
        saved = {k[len(prefix):]: v for k, v in self.core.saved_plan.items() if k.startswith(prefix)}
        found = _plan.changes(saved, self.schedule.get(name, {}))
        live = self.live_states.get(name)
        if not found or live is None:
            return
        obj.load_state_dict(scheduler_with_settings(state, live))
        groups = obj.optimizer.param_groups
        before = [g["lr"] for g in groups]
        how = ", ".join(f"{k}={a}" for k, a, _ in found)
        try:
            lrs = schedule_lrs(obj)
        except ValueError as exc:  # OneCycleLR: its progress is past the new total_steps
            self.core.warn(f"{name}: your code now builds it with {_plan.describe(found)}, but the run is "
                           f"already at step {obj.last_epoch} of it ({exc}): build it so that it covers "
                           f"the whole run, or as before ({how}) to keep the checkpoint's schedule.",
                           key=f"replan:{name}")
            return
        if lrs is not None:
            for g, lr in zip(groups, lrs):
                g["lr"] = lr
            obj._last_lr = list(lrs)
        now = [g["lr"] for g in groups]
        lr_text = f"; lr {_num(before[0])} -> {_num(now[0])}" if now and before and now != before else ""
        self.core.warn(f"{name}: your code now builds it with {_plan.describe(found)}: your settings are used, "
                       f"with the checkpoint's progress (last_epoch {obj.last_epoch}){lr_text}. To keep the "
                       f"checkpoint's schedule, build it as before ({how}).", key=f"replan:{name}")

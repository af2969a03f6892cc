"""``DriveCheckpoint`` for plain PyTorch training loops.

Wrap the epoch loop and the batch loop; re-running the same cell or script after a crash continues
where the newest valid checkpoint left off, bit for bit:

>>> import torch
>>> from torch.utils.data import DataLoader, TensorDataset
>>> from keepalive.callbacks.torch import DriveCheckpoint
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Linear(4, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True)
>>> ckpt = DriveCheckpoint("memory://doc/linear", model=model, optimizer=opt, quiet=True)
>>> for epoch in ckpt.epochs(3):
...     for x, y in ckpt.batches(loader):
...         opt.zero_grad()
...         torch.nn.functional.mse_loss(model(x), y).backward()
...         opt.step()
>>> ckpt.step, ckpt.finished
(12, True)

What is saved: every registered object's ``state_dict()`` (models, optimizers, LR schedulers,
``GradScaler``, and any extra object with ``state_dict`` / ``load_state_dict``), private random
generators you register (``random.Random``, ``np.random.Generator`` / ``RandomState``,
``torch.Generator``), the epoch / step / batch / sample counters, the RNG states (python, numpy, torch
CPU and CUDA), the data order (the sampler seed and the sample position) and ``ckpt.extras``
(JSON-able values of yours, e.g. the best metric).

Loops as people write them (the README's "What resumes exactly" table has each shape): optimizer
steps are counted by a step hook, so ``every=N`` counts them and nothing is saved while gradients are
accumulated; ``ckpt.save()`` in the loop body is made at the end of that batch (or epoch); loaders
passed through :meth:`DriveCheckpoint.batches` restart at the saved sample of the epoch's order without
loading the skipped ones (:mod:`keepalive.callbacks._torch_replay`); the code between ``for epoch`` and
``for batch`` replays with the epoch's starting random state; ``ckpt.enumerate(loader)`` gives the
true batch index in a resumed epoch.

Interrupts: Ctrl-C / "Interrupt kernel" and SIGTERM inside the loop finish the current step, save, and
then raise ``KeyboardInterrupt`` / exit; a second one acts at once.
"""
from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union, cast

import torch

from .. import plan as _plan
from .. import rng
from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from ._torch_break import closed_by_break
from ._torch_replay import DatasetKeys, ForeignIterators, LoaderReplay, fabric_loader
from .torchstate import (
    RandomState,
    changed_hyperparameters,
    check_objects,
    frozen_parameters,
    gradients,
    gradients_pending,
    hyperparameters,
    restore_gradients,
    restore_requires_grad,
    schedule_lrs,
    schedule_settings,
    scheduler_with_settings,
    state_summary,
    unwrap_module,
    unwrapped_keys,
    watch_steps,
    without_lazy,
)

__all__ = ["DriveCheckpoint"]


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _holds_dtensors(obj: Any) -> bool:
    """FSDP2: whether ``obj`` has DTensor parameters; without ``torch.distributed.tensor``
    imported there are none, and keepalive.dcp (which imports torch's DCP) is not imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from ..dcp import holds_dtensors

    return holds_dtensors(obj)


class _Pass:
    """One iteration over a loader in the running epoch (one ``ckpt.batches()`` loop)."""

    def __init__(self, rl: LoaderReplay, key: str, start: Optional[Dict[str, Any]] = None):
        self.rl, self.key = rl, key
        self.start = start      # a resumed pass: where it continues (LoaderReplay.position)
        self.position = int(start["samples"]) if start else 0  # samples handed out in the epoch
        self.done = int(start["batches"]) if start else 0      # batches handed out (the true index)
        self.trains = False     # a registered optimizer stepped during its batches
        self.out = False        # a batch is handed out and its end not reached yet
        self.handed_at = -1     # the optimizer steps counted when the last batch was handed out
        self.last_n = 0         # samples in the last batch handed out


class DriveCheckpoint(CheckpointAdapter):
    """Checkpoint a plain PyTorch loop to a local folder, a mounted Drive or any fsspec URL.

    Args:
        path: the run folder (see :class:`keepalive.config.CheckpointConfig` for every option:
            ``every``, ``keep``, ``on_deadline``, ``spool``, ``quiet``, ...; or pass ``config=``).
        model, optimizer, scheduler, scaler: objects (or lists / dicts of them) to save and restore.
        **objects: more objects with ``state_dict()`` / ``load_state_dict()`` or private random
            generators, saved under their names (keyword arguments that are not options).
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *, model: Any = None,
                 optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                 config: Optional[CheckpointConfig] = None, **options: Any):
        cfg, objects = CheckpointConfig.from_arguments(path, config, options)
        self.core = Checkpointer(config=cfg, framework="torch")
        self.core.fingerprint = self._fingerprint
        self._resumed = False
        #: how many times each name was registered: a stage may register a new object under a name
        #: (the saved generation tells which object a checkpoint's state belongs to)
        self._generation: Dict[str, int] = {}
        self._saved_generation: Dict[str, int] = {}
        #: the loaded checkpoint's states of names not registered (in that generation) at the resume:
        #: restored when they are registered (a stage-2 optimizer), told at the first save otherwise
        self._unrestored: Dict[str, Any] = {}
        self._saved_torch: Dict[str, Any] = {}  # the loaded checkpoint's "torch" section
        self._live_states: Dict[str, Any] = {}  # schedulers' states as the code built them
        #: schedulers' settings as the code built them (the plan's "<name>.<setting>" values)
        self._schedule: Dict[str, Dict[str, Any]] = {}
        self._stage = 0                 # ckpt.epochs() loops that ended (stages of the run)
        self._plan_compared = False     # the loaded plan was compared with the code's (once)
        self._left_at: Optional[Dict[str, int]] = None   # a loop left by a break: {"epoch", "of"}
        self._leaving: Optional[Dict[str, int]] = None   # saved with the checkpoint of that break
        self._left_rng: Any = None      # the RNGs when a training pass was left at a batch's end
        self._enumerate_told = False
        self.objects: Dict[str, Any] = {}
        self._optimizers: List[torch.optim.Optimizer] = []
        self._hparams: Dict[str, List[Dict[str, Any]]] = {}  # optimizer settings as the code set them
        self._seen_step = False  # a registered optimizer has stepped in this run (saved with it)
        self._pending_now = False  # the last training batch left gradients no step consumed
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("scaler", scaler), *objects.items()):
            if obj is not None:
                self.register(name, obj)
        self._loaders: Dict[str, LoaderReplay] = {}
        self._main: Optional[LoaderReplay] = None  # the training data's (first) loader
        self._datasets = DatasetKeys()
        self._train_key: Optional[str] = None  # which dataset is the training data (saved)
        self._unclaimed: Optional[Tuple[LoaderReplay, str, int, int]] = None
        self._passes: List[_Pass] = []   # the running epoch's open passes (ckpt.batches() loops)
        self._samples_out = 0           # training samples handed out since the last boundary
        self._in_epochs = False
        self._batches_done = False      # the running epoch's training pass has completed
        self._save_requested = False    # ckpt.save() in the loop body: done at the next boundary
        self._position = 0              # samples of the running epoch's order done (main loader)
        self._epoch_rng: Any = None     # the RNGs when the running epoch began (its prologue's)
        self._resume_rng: Any = None    # the saved step's RNGs, put back once a pass is positioned
        self._saved_data: Dict[str, Any] = {}
        #: training passes left inside an epoch in this process (Ctrl-C, an exception): where the same
        #: loop, run again, continues
        self._left: Dict[str, Any] = {}
        self._foreign = ForeignIterators()  # loaders the loop iterates itself across training steps

    @property
    def _in_batch(self) -> bool:
        """Between a batch's yield and its boundary, in any open pass."""
        return any(p.out for p in self._passes)

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` as ``name``: anything with ``state_dict`` / ``load_state_dict``,
        or a private random generator (``random.Random``, ``np.random.Generator`` /
        ``RandomState``, ``torch.Generator``); dicts and lists of them are registered item by item."""
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
            raise TypeError(f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                            "put plain values in ckpt.extras instead")
        if _holds_dtensors(obj):
            # FSDP2: sharded state is saved and loaded through torch.distributed.checkpoint
            # by the core (keepalive.dcp), not in rank 0's tensors
            from ..dcp import ShardedObjects

            if self.core.dcp_objects is None:
                self.core.dcp_objects = ShardedObjects()
            self.core.dcp_objects.add(name, obj)
        else:
            replaced = self.objects.get(name)
            if replaced is not None and any(replaced is o for o in self._optimizers):
                self._optimizers = [o for o in self._optimizers if o is not replaced]
            self.objects[name] = obj
        # Registered again before the resume: the fix of an object a checkpoint did not fit, the same
        # one; after it (a further stage): another object, whose state a later checkpoint holds
        if self._resumed or name not in self._generation:
            self._generation[name] = self._generation.get(name, 0) + 1
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizers.append(obj)
            self._hparams[name] = hyperparameters(obj)
            watch_steps(self.core, obj)  # steps are the optimizer's steps, counted by its step hook
        if isinstance(obj, _SCHEDULERS):  # its settings are the code's plan (compared on a resume)
            self._schedule[name] = schedule_settings(obj)
            for key in [k for k in self.core.plan if k.startswith(f"{name}.")]:
                del self.core.plan[key]
            self.core.plan.update({f"{name}.{k}": v for k, v in self._schedule[name].items()})
        if self._resumed and name in self._unrestored and name in self.objects:
            self._restore_late(name, obj)

    def _restore_late(self, name: str, obj: Any) -> None:
        """``name`` is registered after the resume and the loaded checkpoint holds its state (a
        stage-2 optimizer): checked and restored now, as it would have been at the resume."""
        if self._saved_generation.get(name, 1) != self._generation[name]:
            return  # the checkpoint's state belongs to another object registered under this name
        state = self._unrestored.pop(name)
        where = self.core.resumed_from.url if self.core.resumed_from is not None else self.url
        tree: StateTree = {"objects": {name: state}, "torch": self._saved_torch}
        self._unwrap_saved({name: obj}, tree)
        if isinstance(obj, _SCHEDULERS):
            self._live_states[name] = obj.state_dict()
        check_objects({name: obj}, tree, where)
        self._load(name, obj, tree["objects"][name])
        self._replan(name, obj, tree["objects"][name])
        if isinstance(obj, torch.optim.Optimizer):
            for _, text in changed_hyperparameters({name: self._hparams[name]}, self._saved_torch.get("hparams")):
                self.core.warn(text, key=f"hparams:{name}")
        self.core.say(f"{name}: registered after the resume; its state is restored from the checkpoint")

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the newest valid checkpoint into the registered objects (once); True if one was.

        Called by :meth:`epochs` / :meth:`batches`; call it yourself to restore earlier. A checkpoint
        that does not fit the objects raises ``StateMismatchError`` and changes nothing: fix the
        objects and call it (or the loop) again.
        """
        if self._resumed:
            return self.core.resumed_from is not None
        self._tell_no_further_stage()
        tree = self.core.load(check=self._check_fits)
        self._resumed = True
        if tree is None:
            return False
        self.restore(tree)
        return True

    def restore(self, tree: StateTree) -> None:
        """Put a loaded (and checked) tree into the registered objects, the RNGs and the data position."""
        objects = tree.get("objects", {})
        self._saved_torch = dict(tree.get("torch") or {})
        loaded = [name for name in self._current(tree) if name in objects]
        for name in loaded:
            self._load(name, self.objects[name], objects[name])
        for name in loaded:  # after the optimizers: a changed schedule sets their learning rates
            self._replan(name, self.objects[name], objects[name])
        self._unrestored = {n: state for n, state in objects.items() if n not in loaded and
                            self._saved_generation.get(n, 1) > self._generation.get(n, 0)}
        where = self.core.resumed_from
        if self.core.dcp_objects and where is not None:  # FSDP2: a collective, DCP reshards if needed
            self.core.steps_paused = True  # DCP steps the optimizer once to create its state
            try:
                self.core.dcp_objects.load(where.url, storage_options=self.core.spooled.storage_options)
            finally:
                self.core.steps_paused = False
        restore_gradients(self.objects, (tree.get("data") or {}).get("pending_grads"))
        self._saved_data = dict(tree.get("data") or {})
        self._seen_step = bool(self._saved_data.get("seen_step", False))
        self._train_key = self._saved_data.get("train_loader")
        for name, text in changed_hyperparameters(self._hparams, (tree.get("torch") or {}).get("hparams")):
            self.core.warn(text, key=f"hparams:{name}")
        self.core.restore_rng(tree)
        if self.core.counters["batch"] and self._saved_data.get("epoch_rng") is not None:
            self._resume_rng = tree.get("rng")

    def _current(self, tree: StateTree) -> Dict[str, Any]:
        """The registered objects the checkpoint's states belong to: a name registered again by a later
        stage holds, in the checkpoint, the state of the generation registered when it was saved."""
        saved = tree.get("objects", {})
        self._saved_generation = {k: int(v) for k, v in
                                  ((tree.get("torch") or {}).get("registered") or {}).items()}
        return {n: o for n, o in self.objects.items()
                if n not in saved or self._saved_generation.get(n, 1) == self._generation.get(n, 1)}

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
        frozen = (self._saved_torch.get("frozen") or {}).get(name)
        if frozen is not None and isinstance(obj, torch.nn.Module):
            changed = restore_requires_grad(obj, frozen)
            if changed:
                self.core.say(f"{name}: requires_grad of {changed} parameter(s) set as saved (the run had "
                              "frozen or unfrozen them after your code set them)")

    def _replan(self, name: str, obj: Any, state: Any) -> None:
        """A scheduler that the code now builds with other settings than the run that wrote the
        checkpoint (T_max 5 -> 8): the code's settings win, with the checkpoint's progress, and its
        learning rates are those the new settings give at that progress; said in one line."""
        if not isinstance(obj, _SCHEDULERS) or not self.core.saved_plan:
            return
        prefix = f"{name}."
        saved = {k[len(prefix):]: v for k, v in self.core.saved_plan.items() if k.startswith(prefix)}
        found = _plan.changes(saved, self._schedule.get(name, {}))
        if not found:
            return
        live = self._live_states.get(name)
        if live is None:
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

    def _check_fits(self, tree: StateTree) -> None:
        where = self.core.resumed_from.url if self.core.resumed_from is not None else self.url
        current = self._current(tree)
        self._unwrap_saved(current, tree)
        # the code's schedulers as built, read before anything is loaded into them
        self._live_states = {n: o.state_dict() for n, o in current.items() if isinstance(o, _SCHEDULERS)}
        check_objects(current, tree, where)
        if self.core.dcp_objects:  # FSDP2: the checkpoint must hold their DCP part
            from ..dcp import check_saved

            check_saved(tree, self.core.dcp_objects, where)

    # ------------------------------------------------------------------------------------ loops
    def epochs(self, n: int) -> Iterator[int]:
        """``for epoch in ckpt.epochs(n)``: yields the epochs still to run, saving as configured."""
        self.resume()
        core = self.core
        core.total_epochs = n
        core.plan.update(stage=self._stage, epochs=int(n))
        if self._nothing_to_train(n):
            self._stage += 1
            self._loop_ended()
            return
        core.check_storable(self._storable_preview)  # a value that cannot be stored fails now
        core.install_signal_handlers()
        self._in_epochs = True
        self._foreign.install()
        if core.finished:  # a further loop of the run (a stage) after one that ended it
            core.finished = False
        try:
            while core.counters["epoch"] < n:
                core.start_epoch()
                self._batches_done = False
                self._unclaimed = None
                self._samples_out = 0  # a batch handed out but never used by the last epoch: not counted
                self._datasets.new_epoch()
                epoch_rng = self._saved_data.pop("epoch_rng", None) if core.counters["batch"] else None
                if epoch_rng is None and core.counters["batch"] and self._left and self._epoch_rng is not None:
                    # the loop run again in this process after it was left inside this epoch (Ctrl-C,
                    # an error): as a resume from disk, its prologue replays from the epoch's start
                    epoch_rng, self._resume_rng = self._epoch_rng, self._left_rng
                    if self._left_rng is None:
                        core.warn(f"the loop was left inside batch {core.counters['batch'] + 1} of epoch "
                                  f"{core.counters['epoch']} (an error in the batch): run again, the epoch "
                                  "continues at that batch, but with the random state of now, so its random "
                                  "draws (dropout, augmentation) differ from an uninterrupted run's.",
                                  key="left-inside-batch")
                if epoch_rng is not None:
                    rng.restore(epoch_rng)  # the prologue of a resumed epoch draws what it drew then
                self._epoch_rng = rng.capture()
                try:
                    yield core.counters["epoch"]
                except GeneratorExit:
                    try:
                        caller: Any = sys._getframe(1)
                    except ValueError:  # closed with no Python frame above it (at the interpreter's exit)
                        caller = None
                    if closed_by_break(caller):
                        self._leave(n)
                    raise
                self._resume_rng = None  # the resumed epoch's passes are positioned
                if core.stopped:
                    return
                self._claim_unstepped_epoch()
                self._left.clear()
                requested, self._save_requested = self._save_requested, False
                last = core.counters["epoch"] + 1 >= n
                self._check_schedule_end(last)
                decision = core.end_epoch(self.capture, last=last, requested=requested)
                if decision.stop:
                    return
            self._stage += 1
            self._loop_ended()
        finally:
            self._in_epochs = False
            self._foreign.uninstall()
            for rl in self._loaders.values():
                rl.close()
            core.uninstall_signal_handlers()
            core.flush()

    def _loop_ended(self) -> None:
        """This checkpointer's loop ran to its end (or had nothing to train): the run's next loop is
        its next stage."""
        self.core.fit_trained(self.core.plan, self._modules())

    def _modules(self) -> List[torch.nn.Module]:
        return [obj for obj in self.objects.values() if isinstance(obj, torch.nn.Module)]

    def _tell_no_further_stage(self) -> None:
        """A new DriveCheckpoint of a model whose loop on this path ended in this process (one
        checkpointer per stage, as one callback per fit): it resumes the run's newest checkpoint, so a
        stage meant to train on from there would be skipped, or loaded with the last stage's objects.
        Said before anything is loaded."""
        if self._stage or not any(self.core.trained_in_a_fit_here(m) for m in self._modules()):
            return
        self.core.warn(
            f"run '{self.core.store.run}': a ckpt.epochs() loop of this model on this path already ran to its "
            "end in this process, and this new DriveCheckpoint resumes the run (its newest checkpoint): it "
            "does not start a further stage. For a further stage (another optimizer, unfrozen layers), "
            "register the new objects on the first DriveCheckpoint and call its epochs() again "
            "(ckpt.register('opt2', opt2); ckpt.epochs(n), n counting every stage's epochs), or give the "
            "stage its own run (run='stage2').", key="no-further-stage")

    def _nothing_to_train(self, n: int) -> bool:
        """Before a loop: compare the code's plan with the loaded checkpoint's (once, for the loop that
        wrote it) and say what wins; True when the loop has nothing to train (said why)."""
        core = self.core
        done = core.counters["epoch"]
        left, self._left_at = self._left_at or self._saved_data.pop("left_loop", None), None
        if left is not None and int(left["epoch"]) == done:
            before = int(left["of"])
            if before == n or done >= n:
                core.already_complete(n, message=(
                    f"the loop was left with a break at epoch {done} of {before} (e.g. early stopping), "
                    "and that was saved as the end of the run: nothing to train; the model is the one it left "
                    f"with. To train on from epoch {done}, ask for another number of epochs "
                    f"(ckpt.epochs(n) with n > {done} and n != {before}), or start a new run."))
                return True
            core.say(f"the loop was left with a break at epoch {done} of {before}; your code now asks for "
                     f"ckpt.epochs({n}): training on from epoch {done}.")
        saved = core.saved_plan if not self._plan_compared else None
        if saved is not None and int(saved.get("stage", 0) or 0) == self._stage and "epochs" in saved:
            self._plan_compared = True
            before = int(saved["epochs"])
            if before > n and done >= n:
                core.warn(f"epochs {before} -> {n}: this run was planned for {before} epochs (its checkpoint's "
                          f"plan) and has completed {done}; your code's ckpt.epochs({n}) wins: nothing to "
                          f"train. To train the {before - done} epoch(s) left, run ckpt.epochs({before}).",
                          key="plan:epochs")
                core.finished = True
                return True
            if before > n:
                core.warn(f"epochs {before} -> {n}: this run was planned for {before} epochs (its checkpoint's "
                          f"plan); your code's ckpt.epochs({n}) wins: it ends at epoch {n}. To train the "
                          f"{before} planned, run ckpt.epochs({before}).", key="plan:epochs")
            elif before < n:
                core.say(f"epochs {before} -> {n}: the run goes on to epoch {n} (its checkpoint planned {before}).")
        if done >= n:
            later = saved is not None and int(saved.get("stage", 0) or 0) > self._stage
            core.already_complete(n, message=(
                f"ckpt.epochs({n}): run '{core.store.run}' is past this loop ({done} epochs completed, saved in a "
                "later loop of the run): skipped") if later else None)
            return True
        return False

    def _leave(self, n: int) -> None:
        """The loop was left by a ``break`` (early stopping): save that as the end of the run, marked,
        so that the next run says so instead of training on to ``n``."""
        core = self.core
        if core.stopped or core.finished or core.pending_signal is not None or self._in_batch:
            return
        if not self._batches_done and (core.counters["batch"] or self._left):
            # left from inside the batch loop (a `return` out of both loops): no end of the run, the
            # next run continues from the last checkpoint as after any interruption
            return
        count = self._batches_done
        at = core.counters["epoch"] + (1 if count else 0)
        early = at < n  # a break after the last epoch's batches ends the run where it would have ended
        self._leaving = {"epoch": at, "of": int(n)} if early else None
        try:
            core.end_epoch(self.capture, last=True, count=count)
        finally:
            self._leaving = None
        self._stage += 1
        if early:
            self._left_at = {"epoch": at, "of": int(n)}
            core.say(f"left the loop at epoch {at} of {n} (a break): saved as the end of the run")

    def _check_schedule_end(self, last: bool) -> None:
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

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``for batch in ckpt.batches(loader)``: the loader's batches from the saved position."""
        holder: List[Any] = []
        gen = self._batches(loader, holder)
        holder.append(weakref.ref(gen))
        return gen

    def _batches(self, loader: Iterable, holder: List[Any]) -> Iterator[Any]:
        first = True
        for i, batch in self.enumerate(loader):
            if first:
                first = False
                if i and not self._enumerate_told:
                    self._tell_enumerate(holder[0](), i)
            yield batch

    def _tell_enumerate(self, gen: Any, at: int) -> None:
        """A resumed epoch's pass continues at batch ``at``: if the loop wraps ``ckpt.batches()`` in
        ``enumerate()``, its index restarts at 0 there; say so once."""
        if gen is None or not any(type(r) is enumerate for r in gc.get_referrers(gen)):
            return
        self._enumerate_told = True
        self.core.warn(
            f"enumerate(ckpt.batches(...)) counts from 0 in this resumed epoch, which continues at batch "
            f"{at}: code that uses the index (an accumulation flush at (i + 1) == len(loader), "
            "`if i >= ...: break`, a schedule stepped with i) sees other values than an uninterrupted "
            "run. Write `for i, batch in ckpt.enumerate(loader):` for the true index.", key="enumerate")

    def enumerate(self, loader: Iterable) -> Iterator[Tuple[int, Any]]:
        """``for i, batch in ckpt.enumerate(loader)``: like :meth:`batches`, with the batch's true
        index in the epoch (a resumed epoch starts at the saved index, not at 0)."""
        self.resume()
        rl, key = self._resumable(loader)
        if (self._in_epochs and self._batches_done) or (self.core.finished and not self._in_epochs):
            # the epoch's training pass is over, or the whole training (e.g. a test-set evaluation
            # after a run that had completed): not training data
            return (yield from self._run(_Pass(rl, key), promote=False))
        streams = self._saved_data.get("streams") or {}
        if key == self._train_key or key in streams or (self._train_key is None and not self._optimizers):
            return (yield from self._training(rl, key))
        # Not known to be the training data (yet): e.g. a validation loader, or the training loader
        # before its first optimizer step. It becomes a training pass at that step.
        return (yield from self._run(_Pass(rl, key), promote=True))

    def _training(self, rl: LoaderReplay, key: str) -> Iterator[Tuple[int, Any]]:
        """A pass over training data: counted, positioned, saved inside where it can be."""
        if not self._in_epochs:
            self._outside_epochs()
        p = _Pass(rl, key, start=self._start(rl, key))
        self._promote(p)
        return (yield from self._run(p, promote=False))

    def _promote(self, p: "_Pass") -> None:
        """``p`` is (now known to be) a pass over the training data."""
        p.trains = True
        if self._main is None or self._train_key is None or p.key == self._train_key:
            self._train_key, self._main = p.key, p.rl
            self._position = p.position
        mid_epoch = all(q.rl.mid_epoch for q in self._passes + [p] if q.trains)
        self.core.trigger.mid_epoch = mid_epoch
        self.core.mid_epoch_obstacle = next((q.rl.why_not for q in self._passes + [p]
                                             if q.trains and not q.rl.mid_epoch), None) or None

    def _run(self, p: "_Pass", promote: bool) -> Iterator[Tuple[int, Any]]:
        """Iterate one pass. A training pass counts its samples when a batch is handed out and acts
        at its batch's end (the boundary); a pass not known to be training data replays whole: what
        comes due while it runs waits for the training loop's next boundary. With ``promote``, a
        registered optimizer's step during one of its batches makes it a training pass from there."""
        core = self.core
        self._passes.append(p)
        completed = False
        try:
            for batch, n in p.rl.iterate(p.start, self._positioned if p.start else None):
                p.done, p.position, p.out, p.last_n = p.done + 1, p.position + n, True, n
                if not p.rl.mid_epoch:  # found out while iterating (a subclass's own batches)
                    core.warn(p.rl.why_not, key=f"loader:{p.rl.why_not}")
                p.handed_at = core.optimizer_steps
                if p.trains:
                    self._samples_out += n  # counted at the next training boundary
                    if p.key == self._train_key:
                        self._position = p.position
                yield p.done - 1, batch
                p.out = False
                stepped = core.optimizer_steps > p.handed_at
                if stepped and promote and not p.trains:
                    self._promote(p)
                    self._samples_out += p.position  # its samples so far were training data
                if p.trains:
                    if self._boundary(p, stepped).stop:
                        return
                else:  # not a boundary (an evaluation): what cannot wait is saved here when the state is
                    # still the last step's (keepalive.pauses), the data where that step left it (the
                    # core makes no such save under a process group: the next, agreed boundary does)
                    core.active(self.capture)
            completed = True
        finally:
            if not completed and p.trains and p.rl.mid_epoch:  # where its last batch end was
                used = 1 if p.out else 0
                self._left[p.key] = p.rl.position(p.position - used * p.last_n, p.done - used)
                # left at a batch's end (Ctrl-C saved there): the random state a re-run continues from
                self._left_rng = None if used else rng.capture()
            p.out = False
            if p in self._passes:
                self._passes.remove(p)
        if not completed:
            return
        if p.trains:
            self._batches_done = True
            if self._in_epochs and p.rl.mid_epoch:
                # an error after the epoch's batches (in its validation): a re-run of the loop in this
                # process continues at the pass's end, not at its start
                self._left[p.key] = p.rl.position(p.position, p.done)
                self._left_rng = rng.capture()
            if not self._in_epochs:  # `for epoch in range(n)`: the pass is the epoch
                requested, self._save_requested = self._save_requested, False
                self._datasets.new_epoch()
                self._left.clear()
                try:
                    core.end_epoch(self.capture, requested=requested)
                    # the epoch's own code runs next (an evaluation, an EMA swapped in through .data,
                    # which no version counter sees): this save's copy is done before it
                    core.settle_snapshot()
                finally:
                    core.uninstall_signal_handlers()
        elif promote and self._in_epochs and self._unclaimed is None and not self._batches_done:
            self._unclaimed = (p.rl, p.key, p.position, p.done)  # the epoch's data if nothing steps

    def _boundary(self, p: "_Pass", stepped: bool) -> Any:
        """The end of a training batch: count the optimizer's steps and act as due. Saving is
        consistent only when no gradient is pending and no other open training pass has handed out
        a batch that no step has consumed yet (``zip`` of two loaders: the other one's next batch)."""
        pending = not stepped and gradients_pending(self._optimizers)
        self._pending_now = pending
        if stepped:
            self._seen_step = True
        steps = None if self._seen_step else (0 if pending else 1)  # no registered optimizer steps
        outstanding = any(q is not p and q.trains and q.out and q.handed_at == self.core.optimizer_steps
                          for q in self._passes)
        requested, self._save_requested = self._save_requested, False
        samples, self._samples_out = self._samples_out, 0
        self._foreign.boundary += 1
        mid_epoch = all(q.rl.mid_epoch for q in self._passes if q.trains)
        self.core.trigger.mid_epoch = mid_epoch
        total = self.core.total_epochs
        try:
            length: Optional[int] = len(p.rl.loader)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a loader without a length (a stream): nothing to compare
            length = None
        at_end = length is not None and p.done >= length
        self._check_schedule_end(total is None or (self.core.counters["epoch"] + 1 >= total and at_end))
        return self.core.advance(self.capture, steps=steps, batch=p.done, samples=samples, can_save=mid_epoch,
                                 pending=pending or outstanding, requested=requested, length=length)

    def _claim_unstepped_epoch(self) -> None:
        """At an epoch's end with no pass that stepped a registered optimizer (the loop steps another
        one, or none): its first pass was the training data after all; count it, and say so."""
        claim, self._unclaimed = self._unclaimed, None
        if claim is None or self._batches_done:
            return
        rl, key, samples, batches = claim
        self._train_key, self._main = key, rl
        self.core.warn(
            "no optimizer given to DriveCheckpoint stepped during this epoch: its batches count as "
            "steps. If your loop steps another optimizer, register that one (optimizer=...), so that "
            "saves never land between two accumulation steps.", key="no-optimizer-step")
        self.core.advance(self.capture, steps=0 if self._seen_step else batches, batch=batches,
                          samples=samples, can_save=rl.mid_epoch)
        self._batches_done = True

    def _outside_epochs(self) -> None:
        """``ckpt.batches()`` in a plain ``for epoch in range(n)`` loop: each pass counts as an epoch,
        but after a resume the user's loop starts over from its first epoch."""
        self.core.install_signal_handlers()
        if self.core.resumed_from is not None and self.core.counters["epoch"]:
            self.core.warn(
                f"ckpt.batches() is used without ckpt.epochs(): this resume continues epoch "
                f"{self.core.counters['epoch']}, but your own epoch loop starts over from its first epoch, "
                "so the run trains more epochs than asked. Write `for epoch in ckpt.epochs(n):` to skip "
                "the finished ones.", key="outside-epochs")

    def _positioned(self) -> None:
        """A resumed pass has skipped to its saved position: the random state of the saved step."""
        if self._resume_rng is not None:  # once: a second resumed pass continues from the first's draws
            rng.restore(self._resume_rng)
            self._resume_rng = None

    def _start(self, rl: LoaderReplay, key: str) -> Optional[Dict[str, Any]]:
        """Where a training pass of the running epoch continues (its saved position), or None."""
        if not self.core.counters["batch"] or not rl.mid_epoch:
            return None
        saved = self._saved_data
        streams = saved.get("streams") or {}
        start = streams.pop(key, None) or self._left.pop(key, None)  # once: the next epoch starts at 0
        if start is None:
            if saved.pop("position", None) is not None:  # a checkpoint of an older keepalive
                self.core.warn(
                    f"this checkpoint was written by an older keepalive, whose data order differs: "
                    f"epoch {self.core.counters['epoch']} restarts from its first batch (its first "
                    f"{self.core.counters['batch']} batches are trained again).", key="old-position")
            return None
        start = dict(start)
        resharded = saved.pop("resharded", None)
        if resharded and saved.get("position") is not None and key == self._train_key:
            # DDP: another world size; the position was carried over by global sample
            # (keepalive.distributed.localize, which warned)
            start["samples"] = int(saved["position"])
            start["batches"] = start["samples"] // int(rl.batch_size or 1)
            self.core.counters["batch"] = start["batches"]
        saved.pop("position", None)
        size = saved.get("batch_size")
        if key == self._train_key and size is not None and size != rl.batch_size:
            how = (f"continues at sample {start['samples']} of its order with the same samples"
                   if rl.by_samples else f"continues after batch {start['batches']} of its batch sampler")
            self.core.warn(
                f"the batch size is {rl.batch_size} now, {size} in the checkpoint: epoch "
                f"{self.core.counters['epoch']} {how}, but its batches (and from here the model) differ "
                "from an uninterrupted run: the result is not bit-identical to one.", key="batch-size")
        return start

    def _resumable(self, loader: Any) -> Tuple[LoaderReplay, str]:
        """How ``loader`` is positioned (:class:`LoaderReplay`) and its dataset's key (:class:`DatasetKeys`)."""
        if not isinstance(loader, torch.utils.data.DataLoader) and not fabric_loader(loader):
            raise TypeError("ckpt.batches() takes a torch.utils.data.DataLoader (or what Accelerate's "
                            "prepare() / Fabric's setup_dataloaders() make of one)")
        key = self._datasets.key(loader.dataset)
        rl = self._loaders.get(key)
        if rl is None or rl.loader is not loader:
            if rl is not None:
                rl.close()
            rl = self._loaders[key] = LoaderReplay(loader)
            generators = (self._saved_data.get("generators") or {}).pop(key, None)
            if generators and not self.core.counters["batch"]:
                rl.load_generators(generators)  # an epoch-end checkpoint: where the next epoch starts
            if self._main is None:
                self.core.check_storable(self._storable_preview)  # now, not at the first save
            if not rl.mid_epoch:  # visible, once per run and reason (README: "a one-time warning")
                self.core.warn(rl.why_not, key=f"loader:{rl.why_not}")
        return rl, key

    # ------------------------------------------------------------------------------- save/state
    def _fingerprint(self) -> Tuple[Any, Any]:
        """What :meth:`capture` reads beside tensors, cheaply: the core saves during a pause of the
        loop (an evaluation) only while this is what it was at the last step boundary. A scheduler
        stepped before the evaluation, a batch handed out, a pass ended or begun all change it."""
        objects = tuple(state_summary(obj) for obj in self.objects.values()
                        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)))
        # the training passes' positions as capture() reads them (from the open pass or, once it
        # ended, from where it was left): an evaluation's own passes are not the training's state
        streams = {p.key: (p.done, p.position, p.out) for p in self._passes if p.trains}
        for key, where in self._left.items():
            streams.setdefault(key, (where.get("batches"), where.get("samples"), False))
        return objects, (tuple(sorted(streams.items())), self._position, self._samples_out,
                         self._leaving is not None, self._pending_now)

    def capture(self) -> Captured:
        for name in self._foreign.untold():
            self.core.warn(
                f"{name} is iterated outside ckpt.batches() across training steps: after a resume it "
                "restarts its epoch, so its batches differ from an uninterrupted run's. Pass it through "
                f"ckpt.batches() too (e.g. zip(ckpt.batches(labeled), ckpt.batches({name}))).",
                key=f"foreign:{name}")
        if self._unrestored:
            names = sorted(self._unrestored)
            self.core.warn(
                f"the checkpoint resumed from holds {names}, which this run has not registered: "
                f"{'their states are' if len(names) > 1 else 'its state is'} not restored, and this "
                f"checkpoint lacks {'them' if len(names) > 1 else 'it'}. Register it before the loop that "
                f"uses it (ckpt.register('{names[0]}', ...)).", key="unrestored")
            self._unrestored = {}
        data: Dict[str, Any] = {"seen_step": self._seen_step, "train_loader": self._train_key}
        if self._leaving is not None:
            data["left_loop"] = dict(self._leaving)
        if self.core.counters["batch"]:  # inside an epoch: where each training pass is, the epoch's RNGs
            streams = {p.key: p.rl.position(p.position, p.done) for p in self._passes if p.trains}
            for key, where in self._left.items():  # passes left earlier in the epoch (a break, a zip)
                streams.setdefault(key, where)
            data.update(position=self._position, epoch_rng=self._epoch_rng,
                        batch_size=self._current_batch_size(), streams=streams)
            self._tell_workers(streams)
        else:
            # the loaders' private generators (generator=, a sampler's): where the next epoch starts
            data["generators"] = {key: rl.generators_now() for key, rl in self._loaders.items()}
            if self._pending_now:
                # an epoch ended inside a gradient accumulation (its last batches roll into the next
                # epoch's first step): the gradients are part of the state saved here
                data["pending_grads"] = gradients(self.objects, self._optimizers)
        return {"objects": {name: obj.state_dict() for name, obj in self.objects.items()},
                "data": data,
                "torch": {"classes": {n: type(o).__name__ for n, o in self.objects.items()},
                          "hparams": self._hparams,
                          "registered": {n: self._generation.get(n, 1) for n in self.objects},
                          "frozen": {n: frozen_parameters(o) for n, o in self.objects.items()
                                     if isinstance(o, torch.nn.Module)}}}

    def _tell_workers(self, streams: Dict[str, Any]) -> None:
        """A mid-epoch save that a resume will not continue bit-exactly (a loader's shuffle buffer, or
        workers that draw random numbers and whose states keepalive could not take): say so once."""
        for p in self._passes:
            if p.trains and p.rl.inexact:
                self.core.warn(p.rl.inexact, key=f"inexact:{p.rl.inexact}")
            if p.trains and p.rl.workers_draw() and (streams.get(p.key) or {}).get("workers") is None:
                n = p.rl.loader.num_workers
                self.core.warn(
                    f"the training loader's {n} worker(s) draw random numbers (augmentation in the "
                    "dataset), and keepalive could not take their random state for this checkpoint (a "
                    "loader without automatic batching, or a worker that did not start the next batch "
                    "in time): a resume from it replays the data order exactly, but not the workers' "
                    "draws for the rest of that epoch.", key="worker-draws")

    def _current_batch_size(self) -> Optional[int]:
        return self._main.batch_size if self._main is not None else None

    def _storable_preview(self) -> Captured:
        return cast(Captured, without_lazy(dict(self.capture())))

    def state_dict(self) -> StateTree:
        """The whole training state as it would be saved now (tensors are live references)."""
        return self.core.build_tree(self.capture)

    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``). Inside the batch loop the save is made at
        the end of the running batch; after an epoch's batches, at the end of the epoch: there the
        counters describe the state exactly and a resume continues without redoing anything."""
        self.resume()
        if self._in_batch or (self._in_epochs and self._batches_done):
            self._save_requested = True
            return
        super().save(sync=sync)


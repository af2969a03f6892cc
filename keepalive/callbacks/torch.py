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

import os
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union, cast

import torch

from .. import rng
from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from ._torch_replay import DatasetKeys, ForeignIterators, LoaderReplay
from .torchstate import (
    RandomState,
    changed_hyperparameters,
    check_objects,
    gradients,
    gradients_pending,
    hyperparameters,
    restore_gradients,
    watch_steps,
    without_lazy,
)

__all__ = ["DriveCheckpoint"]


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
        self._resumed = False
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
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            # DDP: the wrapped module's state (no "module." prefix), so a checkpoint of a
            # DDP run resumes in a plain one (another world size) and the other way round
            obj = obj.module
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
            self.objects[name] = obj
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizers.append(obj)
            self._hparams[name] = hyperparameters(obj)
            watch_steps(self.core, obj)  # steps are the optimizer's steps, counted by its step hook

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the newest valid checkpoint into the registered objects (once); True if one was.

        Called by :meth:`epochs` / :meth:`batches`; call it yourself to restore earlier. A checkpoint
        that does not fit the objects raises ``StateMismatchError`` and changes nothing: fix the
        objects and call it (or the loop) again.
        """
        if self._resumed:
            return self.core.resumed_from is not None
        tree = self.core.load(check=self._check_fits)
        self._resumed = True
        if tree is None:
            return False
        self.restore(tree)
        return True

    def restore(self, tree: StateTree) -> None:
        """Put a loaded (and checked) tree into the registered objects, the RNGs and the data position."""
        objects = tree.get("objects", {})
        for name, obj in self.objects.items():
            obj.load_state_dict(objects[name])
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

    def _check_fits(self, tree: StateTree) -> None:
        where = self.core.resumed_from.url if self.core.resumed_from is not None else self.url
        check_objects(self.objects, tree, where)
        if self.core.dcp_objects:  # FSDP2: the checkpoint must hold their DCP part
            from ..dcp import check_saved

            check_saved(tree, self.core.dcp_objects, where)

    # ------------------------------------------------------------------------------------ loops
    def epochs(self, n: int) -> Iterator[int]:
        """``for epoch in ckpt.epochs(n)``: yields the epochs still to run, saving as configured."""
        self.resume()
        core = self.core
        core.total_epochs = n
        if core.counters["epoch"] >= n:
            core.already_complete(n)
            return
        core.check_storable(self._storable_preview)  # a value that cannot be stored fails now
        core.install_signal_handlers()
        self._in_epochs = True
        self._foreign.install()
        try:
            while core.counters["epoch"] < n:
                core.start_epoch()
                self._batches_done = False
                self._unclaimed = None
                self._samples_out = 0  # a batch handed out but never used by the last epoch: not counted
                self._datasets.new_epoch()
                epoch_rng = self._saved_data.pop("epoch_rng", None) if core.counters["batch"] else None
                if epoch_rng is not None:
                    rng.restore(epoch_rng)  # the prologue of a resumed epoch draws what it drew then
                self._epoch_rng = rng.capture()
                yield core.counters["epoch"]
                self._resume_rng = None  # the resumed epoch's passes are positioned
                if core.stopped:
                    return
                self._claim_unstepped_epoch()
                self._left.clear()
                requested, self._save_requested = self._save_requested, False
                decision = core.end_epoch(self.capture, last=core.counters["epoch"] + 1 >= n,
                                          requested=requested)
                if decision.stop:
                    return
        finally:
            self._in_epochs = False
            self._foreign.uninstall()
            for rl in self._loaders.values():
                rl.close()
            core.uninstall_signal_handlers()
            core.flush()

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``for batch in ckpt.batches(loader)``: the loader's batches from the saved position."""
        for _, batch in self.enumerate(loader):
            yield batch

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
                else:  # not a boundary: what comes due waits for the training loop's next one
                    core.active()
            completed = True
        finally:
            if not completed and p.trains and p.rl.mid_epoch:  # where its last batch end was
                used = 1 if p.out else 0
                self._left[p.key] = p.rl.position(p.position - used * p.last_n, p.done - used)
            p.out = False
            if p in self._passes:
                self._passes.remove(p)
        if not completed:
            return
        if p.trains:
            self._batches_done = True
            if not self._in_epochs:  # `for epoch in range(n)`: the pass is the epoch
                requested, self._save_requested = self._save_requested, False
                self._datasets.new_epoch()
                self._left.clear()
                try:
                    core.end_epoch(self.capture, requested=requested)
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
        return self.core.advance(self.capture, steps=steps, batch=p.done, samples=samples, can_save=mid_epoch,
                                 pending=pending or outstanding, requested=requested)

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
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError("ckpt.batches() takes a torch.utils.data.DataLoader")
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
    def capture(self) -> Captured:
        for name in self._foreign.untold():
            self.core.warn(
                f"{name} is iterated outside ckpt.batches() across training steps: after a resume it "
                "restarts its epoch, so its batches differ from an uninterrupted run's. Pass it through "
                f"ckpt.batches() too (e.g. zip(ckpt.batches(labeled), ckpt.batches({name}))).",
                key=f"foreign:{name}")
        data: Dict[str, Any] = {"seen_step": self._seen_step, "train_loader": self._train_key}
        if self.core.counters["batch"]:  # inside an epoch: where each training pass is, the epoch's RNGs
            streams = {p.key: p.rl.position(p.position, p.done) for p in self._passes if p.trains}
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
                          "hparams": self._hparams}}

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

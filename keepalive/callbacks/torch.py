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
loading the skipped ones (:mod:`keepalive.callbacks._torch_data`); the code between ``for epoch`` and
``for batch`` replays with the epoch's starting random state; ``ckpt.enumerate(loader)`` gives the
true batch index in a resumed epoch.

Interrupts: Ctrl-C / "Interrupt kernel" and SIGTERM inside the loop finish the current step, save, and
then raise ``KeyboardInterrupt`` / exit; a second one acts at once.
"""
from __future__ import annotations

import os
import sys
import weakref
import zlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .. import rng
from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..dataorder import mix
from ._torch_data import DatasetKeys, ResumableLoader
from .torchstate import (
    RandomState,
    changed_hyperparameters,
    check_objects,
    gradients,
    gradients_pending,
    hyperparameters,
    restore_gradients,
    without_lazy,
)

__all__ = ["DriveCheckpoint"]


def _holds_dtensors(obj: Any) -> bool:
    """FSDP2 (issue 16): whether ``obj`` has DTensor parameters; without ``torch.distributed.tensor``
    imported there are none, and keepalive.dcp (which imports torch's DCP) is not imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from ..dcp import holds_dtensors

    return holds_dtensors(obj)


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
        self._steps_taken = 0   # optimizer steps seen by the step hooks
        self._seen_step = False  # a registered optimizer has stepped in this run (saved with it)
        self._pending_now = False  # the last training batch left gradients no step consumed
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("scaler", scaler), *objects.items()):
            if obj is not None:
                self.register(name, obj)
        self.data_seed: Optional[int] = None
        self._loaders: Dict[str, ResumableLoader] = {}
        self._main: Optional[ResumableLoader] = None  # the training data's loader
        self._datasets = DatasetKeys()
        self._train_key: Optional[str] = None  # which dataset is the training data (saved)
        self._unclaimed: Optional[Tuple[ResumableLoader, str, int, int]] = None
        self._resumed = False
        self._in_epochs = False
        self._in_batch = False          # between a batch's yield and its boundary
        self._batches_done = False      # the running epoch's batch loop has completed
        self._save_requested = False    # ckpt.save() in the loop body: done at the next boundary
        self._position = 0              # samples of the running epoch's order done
        self._epoch_rng: Any = None     # the RNGs when the running epoch began (its prologue's)
        self._resume_rng: Any = None    # the saved RNGs, put back right before the first batch
        self._saved_data: Dict[str, Any] = {}

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
            # DDP (issue 16): the wrapped module's state (no "module." prefix), so a checkpoint of a
            # DDP run resumes in a plain one (another world size) and the other way round
            obj = obj.module
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                            "put plain values in ckpt.extras instead")
        if _holds_dtensors(obj):
            # FSDP2 (issue 16): sharded state is saved and loaded through torch.distributed.checkpoint
            # by the core (keepalive.dcp), not in rank 0's tensors
            from ..dcp import ShardedObjects

            if self.core.sharded is None:
                self.core.sharded = ShardedObjects()
            self.core.sharded.add(name, obj)
        else:
            self.objects[name] = obj
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizers.append(obj)
            self._hparams[name] = hyperparameters(obj)
            me = weakref.ref(self)

            def count(*_: Any) -> None:  # a weak reference: the hook must not keep us alive
                ckpt = me()
                if ckpt is not None:
                    ckpt._steps_taken += 1

            obj.register_step_post_hook(count)

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
            self.data_seed = torch.initial_seed() & ((1 << 63) - 1)
            return False
        objects = tree.get("objects", {})
        for name, obj in self.objects.items():
            obj.load_state_dict(objects[name])
        if self.core.sharded:  # FSDP2 (issue 16): a collective, DCP reshards if the world size changed
            self.core.sharded.load(self.core.resumed_from.url,
                                   storage_options=self.core.sink.storage_options)
        restore_gradients(self.objects, (tree.get("data") or {}).get("pending_grads"))
        self._saved_data = dict(tree.get("data") or {})
        self.data_seed = int(self._saved_data.get("seed", torch.initial_seed()))
        self._seen_step = bool(self._saved_data.get("seen_step", False))
        self._train_key = self._saved_data.get("train_loader")
        for name, text in changed_hyperparameters(self._hparams, (tree.get("torch") or {}).get("hparams")):
            self.core.warn(text, key=f"hparams:{name}")
        self.core.restore_rng(tree)
        if self.core.counters["batch"] and self._saved_data.get("epoch_rng") is not None:
            self._resume_rng = tree.get("rng")
        return True

    def _check_fits(self, tree: Dict[str, Any]) -> None:
        check_objects(self.objects, tree, self.core.resumed_from.url)
        if self.core.sharded:  # FSDP2 (issue 16): the checkpoint must hold their DCP part
            from ..dcp import check_saved

            check_saved(tree, self.core.sharded, self.core.resumed_from.url)

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
        try:
            while core.counters["epoch"] < n:
                core.start_epoch()
                self._batches_done = False
                self._unclaimed = None
                self._datasets.new_epoch()
                epoch_rng = self._saved_data.pop("epoch_rng", None) if core.counters["batch"] else None
                if epoch_rng is not None:
                    rng.restore(epoch_rng)  # the prologue of a resumed epoch draws what it drew then
                self._epoch_rng = rng.capture()
                yield core.counters["epoch"]
                if core.stopped:
                    return
                self._claim_unstepped_epoch()
                requested, self._save_requested = self._save_requested, False
                decision = core.end_epoch(self._capture, last=core.counters["epoch"] + 1 >= n,
                                          requested=requested)
                if decision.stop:
                    return
        finally:
            self._in_epochs = False
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
            return (yield from self._pass(rl, key, promote=False))
        if key == self._train_key or (self._train_key is None and not self._optimizers):
            return (yield from self._training(rl, key))
        # Not known to be the training data (yet): e.g. a validation loader, or the training loader
        # before its first optimizer step. It becomes the training pass at that step.
        return (yield from self._pass(rl, key, promote=True))

    def _training(self, rl: ResumableLoader, key: str, done_before: int = 0,
                  it: Optional[Iterator[Tuple[int, Any, int]]] = None) -> Iterator[Tuple[int, Any]]:
        """The epoch's pass over the training data: counted, positioned, saved inside where it can
        be. ``it`` / ``done_before``: a provisional pass that turned out to be it, taken over."""
        core = self.core
        self._train_key, self._main = key, rl
        core.trigger.mid_epoch = rl.mid_epoch
        core.mid_epoch_obstacle = rl.why_not or None
        if not self._in_epochs:
            self._outside_epochs()
        if it is None:
            start = self._start_sample(rl)
            if self._resume_rng is not None:
                rng.restore(self._resume_rng)  # the state at the saved step, after the prologue
                self._resume_rng = None
            self._position = start
            it = rl.iterate(core.counters["epoch"], start)
        outer = self._in_batch
        try:
            for done, batch, n in it:
                steps_before = self._steps_taken
                self._in_batch = True
                yield done - 1, batch
                self._in_batch = outer
                if self._batch_end(rl, done, n, steps_before).stop:
                    return
            self._batches_done = True
            if not self._in_epochs:  # `for epoch in range(n)`: the pass is the epoch
                requested, self._save_requested = self._save_requested, False
                self._datasets.new_epoch()
                core.end_epoch(self._capture, requested=requested)
        finally:
            self._in_batch = outer
            if not self._in_epochs:
                core.uninstall_signal_handlers()

    def _batch_end(self, rl: ResumableLoader, done: int, n: int, steps_before: int,
                   samples_before: int = 0) -> Any:
        self._position += n
        stepped = self._steps_taken > steps_before
        pending = self._pending_now = not stepped and gradients_pending(self._optimizers)
        requested, self._save_requested = self._save_requested, False
        return self.core.advance(self._capture, steps=self._steps_of(stepped, pending), batch=done,
                                 samples=n + samples_before, can_save=rl.mid_epoch, pending=pending,
                                 requested=requested)

    def _pass(self, rl: ResumableLoader, key: str, promote: bool) -> Iterator[Tuple[int, Any]]:
        """A pass over data not known to be the training data: from its start, not counted, and what
        comes due while it runs (a save, an interrupt) waits for the training loop's next boundary:
        a resume replays it whole, as the code around it. With ``promote``, the first registered
        optimizer step inside it makes it the epoch's training pass from there on."""
        core = self.core
        it = rl.iterate(core.counters["epoch"], 0)
        outer, samples, done = self._in_batch, 0, 0
        try:
            for done, batch, n in it:
                steps_before = self._steps_taken
                self._in_batch = True
                yield done - 1, batch
                self._in_batch = outer
                if promote and self._steps_taken > steps_before:
                    self._position = samples
                    if self._batch_end(rl, done, n, steps_before, samples_before=samples).stop:
                        return
                    self._train_key, self._main = key, rl
                    return (yield from self._training(rl, key, it=it))
                samples += n
                stepped = self._steps_taken > steps_before
                if core.advance(self._capture, steps=1 if stepped else 0, batch=core.counters["batch"],
                                pending=True).stop:
                    return
            if promote and self._in_epochs and self._unclaimed is None:
                self._unclaimed = (rl, key, samples, done)  # the epoch's data if nothing steps
        finally:
            self._in_batch = outer

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
        self.core.advance(self._capture, steps=0 if self._seen_step else batches, batch=batches,
                          samples=samples, can_save=rl.mid_epoch)
        self._batches_done = True

    def _steps_of(self, stepped: bool, pending: bool) -> int:
        """Optimizer steps this batch counts for: 1 if a registered optimizer stepped, 0 while
        gradients are accumulated. Until a registered optimizer is seen stepping (none registered,
        or the loop steps another one), a batch without pending gradients counts as one step."""
        if stepped:
            self._seen_step = True
            return 1
        return 0 if pending or self._seen_step else 1

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

    def _start_sample(self, rl: ResumableLoader) -> int:
        """Where the running epoch continues, as a sample offset in the epoch's order."""
        batch = self.core.counters["batch"]
        if not batch or not rl.mid_epoch:
            return 0
        saved = self._saved_data
        size, position = saved.get("batch_size"), saved.get("position")
        if saved.pop("resharded", None) and position is not None:
            # DDP (issue 16): another world size; the position was carried over by global sample
            # (keepalive.distributed.localize, which warned); once: the next epoch starts at 0
            self._saved_data.pop("position", None)
            self.core.counters["batch"] = int(position) // int(rl.batch_size or 1)
            return int(position)
        if position is None:  # a checkpoint written before positions were saved
            return batch * int(rl.batch_size or 1)
        self._saved_data.pop("position", None)  # once: the next epoch starts at 0
        if size is None or size == rl.batch_size:
            return int(position)  # also after an earlier resume with another size: not batch * size
        self.core.warn(
            f"the batch size is {rl.batch_size} now, {size} in the checkpoint: epoch "
            f"{self.core.counters['epoch']} continues at sample {position} of its order with the same "
            "samples, but its batches (and from here the model) differ from an uninterrupted run: the "
            "result is not bit-identical to one.", key="batch-size")
        return int(position)

    def _resumable(self, loader: Any) -> Tuple[ResumableLoader, str]:
        """The positionable twin of ``loader`` and its dataset's key (:class:`DatasetKeys`)."""
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError("ckpt.batches() takes a torch.utils.data.DataLoader")
        key = self._datasets.key(loader.dataset)
        rl = self._loaders.get(key)
        if rl is None or rl.original is not loader:
            rl = self._loaders[key] = ResumableLoader(loader, mix(self.data_seed or 0, zlib.crc32(key.encode())))
            if self._main is None:
                self.core.check_storable(self._storable_preview)  # now, not at the first save
            if not rl.mid_epoch:  # visible, once per run and reason (README: "a one-time warning")
                self.core.warn(rl.why_not, key=f"loader:{rl.why_not}")
        return rl, key

    # ------------------------------------------------------------------------------- save/state
    def _capture(self) -> Dict[str, Any]:
        data: Dict[str, Any] = {"seed": self.data_seed, "seen_step": self._seen_step,
                                "train_loader": self._train_key}
        if self.core.counters["batch"]:  # inside an epoch: where, and the epoch's starting RNGs
            data.update(position=self._position, epoch_rng=self._epoch_rng,
                        batch_size=self._current_batch_size())
        elif self._pending_now:
            # an epoch ended inside a gradient accumulation (its last batches roll into the next
            # epoch's first step): the gradients are part of the state saved here
            data["pending_grads"] = gradients(self.objects, self._optimizers)
        return {"objects": {name: obj.state_dict() for name, obj in self.objects.items()},
                "data": data,
                "torch": {"classes": {n: type(o).__name__ for n, o in self.objects.items()},
                          "hparams": self._hparams}}

    def _current_batch_size(self) -> Optional[int]:
        return self._main.batch_size if self._main is not None else None

    def _storable_preview(self) -> Dict[str, Any]:
        return without_lazy(self._capture())

    def state_dict(self) -> Dict[str, Any]:
        """The whole training state as it would be saved now (tensors are live references)."""
        return self.core.build_tree(self._capture)

    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``). Inside the batch loop the save is made at
        the end of the running batch; after an epoch's batches, at the end of the epoch: there the
        counters describe the state exactly and a resume continues without redoing anything."""
        self.resume()
        if self._in_batch or (self._in_epochs and self._batches_done):
            self._save_requested = True
            return
        super().save(sync=sync)

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
CPU and CUDA), the data order (the sampler seed and the sample position), ``ckpt.extras``
(JSON-able values of yours, e.g. the best metric) and, when the loop runs at the top level of a script or
a notebook cell, the plain values the loop assigns (a best loss, a counter, a batch drawn ahead:
:mod:`keepalive.loopstate`; ``track_globals=False`` / ``track=[...]``), put back before it continues.

``for it in ckpt.iterations(max_iters)`` is the loop of a training counted in iterations (one optimizer
step each, no batch loop: nanoGPT's shape); it saves every ``"auto"`` interval unless ``every=`` says
otherwise.

Loops as people write them (the README's "What resumes exactly" table has each shape): optimizer
steps are counted by a step hook, so ``every=N`` counts them and nothing is saved while gradients are
accumulated; ``ckpt.save()`` in the loop body is made at the end of that batch (or epoch); loaders
passed through :meth:`DriveCheckpoint.batches` restart at the saved sample of the epoch's order without
loading the skipped ones (:mod:`keepalive.callbacks._torch_replay`); the code between ``for epoch`` and
``for batch`` replays with the epoch's starting random state; ``ckpt.enumerate(loader)`` gives the
true batch index in a resumed epoch.

Interrupts: Ctrl-C / "Interrupt kernel" and SIGTERM inside the loop finish the current step, save, and
then raise ``KeyboardInterrupt`` / exit; a second one acts at once.

``DriveCheckpoint`` is a facade over its parts, each in its own module: the registered objects and
their restore (``_torch_objects``), the training data's position and random state (``_torch_data``),
the batch loops (``_torch_passes``), the epoch loop (``_torch_epochs``, which tells a ``break`` from an
interruption with ``_torch_break``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple, Union, cast

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..loopstate import LoopVariables, caller_frame
from ..pauses import BoundaryPart
from ..statetree import Captured, StateTree
from ._torch_boundary import TorchBoundary
from ._torch_data import TrainingData
from ._torch_epochs import EpochLoop
from ._torch_objects import TorchObjects
from ._torch_passes import Passes
from ._torch_unregistered import UnregisteredWatch
from .torchstate import without_lazy

__all__ = ["DriveCheckpoint"]


class LoopPart(BoundaryPart):
    """The loop's variables in a save made during an evaluation: as at the last step boundary (the
    code after the batch loop may have changed them, and a resume runs that code again)."""

    name = "the loop's variables"

    def __init__(self, loop_vars: LoopVariables):
        self.vars = loop_vars

    def keep(self, before: Any) -> Any:
        return self.vars.keep()

    def put(self, tree: StateTree, kept: Any) -> None:
        self.vars.put(cast(Dict[str, Any], tree), kept)


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
        self._objects = TorchObjects(self.core)
        self._boundary = TorchBoundary(self.core, self._objects)  # kept at each step for saves during an evaluation
        #: stateful objects of the loop's variables that change and are not registered (an EMA): named
        self._unregistered = UnregisteredWatch(self.core, self._objects.objects)
        self.objects: Dict[str, Any] = self._objects.objects
        self._data = TrainingData(self.core, self._objects, self._storable_preview)
        self._passes = Passes(self.core, self._objects, self._data, self.capture, self.resume)
        self._loop = EpochLoop(self.core, self._objects, self._data, self._passes, self.capture, self.resume)
        #: the variables of the loop (its top-level globals saved and put back; the others named)
        self._vars = LoopVariables(self.core.say, self.core.warn, enabled=cfg.track_globals, track=cfg.track)
        self._loop.started = self._passes.started = self._vars.put_back
        self.core.between_steps.add_part(LoopPart(self._vars))  # a save during an evaluation: the boundary's
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("scaler", scaler), *objects.items()):
            if obj is not None:
                self.register(name, obj)

    @property
    def _saved_data(self) -> Dict[str, Any]:
        """The loaded checkpoint's ``data`` section (where the data continues; tests alter it)."""
        return self._data.saved

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` as ``name``: anything with ``state_dict`` / ``load_state_dict``,
        or a private random generator (``random.Random``, ``np.random.Generator`` /
        ``RandomState``, ``torch.Generator``); dicts and lists of them are registered item by item."""
        self._objects.register(name, obj)

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the newest valid checkpoint into the registered objects (once); True if one was.

        Called by :meth:`epochs` / :meth:`batches`; call it yourself to restore earlier. A checkpoint
        that does not fit the objects raises ``StateMismatchError`` and changes nothing: fix the
        objects and call it (or the loop) again.
        """
        if self._objects.after_resume:
            return self.core.resumed_from is not None
        self._loop.tell_no_further_stage()
        tree = self.core.load(check=self._objects.check_fits)
        self._objects.after_resume = True
        if tree is None:
            return False
        self.restore(tree)
        return True

    def restore(self, tree: StateTree) -> None:
        """Put a loaded (and checked) tree into the registered objects, the RNGs and the data position."""
        self._objects.restore(tree)
        self._data.restore(tree)
        self._vars.loaded(tree.get("loop"))

    # ------------------------------------------------------------------------------------ loops
    def epochs(self, n: int) -> Iterator[int]:
        """``for epoch in ckpt.epochs(n)``: yields the epochs still to run, saving as configured."""
        self._watch(caller_frame())
        self._loop.iterating = False
        # the loop's own generator, not one delegating to it: a break is read from the frame closing it
        return self._loop.epochs(n)

    def iterations(self, n: int) -> Iterator[int]:
        """``for it in ckpt.iterations(max_iters)``: a loop of iterations (one optimizer step each, no
        ``ckpt.batches()`` loop inside), yielding those still to run. Each iteration is one of the
        run's epochs for the counters; with ``every`` left at ``"epoch"`` the saves come every
        ``"auto"`` interval (what a save costs against the expected time between interruptions, at
        most 1 % of the training), not every iteration."""
        self._watch(caller_frame())
        self._loop.iterations(n)
        return self._loop.epochs(n)

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``for batch in ckpt.batches(loader)``: the loader's batches from the saved position."""
        return self._passes.batches(loader, self._pass_reads(caller_frame()))

    def enumerate(self, loader: Iterable) -> Iterator[Tuple[int, Any]]:
        """``for i, batch in ckpt.enumerate(loader)``: like :meth:`batches`, with the batch's true
        index in the epoch (a resumed epoch starts at the saved index, not at 0)."""
        return self._passes.enumerate(loader, self._pass_reads(caller_frame()))

    def _watch(self, frame: Any) -> None:
        """The outermost keepalive loop starts in ``frame``: its variables are kept, and the objects
        they hold are watched for changes nobody registered."""
        self._vars.watch(frame)
        self._unregistered.start_at(frame)

    def _pass_reads(self, frame: Any) -> Tuple[str, ...]:
        """For a batch loop starting in ``frame``: what the code after it reads from its last batch
        that a resume cannot put back (an epoch's ``print(loss.item())`` in a function). A save due at
        the epoch's last batch then waits for the epoch's end (:class:`~._torch_passes.Passes`).
        Outside ``ckpt.epochs()`` the batch loop is the outermost loop, whose variables are kept."""
        if not self._data.in_epochs:
            self._watch(frame)
        else:  # a batch loop in a function of its own (timm's train_one_epoch()): its counters named
            self._vars.inner(frame)
        if frame is None:
            return ()
        until = self._vars.loop.span[1] if self._vars.loop is not None and frame.f_globals is \
            self._vars.namespace and frame.f_code is self._vars.code else None
        return self._vars.unrestored_reads(frame, until)

    # ------------------------------------------------------------------------------- save/state
    def _fingerprint(self) -> Tuple[Any, Any]:
        """What :meth:`capture` reads beside tensors, cheaply: the core saves during a pause of the
        loop (an evaluation) only while this is what it was at the last step boundary. A batch handed
        out, a pass ended or begun all change it (the registered objects' state beside their tensors,
        e.g. a scheduler stepped before the evaluation, is kept at each boundary instead:
        :mod:`._torch_boundary`; the loop's variables too: :class:`LoopPart`)."""
        return self._boundary.unkept(), (
            *self._data.fingerprint(), self._loop.leaving is not None, self._data.pending_now)

    def capture(self) -> Captured:
        self._unregistered.check()
        self._data.tell_foreign()
        self._objects.tell_unrestored()
        data: Dict[str, Any] = {"seen_step": self._data.seen_step, "train_loader": self._data.train_key}
        if self._loop.leaving is not None:
            data["left_loop"] = dict(self._loop.leaving)
        data = self._data.section(data)
        captured: Captured = {"objects": self._objects.states(), "data": data, "torch": self._objects.section()}
        loop = self._vars.capture(tell=self.core.optimizer_steps > 0)
        if loop is not None:
            captured["loop"] = loop
        return captured

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
        if self._data.in_batch or (self._data.in_epochs and self._data.batches_done):
            self._data.save_requested = True
            return
        super().save(sync=sync)

    def log(self, **metrics: Any) -> None:
        """Record logged values (``ckpt.log(loss=loss.item(), acc=acc)``): numbers only, kept in the
        run's session record (its curve across sessions: ``keepalive report``) and as ``last_metrics``."""
        self.core.heartbeat.log(metrics)

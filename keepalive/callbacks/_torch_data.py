"""Where a plain-PyTorch ``DriveCheckpoint``'s training data is in the running epoch, and its random state.

:class:`TrainingData` keeps the loaders passed through ``ckpt.batches()`` (one
:class:`~keepalive.callbacks._torch_replay.LoaderReplay` per dataset), which of them is the training
data (claimed by the first optimizer step during its batches, or at the epoch's end when nothing
stepped), the running epoch's open passes and their positions, where passes left inside the epoch
continue, and the random states a resumed epoch replays: the epoch's start (its prologue, the code
between ``for epoch`` and ``for batch``) and the saved step (once the pass is positioned), and what the
loaders' persistent workers carry from one epoch to the next (``persistent_workers=True``: their
base seed's generator and random states, :class:`~keepalive.callbacks._torch_workers.PersistentWorkers`).
Its part of a checkpoint is the ``data`` section.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import rng
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from ._torch_objects import TorchObjects
from ._torch_replay import DatasetKeys, ForeignIterators, LoaderBirths, LoaderReplay, fabric_loader
from .torchstate import gradients

__all__ = ["Pass", "TrainingData"]


class Pass:
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
        self._length: Any = Pass  # the loader's len(), asked once (Pass itself: not asked yet)

    def length(self) -> Optional[int]:
        """The loader's length (None for a stream), asked once per pass: ``len(loader)`` calls the
        user's ``Dataset.__len__`` (through its sampler), which every step boundary must not call again."""
        if self._length is Pass:
            try:
                self._length = len(self.rl.loader)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - a loader without a length (a stream)
                self._length = None
        return self._length


class TrainingData:
    """The training data's position and random state in one ``DriveCheckpoint``'s running epoch."""

    def __init__(self, core: Checkpointer, objects: TorchObjects, preview: Callable[[], Captured]):
        self.core, self.objects = core, objects
        self.preview = preview  # the state as it would be saved, without live tensors (checked early)
        self.loaders: Dict[str, LoaderReplay] = {}
        self.main: Optional[LoaderReplay] = None  # the training data's (first) loader
        self.datasets = DatasetKeys()
        self.births = LoaderBirths()  # the loaders the loop builds in its running epoch
        self.train_key: Optional[str] = None  # which dataset is the training data (saved)
        self.unclaimed: Optional[Tuple[LoaderReplay, str, int, int]] = None
        self.passes: List[Pass] = []    # the running epoch's open passes (ckpt.batches() loops)
        self.samples_out = 0            # training samples handed out since the last boundary
        self.in_epochs = False
        self.batches_done = False       # the running epoch's training pass has completed
        self.save_requested = False     # ckpt.save() in the loop body: done at the next boundary
        self.position = 0               # samples of the running epoch's order done (main loader)
        self.epoch_rng: Any = None      # the RNGs when the running epoch began (its prologue's)
        self.resume_rng: Any = None     # the saved step's RNGs, put back once a pass is positioned
        self.left_rng: Any = None       # the RNGs when a training pass was left at a batch's end
        self.saved: Dict[str, Any] = {}  # the loaded checkpoint's "data" section
        #: training passes left inside an epoch in this process (Ctrl-C, an exception): where the same
        #: loop, run again, continues
        self.left: Dict[str, Any] = {}
        self.foreign = ForeignIterators()  # loaders the loop iterates itself across training steps
        self.seen_step = False  # a registered optimizer has stepped in this run (saved with it)
        self.pending_now = False  # the last training batch left gradients no step consumed

    @property
    def in_batch(self) -> bool:
        """Between a batch's yield and its boundary, in any open pass."""
        return any(p.out for p in self.passes)

    def take_request(self) -> bool:
        """Whether ``ckpt.save()`` was asked for since the last boundary (and clear it)."""
        requested, self.save_requested = self.save_requested, False
        return requested

    def restore(self, tree: StateTree) -> None:
        """A loaded checkpoint's data section and random state (after its objects are restored)."""
        self.saved = dict(tree.get("data") or {})
        self.seen_step = bool(self.saved.get("seen_step", False))
        self.train_key = self.saved.get("train_loader")
        self.core.restore_rng(tree)
        if self.core.counters["batch"] and self.saved.get("epoch_rng") is not None:
            self.resume_rng = tree.get("rng")

    # ---------------------------------------------------------------------------------- epochs
    def begin_epoch(self) -> None:
        """A new (or resumed) epoch of ``ckpt.epochs()`` begins: its random state is the saved
        epoch's start on a resume, so that its prologue draws what it drew then."""
        core = self.core
        self.batches_done = False
        self.unclaimed = None
        self.samples_out = 0  # a batch handed out but never used by the last epoch: not counted
        self.datasets.new_epoch()
        self.births.install()
        self.births.new_epoch()
        epoch_rng = self.saved.pop("epoch_rng", None) if core.counters["batch"] else None
        if epoch_rng is None and core.counters["batch"] and self.left and self.epoch_rng is not None:
            # the loop run again in this process after it was left inside this epoch (Ctrl-C,
            # an error): as a resume from disk, its prologue replays from the epoch's start
            epoch_rng, self.resume_rng = self.epoch_rng, self.left_rng
            if self.left_rng is None:
                core.warn(f"the loop was left in epoch {core.counters['epoch']} after {core.counters['batch']} "
                          "batches, inside the next (an error in the batch): run again, the epoch "
                          "continues at that batch, but with the random state of now, so its random "
                          "draws (dropout, augmentation) differ from an uninterrupted run's.",
                          key="left-inside-batch")
        if epoch_rng is not None:
            rng.restore(epoch_rng)  # the prologue of a resumed epoch draws what it drew then
        self.epoch_rng = rng.capture()

    def close_loaders(self) -> None:
        self.births.uninstall()
        for rl in self.loaders.values():
            rl.close()

    # ---------------------------------------------------------------------------------- loaders
    def resumable(self, loader: Any) -> Tuple[LoaderReplay, str]:
        """How ``loader`` is positioned (:class:`LoaderReplay`) and its dataset's key (:class:`DatasetKeys`)."""
        if not isinstance(loader, torch.utils.data.DataLoader) and not fabric_loader(loader):
            raise TypeError("ckpt.batches() takes a torch.utils.data.DataLoader (or what Accelerate's "
                            "prepare() / Fabric's setup_dataloaders() make of one)")
        key = self.datasets.key(loader.dataset)
        rl = self.loaders.get(key)
        if rl is None or rl.loader is not loader:
            if rl is not None:
                rl.close()
            replaced, rl = rl, LoaderReplay(loader)
            self.loaders[key] = rl
            self._persistent_from(rl, key, replaced)
            generators = (self.saved.get("generators") or {}).pop(key, None)
            if generators and not self.core.counters["batch"]:
                rl.load_generators(generators)  # an epoch-end checkpoint: where the next epoch starts
            if self.main is None:
                self.core.check_storable(self.preview)  # now, not at the first save
            if not rl.mid_epoch:  # visible, once per run and reason (README: "a one-time warning")
                self.core.warn(rl.why_not, key=f"loader:{rl.why_not}")
        return rl, key

    def _persistent_from(self, rl: LoaderReplay, key: str, replaced: Optional[LoaderReplay]) -> None:
        """A loader with persistent workers: what the checkpoint's workers carried (its ``persistent``
        part), or, for a loader the training builds anew each epoch, that its workers start anew:
        seen as it replaces the last epoch's loader, or, in the epoch that built the first one (the
        next epoch's loader is not built yet at that epoch's end), as it was built in the epoch."""
        saved = (self.saved.get("persistent") or {}).pop(key, None)
        if rl.persistence is None:
            return
        if replaced is not None and replaced.persistence is not None:
            rl.persistence.rebuilt = True
            return
        rl.persistence.rebuilt = self.births.built_this_epoch(rl.loader, rl.base)
        if saved:
            rl.persistence.load(saved)

    def promote(self, p: Pass) -> None:
        """``p`` is (now known to be) a pass over the training data."""
        p.trains = True
        if self.main is None or self.train_key is None or p.key == self.train_key:
            self.train_key, self.main = p.key, p.rl
            self.position = p.position
        mid_epoch = all(q.rl.mid_epoch for q in self.passes + [p] if q.trains)
        self.core.trigger.mid_epoch = mid_epoch
        self.core.mid_epoch_obstacle = next((q.rl.why_not for q in self.passes + [p]
                                             if q.trains and not q.rl.mid_epoch), None) or None

    # ---------------------------------------------------------------------------------- passes
    def start(self, rl: LoaderReplay, key: str) -> Optional[Dict[str, Any]]:
        """Where a training pass of the running epoch continues (its saved position), or None."""
        core = self.core
        if not core.counters["batch"] or not rl.mid_epoch:
            return None
        saved = self.saved
        streams = saved.get("streams") or {}
        start = streams.pop(key, None) or self.left.pop(key, None)  # once: the next epoch starts at 0
        if start is None:
            if saved.pop("position", None) is not None:  # a checkpoint of an older keepalive
                core.warn(
                    f"this checkpoint was written by an older keepalive, whose data order differs: "
                    f"epoch {core.counters['epoch']} restarts from its first batch (its first "
                    f"{core.counters['batch']} batches are trained again).", key="old-position")
            return None
        start = dict(start)
        resharded = saved.pop("resharded", None)
        if resharded and saved.get("position") is not None and key == self.train_key:
            # DDP: another world size; the position was carried over by global sample
            # (keepalive.distributed.localize, which warned)
            start["samples"] = int(saved["position"])
            start["batches"] = start["samples"] // int(rl.batch_size or 1)
            core.counters["batch"] = start["batches"]
        saved.pop("position", None)
        size = saved.get("batch_size")
        if key == self.train_key and size is not None and size != rl.batch_size:
            how = (f"continues at sample {start['samples']} of its order with the same samples"
                   if rl.by_samples else f"continues after batch {start['batches']} of its batch sampler")
            core.warn(
                f"the batch size is {rl.batch_size} now, {size} in the checkpoint: epoch "
                f"{core.counters['epoch']} {how}, but its batches (and from here the model) differ "
                "from an uninterrupted run: the result is not bit-identical to one.", key="batch-size")
        return start

    def positioned(self) -> None:
        """A resumed pass has skipped to its saved position: the random state of the saved step."""
        if self.resume_rng is not None:  # once: a second resumed pass continues from the first's draws
            rng.restore(self.resume_rng)
            self.resume_rng = None

    def handed_out(self, p: Pass, n: int) -> None:
        """``p`` hands out its next batch, of ``n`` samples."""
        p.done, p.position, p.out, p.last_n = p.done + 1, p.position + n, True, n
        if not p.rl.mid_epoch:  # found out while iterating (a subclass's own batches)
            self.core.warn(p.rl.why_not, key=f"loader:{p.rl.why_not}")
        p.handed_at = self.core.optimizer_steps
        if p.trains:
            self.samples_out += n  # counted at the next training boundary
            if p.key == self.train_key:
                self.position = p.position

    def pass_left(self, p: Pass, completed: bool) -> None:
        """``p`` ends: ran out, or left (a break, Ctrl-C, an error): then where its last batch end was."""
        if not completed and p.trains and p.rl.mid_epoch:
            used = 1 if p.out else 0
            self.left[p.key] = p.rl.position(p.position - used * p.last_n, p.done - used)
            # left at a batch's end (Ctrl-C saved there): the random state a re-run continues from
            self.left_rng = None if used else rng.capture()
        p.out = False
        if p in self.passes:
            self.passes.remove(p)

    # ---------------------------------------------------------------------------- the checkpoint
    def fingerprint(self) -> Tuple[Any, ...]:
        """The training passes' positions as :meth:`section` reads them (from the open pass or, once it
        ended, from where it was left): an evaluation's own passes are not the training's state."""
        streams = {p.key: (p.done, p.position, p.out) for p in self.passes if p.trains}
        for key, where in self.left.items():
            streams.setdefault(key, (where.get("batches"), where.get("samples"), False))
        return tuple(sorted(streams.items())), self.position, self.samples_out

    def section(self, data: Dict[str, Any]) -> Dict[str, Any]:
        """``data`` (the checkpoint's data section so far) with the data's position and random state."""
        if self.core.counters["batch"]:  # inside an epoch: where each training pass is, the epoch's RNGs
            streams = {p.key: p.rl.position(p.position, p.done) for p in self.passes if p.trains}
            for key, where in self.left.items():  # passes left earlier in the epoch (a break, a zip)
                streams.setdefault(key, where)
            data.update(position=self.position, epoch_rng=self.epoch_rng,
                        batch_size=self.main.batch_size if self.main is not None else None, streams=streams)
            self._tell_workers(streams)
        persistent = self._persistent_now()
        if persistent:
            data["persistent"] = persistent
        if not self.core.counters["batch"]:
            # the loaders' private generators (generator=, a sampler's): where the next epoch starts
            data["generators"] = {key: rl.generators_now() for key, rl in self.loaders.items()}
            if self.pending_now:
                # an epoch ended inside a gradient accumulation (its last batches roll into the next
                # epoch's first step): the gradients are part of the state saved here
                data["pending_grads"] = gradients(self.objects.objects, self.objects.optimizers)
        return data

    def _persistent_now(self) -> Dict[str, Any]:
        """What each loader's persistent workers carry into their next batches (``persistent_workers=True``:
        their random states go on across epochs, and no new base seed is drawn), by dataset; a loaded
        checkpoint's for the loaders this process has not iterated yet."""
        out = dict(self.saved.get("persistent") or {})
        for key, rl in self.loaders.items():
            kept, pos = rl.persistence, rl.positioner
            if kept is None or pos is None:
                base = rl.base
                # (a loader with state_dict() restores its own workers)
                if rl.mode == "epoch" and getattr(base, "persistent_workers", False) and base.num_workers:
                    self._tell_persistent(f"the {type(base).__name__} over a {type(base.dataset).__name__}")
                continue
            p = next((q for q in self.passes if q.rl is rl), None)
            state = kept.state(pos, p.done if p is not None and p.trains else None, p is not None)
            if state is None:
                out.pop(key, None)
            else:
                out[key] = state
            if kept.inexact:
                self.core.warn(kept.inexact, key=f"inexact:{kept.inexact}")
        return out

    def tell_foreign(self) -> None:
        """Loaders iterated outside ``ckpt.batches()`` across training steps: said once each."""
        for name in self.foreign.untold():
            self.core.warn(
                f"{name} is iterated outside ckpt.batches() across training steps: after a resume it "
                "restarts its epoch, so its batches differ from an uninterrupted run's. Pass it through "
                f"ckpt.batches() too (e.g. zip(ckpt.batches(labeled), ckpt.batches({name}))).",
                key=f"foreign:{name}")
        for name in self.foreign.untold(persistent=True):
            self._tell_persistent(f"{name} (iterated outside ckpt.batches())", "pass it through ckpt.batches(), "
                                  "which carries its workers' states and seed, or ")

    def _tell_persistent(self, what: str, fix: str = "") -> None:
        """A loader with persistent workers whose workers a resume starts anew: said once."""
        self.core.warn(
            f"{what} keeps its workers across epochs (persistent_workers=True), and a resume starts them "
            "anew: their base seed is drawn again from torch's generator (the uninterrupted run draws none "
            "after the workers' first epoch) and their random streams restart, so the training after a "
            f"resume differs from an uninterrupted run's. For an exact resume {fix}use "
            "persistent_workers=False.", key=f"persistent:{what}")

    def _tell_workers(self, streams: Dict[str, Any]) -> None:
        """A mid-epoch save that a resume will not continue bit-exactly (a loader's shuffle buffer, or
        workers that draw random numbers and whose states keepalive could not take): say so once."""
        for p in self.passes:
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

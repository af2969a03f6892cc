"""The batch loops of a plain-PyTorch ``DriveCheckpoint``: ``ckpt.batches()`` / ``ckpt.enumerate()``.

:class:`Passes` runs each pass over a loader in the running epoch. A pass over the training data counts
its samples when a batch is handed out and calls the core at the batch's end (the boundary, where a
save may be made); a pass not known to be training data (a validation loader, or the training loader
before its first optimizer step) replays whole and becomes a training pass at a registered
optimizer's first step. Which loader is the training data, and where a resumed pass continues, is
:class:`keepalive.callbacks._torch_data.TrainingData`'s.

A pass whose epoch code reads, after the pass, what its last batch left (``print(loss.item())`` after
the batch loop) in variables a resume cannot put back (a loop inside a function) is never saved at its
epoch's last batch: a resume there would run that code with no batch run (a ``NameError`` on every
re-run). What comes due at that batch (a save, a stop, a signal) waits for the epoch's end.
"""
from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Sequence, Tuple

from .. import rng
from ..core import Checkpointer
from ..statetree import Captured
from ._torch_data import Pass, TrainingData
from ._torch_objects import TorchObjects
from ._torch_replay import LoaderReplay
from .torchstate import gradients_pending

__all__ = ["Passes", "WAIT_FOR_EPOCH_END"]

#: what comes due at an epoch's last batch waits for the epoch's end where the code after the batch
#: loop reads that batch's variables and a resume cannot put them back (False only in tests' controls)
WAIT_FOR_EPOCH_END = True


class Passes:
    """The ``ckpt.batches()`` loops of one ``DriveCheckpoint``."""

    def __init__(self, core: Checkpointer, objects: TorchObjects, data: TrainingData,
                 capture: Callable[[], Captured], resume: Callable[[], bool]):
        self.core, self.objects, self.data = core, objects, data
        self.capture, self.resume = capture, resume
        self.enumerate_told = False
        #: called once a batch loop outside ``ckpt.epochs()`` has resumed (the loop's variables put back)
        self.started: Callable[[], None] = lambda: None

    def batches(self, loader: Iterable, reads: Sequence[str] = ()) -> Iterator[Any]:
        """See :meth:`keepalive.callbacks.torch.DriveCheckpoint.batches`; ``reads``: what the code
        after the loop reads from its last batch that a resume cannot put back."""
        holder: List[Any] = []
        gen = self._batches(loader, holder, reads)
        holder.append(weakref.ref(gen))
        return gen

    def _batches(self, loader: Iterable, holder: List[Any], reads: Sequence[str]) -> Iterator[Any]:
        first = True
        for i, batch in self.enumerate(loader, reads):
            if first:
                first = False
                if i and not self.enumerate_told:
                    self._tell_enumerate(holder[0](), i)
            yield batch

    def _tell_enumerate(self, gen: Any, at: int) -> None:
        """A resumed epoch's pass continues at batch ``at``: if the loop wraps ``ckpt.batches()`` in
        ``enumerate()``, its index restarts at 0 there; say so once."""
        if gen is None or not any(type(r) is enumerate for r in gc.get_referrers(gen)):
            return
        self.enumerate_told = True
        self.core.warn(
            f"enumerate(ckpt.batches(...)) counts from 0 in this resumed epoch, which continues at batch "
            f"{at}: code that uses the index (an accumulation flush at (i + 1) == len(loader), "
            "`if i >= ...: break`, a schedule stepped with i) sees other values than an uninterrupted "
            "run. Write `for i, batch in ckpt.enumerate(loader):` for the true index.", key="enumerate")

    def enumerate(self, loader: Iterable, reads: Sequence[str] = ()) -> Iterator[Tuple[int, Any]]:
        """See :meth:`keepalive.callbacks.torch.DriveCheckpoint.enumerate` (``reads``: see :meth:`batches`)."""
        self.resume()
        data = self.data
        if not data.in_epochs:
            self.started()
        rl, key = data.resumable(loader)
        if (data.in_epochs and data.batches_done) or (self.core.finished and not data.in_epochs):
            # the epoch's training pass is over, or the whole training (e.g. a test-set evaluation
            # after a run that had completed): not training data
            return (yield from self._run(Pass(rl, key), promote=False))
        streams = data.saved.get("streams") or {}
        if key == data.train_key or key in streams or (data.train_key is None and not self.objects.optimizers):
            return (yield from self._training(rl, key, bool(reads)))
        # Not known to be the training data (yet): e.g. a validation loader, or the training loader
        # before its first optimizer step. It becomes a training pass at that step.
        return (yield from self._run(Pass(rl, key), promote=True, ends_epoch=bool(reads)))

    def _training(self, rl: LoaderReplay, key: str, ends_epoch: bool = False) -> Iterator[Tuple[int, Any]]:
        """A pass over training data: counted, positioned, saved inside where it can be
        (``ends_epoch``: not at its last batch, see the module's docstring)."""
        if not self.data.in_epochs:
            self._outside_epochs()
        p = Pass(rl, key, start=self.data.start(rl, key))
        self.data.promote(p)
        return (yield from self._run(p, promote=False, ends_epoch=ends_epoch))

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

    def _run(self, p: Pass, promote: bool, ends_epoch: bool = False) -> Iterator[Tuple[int, Any]]:
        """Iterate one pass. A training pass counts its samples when a batch is handed out and acts
        at its batch's end (the boundary); a pass not known to be training data replays whole: what
        comes due while it runs waits for the training loop's next boundary. With ``promote``, a
        registered optimizer's step during one of its batches makes it a training pass from there."""
        core, data = self.core, self.data
        data.passes.append(p)
        completed = False
        try:
            for batch, n in p.rl.iterate(p.start, data.positioned if p.start else None):
                data.handed_out(p, n)
                yield p.done - 1, batch
                p.out = False
                stepped = core.optimizer_steps > p.handed_at
                if stepped and promote and not p.trains:
                    data.promote(p)
                    data.samples_out += p.position  # its samples so far were training data
                if p.trains:
                    if self._boundary(p, stepped, ends_epoch).stop:
                        self._stopped_outside_epochs()
                        return
                else:  # not a boundary (an evaluation): what cannot wait is saved here when the state is
                    # still the last step's (keepalive.pauses), the data where that step left it (the
                    # core makes no such save under a process group: the next, agreed boundary does)
                    core.active(self.capture)
            completed = True
        finally:
            data.pass_left(p, completed)
        if completed:
            self._completed(p, promote)

    def _stopped_outside_epochs(self) -> None:
        """A stop (the deadline, a notice) in ``ckpt.batches()`` without ``ckpt.epochs()``: no epoch loop
        of keepalive's ends the training call, so the pass does (raising the stop, its save durable)."""
        if not self.data.in_epochs:
            self.core.uninstall_signal_handlers()
            self.core.flush()

    def _completed(self, p: Pass, promote: bool) -> None:
        """``p`` ran out of batches."""
        data = self.data
        if not p.trains:
            if promote and data.in_epochs and data.unclaimed is None and not data.batches_done:
                data.unclaimed = (p.rl, p.key, p.position, p.done)  # the epoch's data if nothing steps
            return
        data.batches_done = True
        if data.in_epochs and p.rl.mid_epoch:
            # an error after the epoch's batches (in its validation): a re-run of the loop in this
            # process continues at the pass's end, not at its start
            data.left[p.key] = p.rl.position(p.position, p.done)
            data.left_rng = rng.capture()
        if not data.in_epochs:  # `for epoch in range(n)`: the pass is the epoch
            requested = data.take_request()
            data.datasets.new_epoch()
            data.left.clear()
            try:
                self.core.end_epoch(self.capture, requested=requested)
                # the epoch's own code runs next (an evaluation, an EMA swapped in through .data,
                # which no version counter sees): this save's copy is done before it
                self.core.settle_snapshot()
            finally:
                self.core.uninstall_signal_handlers()

    def _boundary(self, p: Pass, stepped: bool, ends_epoch: bool = False) -> Any:
        """The end of a training batch: count the optimizer's steps and act as due. Saving is
        consistent only when no gradient is pending and no other open training pass has handed out
        a batch that no step has consumed yet (``zip`` of two loaders: the other one's next batch)."""
        core, data = self.core, self.data
        pending = not stepped and gradients_pending(self.objects.optimizers)
        data.pending_now = pending
        if stepped:
            data.seen_step = True
        steps = None if data.seen_step else (0 if pending else 1)  # no registered optimizer steps
        outstanding = any(q is not p and q.trains and q.out and q.handed_at == core.optimizer_steps
                          for q in data.passes)
        requested = data.take_request()
        samples, data.samples_out = data.samples_out, 0
        data.foreign.boundary += 1
        mid_epoch = all(q.rl.mid_epoch for q in data.passes if q.trains)
        core.trigger.mid_epoch = mid_epoch
        total = core.total_epochs
        length = p.length()  # None for a stream: nothing to compare
        at_end = length is not None and p.done >= length
        self.objects.check_schedule_end(total is None or (core.counters["epoch"] + 1 >= total and at_end))
        # not a point to resume from: the epoch's code after the pass needs its last batch's variables
        waits = ends_epoch and at_end and data.in_epochs and WAIT_FOR_EPOCH_END
        return core.advance(self.capture, steps=steps, batch=p.done, samples=samples, can_save=mid_epoch,
                            pending=pending or outstanding or waits, requested=requested, length=length)

    def claim_unstepped_epoch(self) -> None:
        """At an epoch's end with no pass that stepped a registered optimizer (the loop steps another
        one, or none): its first pass was the training data after all; count it, and say so."""
        data = self.data
        claim, data.unclaimed = data.unclaimed, None
        if claim is None or data.batches_done:
            return
        rl, key, samples, batches = claim
        data.train_key, data.main = key, rl
        self.core.warn(
            "no optimizer given to DriveCheckpoint stepped during this epoch: its batches count as "
            "steps. If your loop steps another optimizer, register that one (optimizer=...), so that "
            "saves never land between two accumulation steps.", key="no-optimizer-step")
        self.core.advance(self.capture, steps=0 if data.seen_step else batches, batch=batches,
                          samples=samples, can_save=rl.mid_epoch)
        data.batches_done = True

"""The loops of a JAX ``DriveCheckpoint``: ``ckpt.epochs(n)``, ``ckpt.batches(iterable)`` and the steps.

JAX has no optimizer object with a hook: a step is what the loop says is one. :class:`JaxLoop` counts
one optimizer step per ``ckpt.update(...)`` call; a loop that never calls it (an NNX loop that updates its
objects in place) counts one per batch of its training pass. Each training batch ends at the core
(``core.advance``: a save, a stop or a signal acted on as due), each epoch at ``core.end_epoch``.

This is a smaller loop than the torch adapter's ``EpochLoop`` (which is built on torch's objects: the
registered optimizers' step hooks, gradient accumulation, loader keys, stages of optimizers): one
training pass per epoch, no gradient accumulation to wait for (a JAX step applies its update in one
call), a ``break`` out of ``ckpt.epochs()`` ends the run as an interruption does (the next run
continues from the last checkpoint).

A save holds the state's ``jax.Array`` leaves by reference and returns; the store copies them to the
host meanwhile (a lazy snapshot). The loop's next step may donate those buffers
(``jax.jit(..., donate_argnums=...)``), so the copy is settled (``core.settle_snapshot()``) before the
loop gets the control back where a step can follow: before each batch and each epoch is handed out,
and before ``ckpt.update(...)`` returns.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

from ..core import Checkpointer
from ..statetree import Captured
from ._jax_data import TrainingData

__all__ = ["JaxLoop"]


class JaxLoop:
    """``ckpt.epochs()`` / ``ckpt.batches()`` of one JAX ``DriveCheckpoint``."""

    def __init__(self, core: Checkpointer, data: TrainingData, capture: Callable[[], Captured],
                 resume: Callable[[], bool], started: Callable[[], None], preview: Callable[[], Captured]):
        self.core, self.data = core, data
        self.capture, self.resume, self.started = capture, resume, started
        self.preview = preview  # capture()'s shape and dtypes, nothing copied: checked at the loop's start
        self.explicit = False   # the loop calls ckpt.update(): steps are its calls, not batches
        self.steps = 0          # ckpt.update() calls since the last boundary
        # a lazy source (it adds no tensor: every JAX array of a save is copied later): this loop
        # settles each save before a step can run
        core.lazy_sources.append(lambda: ())

    # ------------------------------------------------------------------------------------ steps
    def stepped(self) -> None:
        """``ckpt.update(...)``: one optimizer step. Outside a training pass it is a boundary itself
        (a loop without ``ckpt.batches()``: saves at epoch ends)."""
        self.explicit = True
        self.steps += 1
        self.core.optimizer_steps += 1
        if self.data.in_epochs and self.data.feed is None:
            self._boundary(can_save=False)
        self.core.settle_snapshot()

    def _boundary(self, can_save: bool, length: Optional[int] = None) -> Any:
        steps = self.steps if self.explicit else 1
        self.steps = 0
        data = self.data
        data.out = False
        self.core.trigger.mid_epoch = can_save
        return self.core.advance(self.capture, steps=steps, batch=data.done if data.feed is not None else None,
                                 can_save=can_save, requested=data.take_request(), length=length)

    # ---------------------------------------------------------------------------------- epochs
    def epochs(self, n: int) -> Iterator[int]:
        """See :meth:`keepalive.callbacks.jax.DriveCheckpoint.epochs`."""
        self.resume()
        self.started()
        core, data = self.core, self.data
        core.total_epochs = n
        core.plan.update(epochs=int(n))
        if core.counters["epoch"] >= n:
            core.already_complete(n)
            return
        core.check_storable(self.preview)  # a value that cannot be stored fails now, not at the first save
        core.install_signal_handlers()
        data.in_epochs = True
        if core.finished:
            core.finished = False
        try:
            while core.counters["epoch"] < n:
                core.start_epoch()
                data.begin_epoch()
                core.settle_snapshot()  # the last epoch's save, before this epoch's steps
                yield core.counters["epoch"]
                if data.out:  # the pass was left after its last batch (zip(range(k), ...)): its boundary
                    self._tell_counted_pass()
                    self._boundary(can_save=data.feed is not None and data.feed.mid_epoch)
                if core.stopped:
                    return
                last = core.counters["epoch"] + 1 >= n
                data.feed = None
                if core.end_epoch(self.capture, last=last, requested=data.take_request()).stop:
                    return
        finally:
            data.in_epochs = False
            core.uninstall_signal_handlers()
            core.flush()

    # --------------------------------------------------------------------------------- batches
    def _tell_counted_pass(self) -> None:
        """A resumed epoch's pass over a kept iterator left by the loop after a count of its own
        (``zip(range(k), ckpt.batches(it))``): that count restarts at 0 in the resumed epoch, so the
        epoch takes more batches than an uninterrupted run's. Said once."""
        data = self.data
        if data.resumed_at and data.feed is not None and data.feed.persistent:
            self.core.warn(
                f"this resumed epoch continued at batch {data.resumed_at} of a pass your loop ends itself "
                "(zip(range(k), ckpt.batches(it))?): a count of the loop's own restarts at 0 after a resume, so "
                "the epoch took more batches than an uninterrupted run's. Write ckpt.batches(it, steps=k): "
                "it ends the epoch's pass after k batches, counting those done before the resume.",
                key="jax-counted-pass")

    def batches(self, source: Iterable, steps: Optional[int] = None) -> Iterator[Any]:
        """See :meth:`keepalive.callbacks.jax.DriveCheckpoint.batches`."""
        for _, batch in self.enumerate(source, steps):
            yield batch

    def enumerate(self, source: Iterable, steps: Optional[int] = None) -> Iterator[Tuple[int, Any]]:
        self.resume()
        data = self.data
        if not data.in_epochs:
            return (yield from self._outside_epochs(source, steps))
        if data.feed is not None:  # a second pass in the epoch (an evaluation): iterated as it is
            return (yield from enumerate(source))
        return (yield from self._training(source, steps))

    def _training(self, source: Iterable, steps: Optional[int] = None) -> Iterator[Tuple[int, Any]]:
        """The epoch's training pass: positioned on a resume, each batch ending at the core; with
        ``steps``, it ends after that many batches of the epoch (those before a resume included)."""
        data = self.data
        feed = data.training_feed(source)
        start = data.start(feed)
        it = feed.open(start, data.positioned)
        self.core.mid_epoch_obstacle = feed.why_not or None  # said when an interrupt waits for the epoch's end
        length = _length(source) if steps is None else steps
        if steps is not None and data.done >= steps:
            return
        for batch in it:
            data.done += 1
            data.out = True
            self.core.settle_snapshot()  # the last boundary's save, before this batch's step
            yield data.done - 1, batch
            if self._boundary(can_save=feed.mid_epoch, length=length).stop or \
                    (steps is not None and data.done >= steps):
                return

    def _outside_epochs(self, source: Iterable, steps: Optional[int]) -> Iterator[Tuple[int, Any]]:
        """``ckpt.batches()`` without ``ckpt.epochs()`` (a loop of steps over one long iterator, as
        Flax's MNIST tutorial has it, or a plain ``for epoch in range(n)``): each pass is an epoch of
        the run, saved and resumed like one."""
        core, data = self.core, self.data
        self.started()
        if core.resumed_from is not None and core.counters["epoch"]:
            core.warn(f"ckpt.batches() is used without ckpt.epochs(): this resume continues after epoch "
                      f"{core.counters['epoch']}, but a loop of your own around it starts over from its first "
                      "pass, so the run trains more than asked. Write `for epoch in ckpt.epochs(n):` to skip "
                      "the finished ones.", key="outside-epochs")
        core.check_storable(self.preview)
        core.install_signal_handlers()
        data.in_epochs = True
        completed = False
        try:
            core.start_epoch()
            data.begin_epoch()
            yield from self._training(source, steps)
            completed = not core.stopped
        finally:
            data.in_epochs = False
            if completed:
                if data.out:
                    self._boundary(can_save=False)
                data.feed = None
                core.end_epoch(self.capture, requested=data.take_request())
            core.uninstall_signal_handlers()
            core.flush()


def _length(source: Any) -> Optional[int]:
    try:
        return len(source)
    except Exception:  # noqa: BLE001 - an unsized iterable (TypeError), or one that cannot tell (Grain's)
        return None

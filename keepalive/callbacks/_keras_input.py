"""The running ``fit``'s input, as the Keras ``DriveCheckpoint`` holds it from the fit's start to its end.

One object per fit: :class:`~keepalive.callbacks._keras_data.ResumableData` bound to its passes (saves
inside an epoch), the pass ``fit(steps_per_epoch=...)`` keeps across epochs
(:class:`~keepalive.callbacks._keras_data.PassPosition`), the shorter epoch a resume inside it runs, and
what will not resume exactly (said at the first save). How each input kind is read and positioned:
:mod:`keepalive.callbacks._keras_data`.

Why a class of its own: binding, positioning, saving and releasing the input are one job with its own
state; the callback's hooks only say when.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..core import Checkpointer
from ._keras_data import (
    PassPosition,
    ResumableData,
    batch_samples,
    bind_passes,
    inexact_input,
    resume_at,
    set_epoch_length,
    skip_pass,
    unbind_passes,
    unskip_pass,
)

__all__ = ["FitInput"]


class FitInput:
    """The input of one ``fit``: ``iterator`` is fit's epoch iterator (None: an unknown layout),
    ``callbacks`` the fit's callbacks (a shorter epoch's length is told to their progress bars)."""

    def __init__(self, core: Checkpointer, iterator: Any, callbacks: List[Any]) -> None:
        self.core, self.iterator, self.callbacks = core, iterator, callbacks
        self.data: Optional[ResumableData] = None
        self.adapter: Any = None  # the Keras data adapter bound to ResumableData
        self.passes: Optional[PassPosition] = None  # fit(steps_per_epoch=...): the pass kept across epochs
        self.notes: List[Tuple[str, str]] = []  # (key, problem): what will not resume exactly
        self.short_epoch: Optional[int] = None  # the resumed epoch, shorter by the batches it had done

    def bind(self) -> None:
        """Find the fit's input; with ResumableData, bind each pass to its epoch (mid-epoch saves)."""
        it = self.iterator
        self.data, self.adapter, problem = bind_passes(it)
        self.core.trigger.mid_epoch = self.data is not None
        if problem:
            self.core.warn(problem, key="resumable-data")
        self.passes = PassPosition(it, self.data) if it is not None else None
        inexact = inexact_input(it, self.data)
        if inexact:
            self.notes.append(("inexact-data", inexact))
        elif self.passes is not None and self.passes.problem:
            self.notes.append(("data-pass", self.passes.problem))

    def take_notes(self) -> List[Tuple[str, str]]:
        """What will not resume exactly, once (said at the first save)."""
        notes, self.notes = self.notes, []
        return notes

    def restore(self, saved: Mapping[str, Any], epoch: int, batch: int) -> int:
        """Position the input at a checkpoint's ``saved`` data part, in ``epoch`` of this fit at
        ``batch``: the batch the resumed epoch starts at (0: at its start)."""
        batch, problems = resume_at(self.data, saved, epoch, batch)
        problem = self.passes.restore(saved.get("pass")) if self.passes is not None else None
        for line in problems + ([problem] if problem else []):
            self.core.warn(line)
        if batch and self.data is not None:
            self.short_epoch = epoch
            set_epoch_length(self.iterator, self.callbacks, self.data.batches_per_epoch - batch)
            if batch == self.data.batches_per_epoch:  # saved during the epoch's validation
                skip_pass(self.iterator, self.data)
        return batch

    def samples(self, first: int, n: int) -> int:
        """The samples in ``n`` batches from batch ``first`` of the epoch."""
        if self.data is not None:
            return self.data.samples_between(first, n)
        return batch_samples(getattr(self.iterator, "data_adapter", None), first, n)

    def epoch_ended(self) -> None:
        """A resumed, shorter epoch ended: the next ones have every batch again."""
        if self.short_epoch is not None and self.data is not None:
            set_epoch_length(self.iterator, self.callbacks, self.data.batches_per_epoch)
            unskip_pass(self.iterator)
            self.short_epoch = None

    def state(self) -> Dict[str, Any]:
        """The data part of a checkpoint."""
        data: Dict[str, Any] = {"kind": "resumable" if self.data is not None else "keras"}
        if self.data is not None:
            data.update(seed=self.data.seed, batches_per_epoch=self.data.batches_per_epoch)
        position = self.passes.state() if self.passes is not None else None
        if position is not None:
            data["pass"] = position
        return data

    def release(self) -> None:
        """The fit ended: the adapter and the pass as Keras made them."""
        if self.adapter is not None:
            unbind_passes(self.adapter)
            self.adapter = None
        if self.passes is not None:
            self.passes.unbind()
            self.passes = None
        unskip_pass(self.iterator)

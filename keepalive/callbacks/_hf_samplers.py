"""Batch samplers of libraries built on the Hugging Face ``Trainer``, positioned inside an epoch.

sentence-transformers' ``SentenceTransformerTrainer`` builds its training loader with its own batch
sampler: ``DefaultBatchSampler`` (a ``BatchSampler`` over a ``RandomSampler`` with a private generator,
seeded with the run's seed when the loader is built, each epoch's order drawn from it; accelerate puts
its ``SeedableRandomSampler`` in its place, whose order is drawn from ``seed + epoch``) or
``NoDuplicatesBatchSampler`` / ``GroupByLabelBatchSampler`` (which seed their private generator with
``seed + epoch`` when an epoch's iteration begins, and read rows of the dataset to build the batches).
Each epoch's batches are therefore a function of the generators' states when the epoch begins (and of
the dataset).

:class:`LibraryBatchSampler` stands in for such a sampler as :class:`~._hf_data.PositionedBatchSampler`
stands in for the Trainer's own: the same batches in the same order, from the library's own
``__iter__``. It notes the generators' states as each epoch's iteration begins; a checkpoint keeps
those of the running epoch (or, at an epoch's end, those the next epoch begins from); a resumed epoch
puts them back, runs the library's iteration again and drops the batches before the saved one as
indices (nothing is fetched, collated or trained for them: the library's sampler may read rows to
build its batches, as it does at every epoch). Random draws while batches are made and in workers are
replayed as for the Trainer's own sampler (:mod:`keepalive.callbacks._hf_data`).
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import RandomSampler, SequentialSampler

from ._hf_data import PositionedBatchSampler, base_loader

__all__ = ["LibraryBatchSampler", "install_library", "library_state", "restore_library", "LIBRARY_SAMPLERS"]

#: the samplers known to draw each epoch's batches from their generators' states (module, class names)
LIBRARY_SAMPLERS = {
    "sentence_transformers.base.sampler": ("DefaultBatchSampler", "NoDuplicatesBatchSampler",
                                           "GroupByLabelBatchSampler"),
}


class LibraryBatchSampler(PositionedBatchSampler):
    """A library's batch sampler, positioned (see the module): its batches from batch ``start`` on."""

    def __init__(self, inner: Any, n: int):
        super().__init__(n, int(inner.batch_size), bool(inner.drop_last), "library",
                         int(getattr(inner, "seed", 0) or 0))
        self.inner = inner
        self.at_start: Optional[List[torch.Tensor]] = None  # the generators' states as this epoch began
        #: put back as the next epoch's iteration begins (kept until one begins: a resume at an epoch's
        #: last batch iterates nothing of that epoch, and the next one begins from these)
        self.resume_states: Optional[List[torch.Tensor]] = None

    def generators(self) -> List[torch.Generator]:
        """The library sampler's private generators (its own, its index sampler's), each once."""
        found: List[torch.Generator] = []
        for holder in (self.inner, getattr(self.inner, "sampler", None)):
            g = getattr(holder, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not other for other in found):
                found.append(g)
        return found

    def generator_states(self, inside_epoch: bool) -> List[torch.Tensor]:
        """What a checkpoint keeps: the states the running epoch began with (``inside_epoch``), else those
        the next epoch begins with (the generators' now)."""
        if inside_epoch and self.at_start is not None:
            return [s.clone() for s in self.at_start]
        return [g.get_state() for g in self.generators()]

    def set_epoch(self, epoch: int) -> None:
        """The epoch goes to the library's sampler and to its index sampler (accelerate's
        ``SeedableRandomSampler`` draws each epoch's order from ``seed + epoch``), as accelerate's loader
        hands it to them when the library's sampler is in place."""
        self.epoch = int(epoch)
        for holder in (self.inner, getattr(self.inner, "sampler", None)):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def order(self, epoch: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)  # the library's own iteration makes the batches

    def _batches(self, idx: torch.Tensor, start: int) -> Iterator[Tuple[int, List[int]]]:
        gens = self.generators()
        if self.resume_states is not None and len(self.resume_states) == len(gens):
            for g, state in zip(gens, self.resume_states):
                g.set_state(state.clone())
        self.resume_states = None
        self.at_start = [g.get_state() for g in gens]
        return itertools.islice(((b, list(batch)) for b, batch in enumerate(self.inner)), start, None)

    def __len__(self) -> int:
        return len(self.inner)


def install_library(loader: Any) -> Tuple[Optional[LibraryBatchSampler], str]:
    """Put a :class:`LibraryBatchSampler` in the place of a known library's batch sampler (one process);
    (sampler, "") or (None, why not)."""
    base = base_loader(loader)
    bs = base.batch_sampler
    if isinstance(bs, LibraryBatchSampler):
        return bs, ""
    names = LIBRARY_SAMPLERS.get(type(bs).__module__, ())
    if type(bs).__name__ not in names:
        return None, f"custom batch sampler {type(bs).__name__}: checkpoints at epoch ends only"
    index = getattr(bs, "sampler", None)
    seedable = type(index).__name__ == "SeedableRandomSampler"  # accelerate's: an order per (seed, epoch)
    if type(bs).__name__ == "DefaultBatchSampler" and not (seedable or type(index) is SequentialSampler or (
            type(index) is RandomSampler and index.generator is not None)):
        # an order drawn from the global generator, or by a sampler not known: not replayed from its states
        return None, f"batch sampler {type(bs).__name__} over {type(index).__name__}: checkpoints at epoch ends only"
    sampler = LibraryBatchSampler(bs, len(base.dataset))
    # as for the Trainer's own sampler: no iterator exists yet, so this is what building it with ours is
    object.__setattr__(base, "batch_sampler", sampler)
    return sampler, ""


def library_state(sampler: Optional[PositionedBatchSampler], inside_epoch: bool) -> Optional[Dict[str, Any]]:
    """The checkpoint's part for a library sampler (None for the Trainer's own)."""
    if not isinstance(sampler, LibraryBatchSampler):
        return None
    return {"generators": sampler.generator_states(inside_epoch)}


def restore_library(sampler: Optional[PositionedBatchSampler], saved: Optional[Dict[str, Any]]) -> None:
    """The saved generators' states go back as the next epoch's iteration begins (the resumed one)."""
    if isinstance(sampler, LibraryBatchSampler) and saved and saved.get("generators") is not None:
        sampler.resume_states = [torch.as_tensor(s) for s in saved["generators"]]

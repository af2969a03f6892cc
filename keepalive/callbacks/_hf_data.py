"""Sampler positioning for the Hugging Face ``Trainer``'s training ``DataLoader``.

The Trainer builds its training loader in ``train()`` (``get_train_dataloader``: a ``DataLoader`` with
a ``BatchSampler`` over a ``RandomSampler`` / ``SequentialSampler``, wrapped by accelerate, which
swaps the ``RandomSampler`` for a ``SeedableRandomSampler`` whose order is a function of
``(seed, epoch)``). :func:`install` puts a :class:`PositionedBatchSampler` in the place of that
``BatchSampler``: the same batches in the same order (a run with the callback sees the data a run
without it sees), and an epoch can start at any batch without computing, fetching or collating the
batches before it.

The Trainer's own loop still decides the step counter of a resumed epoch: it is handed
``steps_trained_in_current_epoch`` and wraps the loader in accelerate's ``SkipBatchSampler``, which
drops that many batches from the front. For that one iteration the positioned sampler yields as many
empty placeholders first (nothing is loaded for them) and then the epoch's batches from the saved
position.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from ..dataorder import mix

__all__ = ["PositionedBatchSampler", "install", "base_loader"]


class _Placeholder(list):
    """A batch the Trainer's ``SkipBatchSampler`` drops unseen (never fetched)."""


class PositionedBatchSampler(BatchSampler):
    """The batches of an epoch's order, from batch ``start`` on (after ``placeholders`` empty ones)."""

    def __init__(self, n: int, batch_size: int, drop_last: bool, kind: str, seed: int):
        # no super().__init__: the index sampler is ours (self.sampler stays for accelerate's set_epoch)
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last
        self.kind, self.seed = kind, seed
        self.epoch = 0
        self.start = 0          # batches of the running epoch already trained (resume)
        self.placeholders = 0   # empty batches first: what the Trainer's SkipBatchSampler drops
        self.sampler = self  # type: ignore[assignment]  # accelerate: batch_sampler.sampler.set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order, as the replaced sampler would have drawn it."""
        if self.kind == "sequential":
            return torch.arange(self.n)
        g = torch.Generator()
        # accelerate's SeedableRandomSampler: a generator seeded with seed + epoch, one randperm
        g.manual_seed(self.seed + epoch if self.kind == "seedable" else mix(self.seed, epoch))
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[List[int]]:
        start, placeholders = self.start, self.placeholders
        self.start = self.placeholders = 0  # once: the next epoch starts at its beginning
        for _ in range(placeholders):
            yield _Placeholder()
        idx = self.order(self.epoch)
        total = len(self)
        for b in range(start, total):
            yield idx[b * self.batch_size:(b + 1) * self.batch_size].tolist()

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)


def base_loader(loader: Any) -> Any:
    """The ``torch.utils.data.DataLoader`` inside accelerate's wrapper (or the loader itself)."""
    return getattr(loader, "base_dataloader", loader)


def install(loader: Any, fallback_seed: int) -> Tuple[Optional[PositionedBatchSampler], str]:
    """Replace the Trainer's training batch sampler by a positioned one; (sampler, "") or (None, why not)."""
    base = base_loader(loader)
    if isinstance(base.dataset, IterableDataset):
        return None, ("the training data is an IterableDataset, which cannot be positioned without "
                      "reading it: checkpoints at epoch ends only")
    bs = base.batch_sampler
    if isinstance(bs, PositionedBatchSampler):
        return bs, ""
    if bs is None or type(bs) is not BatchSampler:
        return None, f"custom batch sampler {type(bs).__name__}: checkpoints at epoch ends only"
    s = bs.sampler
    n = len(base.dataset)
    kind: Optional[str] = None
    seed = fallback_seed
    if type(s) is SequentialSampler:
        kind = "sequential"
    elif isinstance(s, RandomSampler) and not s.replacement and s._num_samples is None:
        if type(s).__name__ == "SeedableRandomSampler":
            kind, seed = "seedable", int(getattr(s, "initial_seed"))  # noqa: B009 - accelerate's subclass
        elif type(s) is RandomSampler and s.generator is None:
            kind = "random"  # drew its seed from the global RNG at each epoch: ours is fixed instead
    if kind is None or len(s) != n:  # type: ignore[arg-type]
        return None, f"sampler {type(s).__name__}: checkpoints at epoch ends only"
    sampler = PositionedBatchSampler(n, int(bs.batch_size), bool(bs.drop_last), kind, seed)
    # The DataLoader refuses a new batch_sampler once built; no iterator exists yet (train() has not
    # begun its first epoch), so replacing it here is what building it with ours would have been.
    object.__setattr__(base, "batch_sampler", sampler)
    return sampler, ""

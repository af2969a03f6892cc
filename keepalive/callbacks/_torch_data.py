"""Sampler-level mid-epoch resume for ``torch.utils.data.DataLoader``.

The user's loader is rebuilt around a batch sampler that draws each epoch's order from a private
generator seeded by ``(seed, epoch)`` and can start at any batch: resuming at batch ``b`` of an epoch
computes that epoch's permutation (indices only) and starts at ``b * batch_size``; no skipped sample is
loaded or iterated. The global RNGs are left alone, so dropout and augmentation in the main process
see exactly the stream they would have seen without a restart.

Worker processes (``num_workers > 0``) get a seed per *batch*, derived from ``(seed, epoch, batch)``,
set right before the batch is fetched; random augmentation in workers is therefore the same whether
the epoch ran from its start or resumed in the middle (PyTorch's own worker seeding depends on which
worker fetched which batches before, which a resume changes).

Supported exactly: map-style datasets with a ``RandomSampler`` (without replacement) or a
``SequentialSampler`` (``shuffle=True/False``), any ``batch_size`` and ``drop_last``. Other samplers
and ``IterableDataset``: checkpoints only at epoch ends (see :class:`ResumableLoader.mid_epoch`).
"""
from __future__ import annotations

import logging
import random
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler
from torch.utils.data import Sampler, SequentialSampler, get_worker_info

from ..dataorder import mix

log = logging.getLogger("keepalive.torch")

class SeededBatch(list):
    """A list of dataset indices that carries the seed for fetching it (survives pickling)."""

    seed: int = 0


class ResumableBatchSampler(Sampler):
    def __init__(self, n: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int):
        self.n, self.batch_size, self.drop_last, self.shuffle, self.seed = n, batch_size, drop_last, shuffle, seed
        self.epoch = 0
        self.start = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator()
        g.manual_seed(mix(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g)

    def batch_len(self, b: int) -> int:
        return min(self.batch_size, self.n - b * self.batch_size)

    def __iter__(self) -> Iterator[SeededBatch]:
        idx = self.order()
        for b in range(self.start, self.batches_per_epoch):
            batch = SeededBatch(idx[b * self.batch_size:(b + 1) * self.batch_size].tolist())
            batch.seed = mix(self.seed, self.epoch, b, 1)
            yield batch

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch - self.start)


def _seed_worker_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class SeededDataset(Dataset):
    """Wraps a map-style dataset; in a worker, seeds the RNGs per batch before fetching it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: List[int]) -> List[Any]:
        if isinstance(batch, SeededBatch) and get_worker_info() is not None:
            _seed_worker_rngs(batch.seed)
        inner = getattr(self.dataset, "__getitems__", None)
        if inner is not None:
            return inner(list(batch))
        return [self.dataset[i] for i in batch]


def _supported(loader: DataLoader) -> Tuple[bool, Optional[bool], str]:
    """(mid-epoch resume possible, shuffle, why not)."""
    if isinstance(loader.dataset, IterableDataset):
        return False, None, ("an IterableDataset cannot be positioned without reading it; "
                             "checkpoints are taken at epoch ends only")
    bs = loader.batch_sampler
    if bs is None or type(bs) is not BatchSampler:
        return False, None, f"custom batch sampler {type(bs).__name__}: checkpoints at epoch ends only"
    s = loader.sampler
    if type(s) is SequentialSampler:
        return True, False, ""
    if type(s) is RandomSampler and not s.replacement and s._num_samples is None:
        return True, True, ""
    return False, None, f"sampler {type(s).__name__}: checkpoints at epoch ends only"


class ResumableLoader:
    """The user's DataLoader, rebuilt so that any epoch can start at any batch."""

    def __init__(self, loader: DataLoader, seed: int):
        self.original = loader
        self.mid_epoch, shuffle, self.why_not = _supported(loader)
        self.sampler: Optional[ResumableBatchSampler] = None
        self.loader = loader
        if not self.mid_epoch:
            log.warning("keepalive: %s", self.why_not)
            return
        bs = loader.batch_sampler
        self.sampler = ResumableBatchSampler(len(loader.dataset), bs.batch_size, bs.drop_last,  # type: ignore
                                             bool(shuffle), seed)
        self.generator = torch.Generator()
        kwargs = dict(batch_sampler=self.sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context,
                      generator=self.generator, persistent_workers=loader.persistent_workers,
                      pin_memory_device=loader.pin_memory_device)
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if hasattr(loader, "in_order"):
            kwargs["in_order"] = loader.in_order
        self.loader = DataLoader(SeededDataset(loader.dataset), **kwargs)

    def iterate(self, epoch: int, start: int) -> Iterator[Tuple[int, Any, int]]:
        """Yields ``(batch index, batch, number of samples)`` for ``epoch`` from batch ``start``."""
        if self.sampler is None:
            for b, batch in enumerate(self.loader):
                yield b, batch, _batch_size_of(batch, self.loader.batch_size)
            return
        self.sampler.epoch, self.sampler.start = epoch, start
        self.generator.manual_seed(mix(self.sampler.seed, epoch, 2))  # worker base seed
        for b, batch in enumerate(self.loader, start):
            yield b, batch, self.sampler.batch_len(b)


def _batch_size_of(batch: Any, default: Optional[int]) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size_of(batch[0], default)
    if isinstance(batch, dict) and batch:
        return _batch_size_of(next(iter(batch.values())), default)
    return int(default or 1)

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

The position inside an epoch is a *sample* offset in that epoch's order, so a resume with another
batch size (after an out-of-memory error) continues with the same samples in the same order (its
batches then differ from the uninterrupted run's: the adapter says so).

Supported exactly: plain ``DataLoader`` s over map-style datasets with a ``RandomSampler`` (without
replacement) or a ``SequentialSampler`` (``shuffle=True/False``, or the same inside
``batch_sampler=BatchSampler(...)``), any ``batch_size`` and ``drop_last``. Other samplers, custom
batch samplers, ``IterableDataset``, ``in_order=False`` and ``DataLoader`` subclasses that change
iteration: checkpoints only at epoch ends (:attr:`ResumableLoader.why_not` says why).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data.distributed import DistributedSampler

from ..dataorder import mix
from .torchstate import seed_worker_rngs


class SeededBatch(list):
    """A list of dataset indices that carries the seed for fetching it (survives pickling)."""

    seed: int = 0


class ResumableBatchSampler(Sampler):
    """Batches of the epoch's order (a function of ``(seed, epoch)``) from sample ``start_sample``."""

    def __init__(self, n: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int,
                 shard: Optional[DistributedSampler] = None):
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last
        self.shuffle, self.seed = shuffle, seed
        #: DDP: the user's DistributedSampler, whose per-rank order this reproduces (each rank resumes
        #: its own share of the epoch)
        self.shard = shard
        self.epoch = 0
        self.start_sample = 0

    @property
    def start(self) -> int:
        """The index of the first batch this iteration yields (batches of ``batch_size`` samples)."""
        return self.start_sample // self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a whole epoch."""
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def _remaining(self) -> int:
        left = max(0, self.n - self.start_sample)
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)

    def order(self) -> torch.Tensor:
        if self.shard is not None:
            return distributed_order(self.shard)
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator()
        g.manual_seed(mix(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g)

    def batch_len(self, k: int) -> int:
        """Samples in the ``k``-th batch of this iteration."""
        return min(self.batch_size, self.n - self.start_sample - k * self.batch_size)

    def __iter__(self) -> Iterator[SeededBatch]:
        idx = self.order()
        # Aligned starts (the usual case) number batches as an uninterrupted epoch does, so the
        # per-batch worker seeds are the same; a start inside a batch (the batch size changed)
        # continues the numbering from the batches already done.
        first = -(-self.start_sample // self.batch_size)
        for k in range(self._remaining()):
            lo = self.start_sample + k * self.batch_size
            batch = SeededBatch(idx[lo:lo + self.batch_size].tolist())
            batch.seed = mix(self.seed, self.epoch, first + k, 1)
            yield batch

    def __len__(self) -> int:
        return self._remaining()


class SeededDataset(Dataset):
    """Wraps a map-style dataset; in a worker, seeds the RNGs per batch before fetching it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __getattr__(self, name: str) -> Any:
        # worker_init_fn and collate code read attributes of their dataset
        # (get_worker_info().dataset.files): forward them to the user's dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # ... and set them (a worker_init_fn opening one HDF5 handle per worker) on the user's
        # dataset, which its __getitem__ reads
        if name == "dataset":
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: List[int]) -> List[Any]:
        if isinstance(batch, SeededBatch) and get_worker_info() is not None:
            seed_worker_rngs(batch.seed)
        inner = getattr(self.dataset, "__getitems__", None)
        if inner is not None:
            return inner(list(batch))
        return [self.dataset[i] for i in batch]


def distributed_order(s: DistributedSampler) -> torch.Tensor:
    """DDP: the indices ``iter(s)`` yields for its rank and epoch, as a tensor, computed as
    ``DistributedSampler`` does (seeded by ``seed + epoch``, padded or cut to a multiple of the
    number of replicas, then every ``num_replicas``-th from ``rank``), so a resumed epoch can start
    at any position of the rank's share without iterating the sampler."""
    n = len(s.dataset)  # type: ignore[arg-type]
    if s.shuffle:
        g = torch.Generator()
        g.manual_seed(s.seed + s.epoch)
        idx = torch.randperm(n, generator=g)
    else:
        idx = torch.arange(n)
    if s.total_size > n:  # padded with the order's own first indices (repeated as often as needed)
        idx = torch.cat([idx, idx.repeat(-(-(s.total_size - n) // n))[:s.total_size - n]])
    return idx[:s.total_size][s.rank:s.total_size:s.num_replicas]


def _supported(loader: DataLoader) -> Tuple[bool, Optional[bool], str]:
    """(mid-epoch resume possible, shuffle, why not)."""
    if isinstance(loader.dataset, IterableDataset):
        return False, None, ("an IterableDataset cannot be positioned without reading it; "
                             "checkpoints are taken at epoch ends only")
    cls = type(loader)
    for name in ("__iter__", "__len__", "_get_iterator"):
        if getattr(cls, name) is not getattr(DataLoader, name):
            return False, None, (f"{cls.__name__} overrides DataLoader.{name}(), which keepalive cannot "
                                 "reproduce when it positions the data: checkpoints at epoch ends only")
    if getattr(loader, "in_order", True) is False:
        return False, None, ("DataLoader(in_order=False) yields batches in the order workers finish "
                             "them: checkpoints at epoch ends only (in_order=True resumes anywhere)")
    bs = loader.batch_sampler
    if bs is None or type(bs) is not BatchSampler:
        return False, None, f"custom batch sampler {type(bs).__name__}: checkpoints at epoch ends only"
    s = bs.sampler  # the sampler inside a batch_sampler=BatchSampler(...) too, not loader.sampler
    if type(s) is SequentialSampler and s.data_source is loader.dataset:
        return True, False, ""
    if type(s) is RandomSampler and not s.replacement and s._num_samples is None \
            and s.data_source is loader.dataset:
        return True, True, ""
    if type(s) is DistributedSampler and s.dataset is loader.dataset:  # DDP: replayed per rank
        return True, bool(s.shuffle), ""
    return False, None, f"sampler {type(s).__name__}: checkpoints at epoch ends only"


class ResumableLoader:
    """The user's DataLoader, rebuilt so that any epoch can start at any batch."""

    def __init__(self, loader: DataLoader, seed: int):
        self.original = loader
        self.mid_epoch, shuffle, self.why_not = _supported(loader)
        self.sampler: Optional[ResumableBatchSampler] = None
        self.loader = loader
        if not self.mid_epoch:  # the adapter tells the user (once per run)
            return
        bs = loader.batch_sampler
        shard = bs.sampler if type(bs.sampler) is DistributedSampler else None  # type: ignore
        n = shard.num_samples if shard is not None else len(loader.dataset)  # type: ignore
        self.sampler = ResumableBatchSampler(n, bs.batch_size, bs.drop_last,  # type: ignore
                                             bool(shuffle), seed, shard=shard)
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

    @property
    def batch_size(self) -> Optional[int]:
        return self.sampler.batch_size if self.sampler is not None else self.original.batch_size

    def iterate(self, epoch: int, start_sample: int) -> Iterator[Tuple[int, Any, int]]:
        """Yields ``(batches done in the epoch after this one, batch, its number of samples)`` for
        ``epoch``, from sample ``start_sample`` of the epoch's order."""
        if self.sampler is None:
            for b, batch in enumerate(self.loader):
                yield b + 1, batch, _batch_size_of(batch, self.loader.batch_size)
            return
        self.sampler.epoch, self.sampler.start_sample = epoch, start_sample
        self.generator.manual_seed(mix(self.sampler.seed, epoch, 2))  # worker base seed
        done = -(-start_sample // self.sampler.batch_size)
        for k, batch in enumerate(self.loader):
            yield done + k + 1, batch, self.sampler.batch_len(k)


def _batch_size_of(batch: Any, default: Optional[int]) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size_of(batch[0], default)
    if isinstance(batch, dict) and batch:
        return _batch_size_of(next(iter(batch.values())), default)
    return int(default or 1)


class DatasetKeys:
    """Names the datasets a run iterates: type, length, and place among the datasets of that type and
    length first used in the running epoch. Code that builds its loaders (and datasets) anew in every
    epoch thus sees the same data, in the same order, in every epoch and every session; two datasets
    in one epoch get different orders."""

    def __init__(self) -> None:
        self._seen: Dict[int, Tuple[str, Any]] = {}  # id -> (key, dataset), this epoch

    def new_epoch(self) -> None:
        self._seen = {}

    def key(self, ds: Any) -> str:
        known = self._seen.get(id(ds))
        if known is not None and known[1] is ds:
            return known[0]
        try:
            size: Any = len(ds)
        except TypeError:
            size = None
        kind = f"{type(ds).__qualname__}:{size}"
        rank = sum(1 for k, _ in self._seen.values() if k.rsplit(":", 1)[0] == kind)
        key = f"{kind}:{rank}"
        self._seen[id(ds)] = (key, ds)  # holds ds: its id is not reused this epoch
        return key

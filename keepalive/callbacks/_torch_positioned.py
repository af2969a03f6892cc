"""The stand-in for a ``DataLoader``'s index sampler that positions one iteration of it.

While ``iter(loader)`` runs (and, for persistent workers, as long as their iterator lives), keepalive's
:class:`Positioned` takes the place of the loader's batch sampler (or sampler): it yields the inner
sampler's batches of indices, after skipping the first ``skip`` samples or batches of the epoch's
order on its first ``next()`` (index generation only: no ``__getitem__``, no worker fetch), counts what
it generates, numbers each batch for the workers (:class:`Tagged`), and, without workers, notes the
random state each batch of indices goes to the fetcher with (a loader that fetches ahead). What to skip
and when is :class:`keepalive.callbacks._torch_replay.LoaderReplay`'s.
"""
from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

from torch.utils.data import BatchSampler

from .. import rng

__all__ = ["Positioned", "Tagged", "batch_len"]


class Positioned:
    """Stands in for the loader's index sampler while ``iter(loader)`` runs (and, for persistent
    workers, as long as their iterator lives): yields the inner sampler's batches, after skipping
    ``skip`` samples or batches on its first ``next()``, and counts what it generates."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.skip = 0
        self.by_samples = False
        self.on_positioned: Optional[Callable[[], None]] = None
        self.generated: Deque[int] = collections.deque()  # samples per generated, not yet yielded batch
        self.used = False
        #: with workers: each batch of indices carries (serial, its number in the epoch) to them
        self.tagging = False
        self.serial = 0
        self.first = 0  # the number of the first batch the next iteration yields
        self.made = 0   # the running iteration's batches of indices generated (handed to the fetchers)
        # A loader that fetches ahead of the batch it hands out (Accelerate's DataLoaderShard fetches
        # one batch ahead, in the main process) makes a batch before the steps before it have trained:
        # a save then holds the state the step left, not the one that batch was made from. With
        # ``noting`` (no workers), the global random state is noted as each batch of indices goes to
        # the fetcher (``noted``, parallel to ``generated``); a resumed iteration puts back ``ahead``
        # (the saved ones) before the same batches are fetched again, then runs ``on_positioned``.
        self.noting = False
        self.noted: Deque[Tuple[int, Any]] = collections.deque()  # (batch number, state or None)
        self.last_noted: Optional[Tuple[int, Any]] = None  # that of the batch handed out last
        self.ahead: List[Any] = []

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler, ... of the inner one
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        # The multi-process iterator calls iter() twice and uses the second: what to skip is taken
        # at the first next() of the iterator in use.
        self.used = True
        eager = None if (self.skip and self.by_samples) else iter(self.inner)  # as the loader does it
        return self._numbered(eager)

    def _numbered(self, eager: Optional[Iterator[Any]]) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        hook, self.on_positioned = self.on_positioned, None
        first, self.first = self.first, 0
        ahead, self.ahead = self.ahead, []
        self.generated.clear()
        self.noted.clear()
        self.last_noted = None
        self.made = first
        serial = self.serial
        # a plain BatchSampler skips samples in its sampler (as lazily as it); with batches to fetch
        # ahead again, the hook runs once they are made (below)
        later: Optional[Callable[[], None]] = hook if ahead else None
        if ahead:
            hook = None
        batches = self._batched(skip, hook) if eager is None else self._skipped(eager, skip, hook)
        for i, b in enumerate(batches):
            if i < len(ahead):
                rng.restore(ahead[i])  # the state the uninterrupted run made this batch from
            elif later is not None:
                run, later = later, None
                run()
            self.generated.append(batch_len(b))
            self.made = first + i + 1
            self.noted.append((first + i, rng.capture() if self.noting and not self.tagging else None))
            if self.tagging and type(b) is list:
                b = Tagged(b)
                b.tag = (serial, first + i)
            yield b
        if later is not None:  # the epoch ended with the batches made ahead
            later()

    @staticmethod
    def _skipped(it: Iterator[Any], skip: int, hook: Optional[Callable[[], None]]) -> Iterator[Any]:
        if skip:
            collections.deque(itertools.islice(it, skip), maxlen=0)
        if hook is not None:
            hook()
        yield from it

    def _batched(self, skip: int, hook: Optional[Callable[[], None]]) -> Iterator[Any]:
        bs: BatchSampler = self.inner
        it = iter(bs.sampler)
        collections.deque(itertools.islice(it, skip), maxlen=0)
        if hook is not None:
            hook()
        while True:
            batch = list(itertools.islice(it, bs.batch_size))
            if not batch or (bs.drop_last and len(batch) < bs.batch_size):
                return
            yield batch


def batch_len(indices: Any) -> int:
    """Samples in a batch of indices (one index without automatic batching)."""
    try:
        return len(indices)
    except TypeError:
        return 1


class Tagged(list):
    """A batch of indices that carries ``(iteration, batch number)`` to the worker fetching it."""

    tag: Tuple[int, int] = (0, 0)

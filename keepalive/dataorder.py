"""Deterministic, resumable data order shared by the framework adapters.

An epoch's order is a pure function of ``(seed, epoch)``: any epoch can be started at any batch by
computing its permutation (indices only, no data is read), so a resumed run sees exactly the batches
an uninterrupted run would have seen. NumPy only; no framework is imported here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

_MASK63 = (1 << 63) - 1


def mix(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (splitmix64 finaliser over the parts)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & _MASK63


class EpochOrder:
    """The order of ``n`` items in batches of ``batch_size``, reshuffled per epoch from ``seed``.

    >>> order = EpochOrder(10, 4, seed=1)
    >>> order.batches_per_epoch
    3
    >>> [len(order.batch(0, b)) for b in range(3)]
    [4, 4, 2]
    >>> sorted(np.concatenate([order.batch(5, b) for b in range(3)]).tolist()) == list(range(10))
    True
    >>> bool((order.batch(5, 1) == EpochOrder(10, 4, seed=1).batch(5, 1)).all())
    True
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.n = int(n)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._cache: Optional[Tuple[int, np.ndarray]] = None  # one attribute: thread-safe swap

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.n // self.batch_size
        return -(-self.n // self.batch_size)

    def permutation(self, epoch: int) -> np.ndarray:
        """All ``n`` indices in the order epoch ``epoch`` visits them (cached for the last epoch)."""
        cache = self._cache
        if cache is not None and cache[0] == epoch:
            return cache[1]
        if self.shuffle:
            perm = np.random.Generator(np.random.PCG64(mix(self.seed, epoch))).permutation(self.n)
        else:
            perm = np.arange(self.n)
        self._cache = (epoch, perm)
        return perm

    def batch(self, epoch: int, b: int) -> np.ndarray:
        """The indices of batch ``b`` of epoch ``epoch``."""
        if not 0 <= b < self.batches_per_epoch:
            raise IndexError(f"batch {b} out of range (0..{self.batches_per_epoch - 1})")
        return self.permutation(epoch)[b * self.batch_size:(b + 1) * self.batch_size]

    def batch_len(self, b: int) -> int:
        return min(self.batch_size, self.n - b * self.batch_size)


__all__ = ["mix", "EpochOrder"]

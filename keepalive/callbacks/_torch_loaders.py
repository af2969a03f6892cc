"""The ``DataLoader`` s a training loop handles itself, beside the ones it passes through ``ckpt.batches()``.

* :class:`ForeignIterators`: iterators the loop advances across training boundaries
  (``zip(ckpt.batches(labeled), unlabeled_loader)``, FixMatch's ``next(unlabeled_iter)``), and loaders
  with persistent workers iterated outside ``ckpt.batches()``: a resume restarts them, which the
  checkpoint cannot hold, so the adapter names them once;
* :class:`LoaderBirths`: the loaders built inside the running epoch (a loader made anew every epoch
  starts new persistent workers every epoch);
* :class:`DatasetKeys`: names for the datasets a run iterates, stable across epochs and sessions
  (code that builds its loaders anew each epoch sees the same names).

keepalive's own reads of a loader go through :func:`ours`, which the watch does not count.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader

__all__ = ["ForeignIterators", "LoaderBirths", "DatasetKeys", "ours"]


_depth = 0  # > 0 while keepalive itself takes a batch from a loader


def ours(it: Iterator[Any]) -> Iterator[Any]:
    """``it``'s items, taken as keepalive's (not counted by :class:`ForeignIterators`)."""
    global _depth
    while True:
        _depth += 1
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            _depth -= 1
        yield item


class ForeignIterators:
    """Notices DataLoader iterators that the training loop advances itself across training
    boundaries (``zip(ckpt.batches(labeled), unlabeled_loader)``, FixMatch's ``next(unlabeled_iter)``):
    after a resume they restart their epoch, which keepalive cannot see in the checkpoint. A loader
    iterated whole between two boundaries (a validation loop) is not one of them.

    While a training runs, ``_BaseDataLoaderIter.__next__`` is wrapped (one check per batch);
    :meth:`uninstall` puts it back."""

    _active: List["ForeignIterators"] = []
    _original: Optional[Callable[[Any], Any]] = None

    def __init__(self) -> None:
        self.boundary = 0  # the adapter counts its training boundaries here
        self._first: "weakref.WeakKeyDictionary[Any, Tuple[int, str]]" = weakref.WeakKeyDictionary()
        self._flagged: Dict[str, bool] = {}  # name -> told
        #: loaders with persistent workers iterated outside ckpt.batches(): name -> told
        self._persistent: Dict[str, bool] = {}

    def install(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        cls = ForeignIterators
        if cls._original is None:
            original = _BaseDataLoaderIter.__next__
            cls._original = original

            def __next__(it: Any) -> Any:
                if not _depth:
                    for watcher in cls._active:
                        watcher._saw(it)
                return original(it)

            _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign,assignment]
        if self not in cls._active:
            cls._active.append(self)

    def uninstall(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        cls = ForeignIterators
        if self in cls._active:
            cls._active.remove(self)
        if not cls._active and cls._original is not None:
            _BaseDataLoaderIter.__next__ = cls._original  # type: ignore[method-assign,assignment]
            cls._original = None

    def _saw(self, it: Any) -> None:
        try:
            first = self._first.get(it)
        except TypeError:
            return
        if first is None:
            self._first[it] = (self.boundary, _name_of(it, sys._getframe(2)))
            if getattr(it, "_persistent_workers", False) and getattr(it, "_num_workers", 0):
                self._persistent.setdefault(self._first[it][1], False)
        elif first[0] != self.boundary and first[1] not in self._flagged:
            self._flagged[first[1]] = False

    def untold(self, persistent: bool = False) -> List[str]:
        """Names of the loaders noticed since the last call (``persistent``: those with persistent
        workers iterated outside ``ckpt.batches()``, whose workers a resume starts anew)."""
        flagged = self._persistent if persistent else self._flagged
        names = [n for n, told in flagged.items() if not told]
        for n in names:
            flagged[n] = True
        return names


def _name_of(it: Any, frame: Any) -> str:
    """The name the loop's code gives the iterator or its DataLoader (else a description)."""
    dataset = getattr(it, "_dataset", None)
    for _ in range(3):
        if frame is None:
            break
        for name, value in frame.f_locals.items():
            if isinstance(value, DataLoader) and dataset is not None and value.dataset is dataset:
                return name
        for name, value in frame.f_locals.items():
            if value is it:
                return name
        frame = frame.f_back
    return f"a DataLoader over a {type(dataset).__name__}"


class LoaderBirths:
    """Which DataLoaders the training loop built in its running epoch (``DataLoader(...)`` inside
    ``for epoch in ckpt.epochs(n):``). Such a loader is built anew in every epoch: its persistent
    workers live one epoch and the next epoch's loader starts new ones, seeded by a new draw of the
    global generator. A loader built before the loop is reused: its workers go on across epochs.
    A checkpoint at an epoch's end carries the workers of the second kind only.

    While a training runs, ``DataLoader.__init__`` is wrapped (it notes the loader and the epoch);
    :meth:`uninstall` puts it back, or, when another library wrapped it meanwhile (Lightning wraps
    loaders' ``__init__`` to rebuild them), leaves a wrapper that notes nothing."""

    _active: List["LoaderBirths"] = []
    _original: Optional[Callable[..., None]] = None
    _wrapper: Optional[Callable[..., None]] = None

    def __init__(self) -> None:
        self.epoch = 0
        self._born: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def install(self) -> None:
        cls = LoaderBirths
        if cls._original is None:
            original = DataLoader.__init__
            cls._original = original

            @functools.wraps(original)
            def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
                original(loader, *args, **kwargs)
                for watcher in cls._active:
                    watcher._born[loader] = watcher.epoch

            cls._wrapper = __init__
            DataLoader.__init__ = __init__  # type: ignore[method-assign,assignment]
        if self not in cls._active:
            cls._active.append(self)

    def uninstall(self) -> None:
        cls = LoaderBirths
        if self in cls._active:
            cls._active.remove(self)
        if not cls._active and cls._original is not None and DataLoader.__init__ is cls._wrapper:
            DataLoader.__init__ = cls._original  # type: ignore[method-assign]
            cls._original = cls._wrapper = None

    def new_epoch(self) -> None:
        self.epoch += 1

    def built_this_epoch(self, *loaders: Any) -> bool:
        """Whether one of ``loaders`` (a wrapper and the DataLoader it iterates) was built in the
        running epoch."""
        for loader in loaders:
            try:
                if self._born.get(loader) == self.epoch:
                    return True
            except TypeError:  # not weakly referable: not a DataLoader built while installed
                continue
        return False


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

"""Mid-epoch positioning of Lightning's training loaders by replaying their own randomness.

Lightning iterates the user's training loaders as they are (same objects, same sampler, same worker
seeds): a fit with keepalive sees exactly the data a fit without it sees. What keepalive adds happens
where Lightning calls ``iter()`` on them: the fit loop's ``CombinedLoader`` (for the duration of a fit
its class is :func:`install` ed as a subclass whose ``__iter__`` hands Lightning's mode iterator thin
:class:`_Feed` iterables instead of the loaders, then puts the loaders back; ``flattened``,
``trainer.train_dataloader``, ``set_epoch`` and Lightning's own resumable-loader protocol see the
user's objects). Each ``iter()`` of a training ``DataLoader`` goes through a
:class:`keepalive.callbacks._torch_replay.LoaderReplay` (:class:`_Replay`):

* an ordinary iteration calls ``iter(loader)`` right there, as Lightning would (with workers through
  ``LoaderReplay``'s own, which fetches the first batch there only for a subclass that overrides
  ``__iter__``: with workers that draws nothing in this process), and records the random states it
  draws from (global RNGs, ``generator=``, the samplers' generators and counters) — and, without
  workers, the random state at its first batch too: Lightning creates an epoch's iterator ahead of
  its first batch (``configure_optimizers`` reading ``trainer.estimated_stepping_batches`` builds it
  before ``on_train_start`` and ``on_train_epoch_start``, whose hooks may draw random numbers), and a
  ``RandomSampler`` without workers draws its seed at the first batch;
* the first iteration of a resumed fit is made at its first batch (Lightning creates it before the loop
  state, the RNGs and ``set_epoch`` are restored): a mid-epoch checkpoint puts the recorded states back,
  creates the iterator the normal way while the index sampler skips the saved number of samples (index
  generation only, no fetch), then puts back the random state of the saved step; the workers' per-batch
  random states replay too. An epoch-end checkpoint puts back the loaders' generators and counters.
  With ``persistent_workers=True`` an epoch after the first resets the running iterator (no workers'
  base seed drawn); the iterator a resume creates starts new workers. The checkpoint carries what the
  running ones had (:class:`~keepalive.callbacks._torch_workers.PersistentWorkers`: the generator their
  base seed was drawn from, each worker's random state for its next batch, under ``"persistent"`` in a
  loader's position or epoch-end generators): the new workers get the same seed, drawn from a copy (the
  global generator is left as the uninterrupted fit has it), and start from those states.

A loader Lightning reloads for an epoch (``reload_dataloaders_every_n_epochs``) gets two ``iter()`` calls
(when it is built, and at the epoch's start: the first iterator is dropped unread), a fit resumed at that
epoch's start one: no batch is taken from an iterator before Lightning asks (a plain ``DataLoader``'s is
made inside ``iter()``; a batch taken ahead would make a worker fetch one more, and persistent workers go
on from that fetch), and the resumed fit makes the dropped ``iter()`` where the uninterrupted one made it
(:meth:`TrainData.iterate_unread`); an epoch-end checkpoint before a reload carries nothing of the loader.

So the saved position never goes through Lightning's own loader-state restore, which a
``configure_optimizers`` reading ``estimated_stepping_batches`` bypasses (it builds the loader before
the loop state is loaded: the position Lightning holds is never applied).

Which loaders: what :class:`LoaderReplay` replays (map-style datasets with any sampler or batch sampler
whose order is a function of the states above: ``shuffle=True/False``, ``batch_sampler=``,
``WeightedRandomSampler``, custom ones, checked once), or restores through ``state_dict()``
(``StatefulDataLoader``). Everything else (other ``IterableDataset`` s, an iterable that is not a
``DataLoader``, a sampler whose order does not replay): checkpoints at epoch ends only, said once.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader

from .. import rng
from ._torch_replay import LoaderReplay, samples_in

__all__ = ["TrainData", "install", "uninstall"]

#: the part of a loader's saved position (or epoch-end generators) that its persistent workers carry
PERSISTENT = "persistent"


class _Replay(LoaderReplay):
    """A :class:`LoaderReplay` whose iterator is created when asked (``begin``), not at its first batch:
    Lightning creates an epoch's iterator ahead of its first batch."""

    def __init__(self, loader: DataLoader):
        super().__init__(loader)
        self._running: Any = None  # persistent workers: the loader's running iterator

    def begin(self, start: Optional[Dict[str, Any]] = None, resumed: bool = False) -> Iterator[Tuple[Any, int]]:
        """``iter(loader)`` now, positioned at ``start`` (a saved :meth:`position`); an iterator of
        ``(batch, samples in it)``. With ``start``, the random state of now is put back once the
        loader is positioned. ``resumed``: the first iteration of a resumed fit (its workers are new).
        A subclass whose ``__iter__`` is a generator makes its iterator at the first ``next()``, not at
        ``iter()``: so does this (an iterator Lightning drops unread draws nothing, starts no worker)."""
        if inspect.isgeneratorfunction(type(self.loader).__iter__):
            return self._at_first_batch(start, resumed)
        return self._begin_now(start, resumed)

    def _at_first_batch(self, start: Optional[Dict[str, Any]], resumed: bool) -> Iterator[Tuple[Any, int]]:
        yield from self._begin_now(start, resumed)

    def _begin_now(self, start: Optional[Dict[str, Any]], resumed: bool) -> Iterator[Tuple[Any, int]]:
        loader = self.loader
        if self.mode == "stateful":
            holder = self.stateful_source()
            self.start_state = None
            if not (start and start.get("state") is not None and holder is not None):
                return ((b, samples_in(b, loader.batch_size)) for b in iter(loader))
            now = rng.capture()  # what loading the state and creating the iterator draw is not the step's
            holder.load_state_dict(start["state"])
            batches = iter(loader)
            rng.restore(now)
            return ((b, samples_in(b, loader.batch_size)) for b in batches)
        pos = self.positioner
        if self.mode == "epoch" or pos is None:
            return ((b, samples_in(b, loader.batch_size)) for b in iter(loader))
        at = (start or {}).get("at_iter") or {}
        # the random state of now is put back once the loader is positioned
        resume = self.position_at(start) if start else None
        start_state = self.record_start()
        # persistent workers: an epoch after the first resets the running iterator, which draws no
        # workers' base seed; the iterator a resume creates does: its draw is undone before the order's
        reset_before = bool(at.get("reset") if start else resumed) and self._persistent
        it, made = self._iter_now(pos, resume, rng.capture() if reset_before else None)
        if self._persistent:  # what the uninterrupted run's iter() did: reset the running iterator or not
            start_state["reset"] = bool(reset_before) or made is self._running
            self._running = made
        # e.g. a subclass whose __iter__ is a generator (it iterates after the stand-in left)
        if not self.check_opened(" when iter() is called"):
            return ((b, samples_in(b, loader.batch_size)) for b in it)
        if loader.num_workers == 0:
            if at.get("rng_next") is not None:
                # what drew from the global RNGs between the epoch's iter() and its first batch
                # (the sampler's seed is drawn at the first batch)
                rng.restore(at["rng_next"])
                start_state["rng_next"] = at["rng_next"]
            elif not start:
                start_state["rng_next"] = None  # taken at the first batch (_Feed)
        return self._batches(it)

    @property
    def _persistent(self) -> bool:
        return bool(self.loader.persistent_workers and self.loader.num_workers > 0)

    def persistent_now(self, consumed: Optional[int]) -> Optional[Dict[str, Any]]:
        """What this loader's persistent workers carry into their next batches (their base seed's
        generator, each worker's random state), for a checkpoint: inside an epoch after ``consumed``
        batches, or (None) at its end; None when there are no such workers."""
        kept, pos = self.persistence, self.positioner
        if kept is None or pos is None:
            return None
        return kept.state(pos, consumed, running_pass=consumed is not None)

    def load_persistent(self, saved: Optional[Dict[str, Any]]) -> None:
        """A checkpoint's :meth:`persistent_now`, before the resumed fit's first ``iter()``: the new
        workers start from the seed and states the uninterrupted run's workers had."""
        if saved and self.persistence is not None:
            self.persistence.load(saved)

    def _iter_now(self, pos: Any, resume: Optional[Dict[int, Any]], state: Optional[Dict[str, Any]]
                  ) -> Tuple[Iterator[Any], Any]:
        """Its batches and the loader's iterator: ``iter(loader)`` with the index sampler replaced by
        the positioning stand-in, put back right after (the iterator keeps it). ``state``: the random
        state the index sampler starts from (put back when the iterator asks for its indices:
        persistent workers)."""
        if self.loader.num_workers > 0:
            # the replay's own iter(), which also puts in the dataset stand-in noting the workers' random
            # states; it fetches the first batch too, which with workers draws nothing in this process
            # (the order and the workers' seeds are drawn inside iter() with workers)
            index = _StartsFrom(pos, state) if state is not None else None
            # the iterator is made (order, seeds, prefetched indices) inside iter(): its first batch
            # waits for Lightning's next(), which matters when Lightning drops the iterator unread (it
            # calls iter() twice on a loader reloaded each epoch): a batch taken now sends a worker one
            # more index, and persistent workers' random states would go on from that extra fetch. A
            # subclass whose __iter__ is a generator makes its iterator at the first next(): taken now
            made, first = self.open(resume, index, first=inspect.isgeneratorfunction(type(self.loader).__iter__))
            if index is not None:
                index.state = None
            return itertools.chain(first, made), made
        # no workers: the first batch is fetched when Lightning asks for it (hooks run in between may
        # draw random numbers, and the sampler draws its seed at the first batch)
        it, _ = self.open(first=False)
        return it, it

    def _batches(self, it: Iterator[Any]) -> Iterator[Tuple[Any, int]]:
        for batch in it:
            yield self.counted(batch)


class _StartsFrom:
    """The positioning stand-in, putting back a random state each time ``iter()`` asks it for indices
    while armed (the multi-process iterator asks after drawing its workers' base seed)."""

    def __init__(self, inner: Any, state: Optional[Dict[str, Any]]):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "state", state)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        if self.state is not None:
            rng.restore(self.state)
        return iter(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "state"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the stand-in's counters live in the stand-in
        if name == "state":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)


class _Feed:
    """What Lightning's mode iterator calls ``iter()`` on in place of one training loader."""

    def __init__(self, data: "TrainData", index: int, loader: Any):
        self.data, self.index, self.loader = data, index, loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self.data.open(self.index, self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("data", "index", "loader"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class Stream:
    """One iteration (an epoch's pass) over a training loader, counting what it hands to Lightning."""

    def __init__(self, data: "TrainData", index: int, replay: Optional[_Replay], loader: Any, deferred: bool):
        self.data, self.index, self.replay, self.loader = data, index, replay, loader
        self.samples = 0   # samples handed out in the epoch
        self.batches = 0   # batches handed out (the true index in the epoch)
        self._first = True
        self._it: Optional[Iterator[Tuple[Any, int]]] = None
        if not deferred:
            self._it = self._begin(None, None, resumed=False)

    def _begin(self, start: Optional[Dict[str, Any]], generators: Optional[Dict[str, Any]],
               resumed: bool = True) -> Iterator[Tuple[Any, int]]:
        rp = self.replay
        if rp is None:
            return ((b, 0) for b in iter(self.loader))
        if generators:
            rp.load_generators(generators)  # an epoch-end checkpoint: where this epoch starts
        if start:
            self.samples, self.batches = int(start["samples"]), int(start["batches"])
        rp.load_persistent((start or generators or {}).get(PERSISTENT))
        return rp.begin(start, resumed=resumed)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        if self._it is None:  # the first iteration of a resumed fit: made at its first batch
            # after the dropped iter() of a reloaded loader, its iteration starts as in the uninterrupted
            # fit (new workers there too), not as a resumed one
            self._it = self._begin(*self.data.take_resume(self.index, self.replay), resumed=not self.data.reloaded)
        if self._first:
            self._first = False
            st = self.replay.start_state if self.replay is not None else None
            if st is not None and "rng_next" in st and st["rng_next"] is None:
                st["rng_next"] = rng.capture()  # the state the sampler's first draw sees
        batch, n = next(self._it)
        self.samples += n
        self.batches += 1
        self.data.samples_out += n if self.index == 0 else 0
        return batch

    def position(self) -> Optional[Dict[str, Any]]:
        if self.replay is None or not self.replay.mid_epoch:
            return None
        out = self.replay.position(self.samples, self.batches)
        persistent = self.replay.persistent_now(self.batches)
        if persistent is not None:
            out[PERSISTENT] = persistent
        return out


class TrainData:
    """The training loaders of one fit as Lightning iterates them: their replays, their running
    streams, and where a resumed fit continues."""

    def __init__(self, warn: Callable[[str, str], None]):
        self.warn = warn
        self.replays: Dict[int, Tuple[Any, Optional[_Replay]]] = {}  # index -> (loader, its replay)
        self.streams: Dict[int, Stream] = {}
        self.why_not: Optional[str] = None
        self.samples_out = 0
        self._starts: Optional[Dict[int, Any]] = None      # a resumed fit: index -> saved position
        self._generators: Optional[Dict[int, Any]] = None  # a resumed fit at an epoch end
        self._taken: set = set()  # loaders whose first iteration of a resumed fit has begun
        self.reloaded = False  # the resumed fit made the iter() Lightning drops on a reloaded loader
        self._installed: List[Tuple[Any, type]] = []

    # -------------------------------------------------------------------------------- resume
    def resume_at(self, starts: Optional[List[Any]], generators: Optional[List[Any]]) -> None:
        """The first iteration of each loader in this fit continues from a checkpoint: ``starts``
        (positions inside an epoch, by loader index) or ``generators`` (an epoch-end checkpoint)."""
        self._starts = {i: s for i, s in enumerate(starts or [])}
        self._generators = {i: g for i, g in enumerate(generators or [])}
        self._taken = set()

    def forget_resume(self) -> None:
        self._starts = self._generators = None

    # ------------------------------------------------------------------------------- loaders
    def replay_of(self, index: int, loader: Any) -> Optional[_Replay]:
        known = self.replays.get(index)
        if known is not None and known[0] is loader:
            return known[1]
        if known is not None and known[1] is not None:
            known[1].close()
        rp = _Replay(loader) if isinstance(loader, DataLoader) else None
        self.replays[index] = (loader, rp)
        return rp

    def check(self, loaders: List[Any]) -> Optional[str]:
        """Why these training loaders cannot be positioned inside an epoch (None: they can)."""
        why: Optional[str] = None
        for i, loader in enumerate(loaders):
            rp = self.replay_of(i, loader)
            w: Optional[str]
            if rp is None:
                w = (f"the training data is a {type(loader).__name__}, not a torch DataLoader: checkpoints "
                     "at epoch ends only")
            else:
                w = None if rp.mid_epoch else (rp.why_not or f"{type(loader).__name__}: checkpoints at epoch "
                                                              "ends only")
            why = why or w
        self.why_not = why
        return why

    def why_now(self) -> Optional[str]:
        """Why a loader turned out not positionable while iterating (e.g. a subclass iterating
        outside its batch sampler), or None."""
        return next((rp.why_not or "checkpoints at epoch ends only" for _, rp in self.replays.values()
                     if rp is not None and not rp.mid_epoch), None)

    def open(self, index: int, loader: Any) -> Stream:
        """``iter()`` of training loader ``index``: now, or (the first one of a resumed fit) at its
        first batch, where the loader is positioned."""
        rp = self.replay_of(index, loader)
        deferred = self._starts is not None and index not in self._taken
        stream = Stream(self, index, rp, loader, deferred)
        self.streams[index] = stream
        return stream

    def take_resume(self, index: int, rp: Optional[_Replay]) -> Tuple[Optional[Dict[str, Any]], Any]:
        """Where loader ``index`` continues (once per fit): its saved position, its generators."""
        if self._starts is None or self._generators is None or index in self._taken:
            return None, None
        self._taken.add(index)
        start, gens = self._starts.get(index), self._generators.get(index)
        if rp is None or not rp.mid_epoch:
            start = None
        return start, gens

    # ---------------------------------------------------------------------------------- state
    def positions(self) -> List[Optional[Dict[str, Any]]]:
        """Where each training loader's running pass is (a mid-epoch checkpoint)."""
        n = max(self.replays) + 1 if self.replays else 0
        return [s.position() if (s := self.streams.get(i)) is not None else None for i in range(n)]

    def generators_now(self, reloaded: bool = False) -> List[Optional[Dict[str, Any]]]:
        """The loaders' generators and counters now, and what their persistent workers carry into the
        next epoch (an epoch-end checkpoint). ``reloaded``: Lightning builds the next epoch's loaders
        anew (``reload_dataloaders_every_n_epochs``): they start from what your code gives them, with
        new workers, in a resumed fit as in the uninterrupted one, so nothing is carried."""
        n = max(self.replays) + 1 if self.replays else 0
        out: List[Optional[Dict[str, Any]]] = []
        for i in range(n if not reloaded else 0):
            rp = self.replays.get(i, (None, None))[1]
            now = rp.generators_now() if rp is not None else None
            persistent = rp.persistent_now(None) if rp is not None else None
            if now is not None and persistent is not None:
                now[PERSISTENT] = persistent
            out.append(now)
        return out

    def workers_untold(self, positions: List[Optional[Dict[str, Any]]]) -> Optional[int]:
        """The number of workers of a loader whose workers draw random numbers but whose states this
        checkpoint lacks (None: no such loader)."""
        for i, (loader, rp) in self.replays.items():
            pos = positions[i] if i < len(positions) else None
            if rp is not None and rp.workers_draw() and pos is not None and pos.get("workers") is None:
                return int(loader.num_workers)
        return None

    def persistent_draws(self) -> Optional[int]:
        """The number of workers of a loader with persistent workers that draw random numbers and that a
        checkpoint does not carry (their streams do not continue across a resume), or None. Those it
        carries but could not take every state of for this checkpoint are said here, once."""
        for loader, rp in self.replays.values():
            if rp is None or not rp._persistent or not rp.workers_draw():
                continue
            if rp.persistence is None:
                return int(loader.num_workers)
            if rp.persistence.inexact:
                self.warn(rp.persistence.inexact, f"inexact:{rp.persistence.inexact}")
        return None

    def iterate_unread(self) -> None:
        """The ``iter()`` of each training loader that the uninterrupted fit made at this epoch's start
        and never read: Lightning calls ``iter()`` on a loader reloaded for an epoch twice (when it
        builds it, and when the epoch starts), a fit resumed at that epoch's start once. Made here, at
        the same moment of the epoch's start, it draws what the uninterrupted fit's did (the workers'
        base seed, the order's seed; persistent workers start and fetch ahead as they did there)."""
        self.reloaded = True
        for _, (loader, rp) in sorted(self.replays.items()):
            unread = rp.begin(None) if rp is not None else iter(loader)
            del unread  # as Lightning drops it: non-persistent workers end with it

    def take_samples(self) -> int:
        n, self.samples_out = self.samples_out, 0
        return n

    def close(self) -> None:
        uninstall(self)
        for _, rp in self.replays.values():
            if rp is not None:
                rp.close()
        self.streams.clear()


_REPLAYING: Dict[type, type] = {}
_DATA = "_keepalive_data"  #: where an installed combined loader keeps its TrainData (in its __dict__)


def _replaying(base: type) -> type:
    """A subclass of Lightning's ``CombinedLoader`` (either namespace) whose ``iter()`` goes through
    :class:`TrainData`."""
    cls = _REPLAYING.get(base)
    if cls is None:
        base_iter: Callable[[Any], Any] = vars(base).get("__iter__") or base.__iter__  # type: ignore[attr-defined]

        def __iter__(self: Any) -> Any:
            data = self.__dict__.get(_DATA)
            if data is None:
                return base_iter(self)
            flat = self._flattened
            self._flattened = [_Feed(data, i, dl) for i, dl in enumerate(flat)]
            try:
                return base_iter(self)
            finally:
                self._flattened = flat

        cls = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__})
        _REPLAYING[base] = cls
    return cls


def install(combined_loader: Any, data: TrainData) -> None:
    """Lightning's combined training loader iterates through ``data`` until :func:`uninstall`."""
    base = type(combined_loader)
    if base in _REPLAYING.values():
        combined_loader.__dict__[_DATA] = data
        return
    combined_loader.__class__ = _replaying(base)
    combined_loader.__dict__[_DATA] = data
    data._installed.append((combined_loader, base))


def uninstall(data: TrainData) -> None:
    for combined_loader, base in reversed(data._installed):
        combined_loader.__dict__.pop(_DATA, None)
        combined_loader.__class__ = base
    data._installed.clear()


"""Mid-epoch resume for a ``torch.utils.data.DataLoader`` by replaying the loader's own randomness.

The user's loader is iterated as it is: same sampler, same batches, same worker seeds, so a training
with keepalive sees exactly the data a training without it sees. What keepalive adds happens around
``iter(loader)``:

* it records the states the epoch's iteration draws from: the global random generators (a plain
  ``shuffle=True`` draws the sampler's seed and the workers' base seed from torch's), the loader's
  ``generator=``, private generators of its sampler and batch sampler (``RandomSampler(generator=g)``,
  ``WeightedRandomSampler``, a custom sampler's ``self.rng``), and the ``state_dict()`` of a sampler
  that has one;
* to resume at sample (or batch) ``k`` of an epoch it puts those states back, creates the iterator
  the normal way, and advances the *index* iterator over the first ``k`` indices: index generation
  only, no ``__getitem__``, no worker fetch for the skipped part; then it puts back the random state
  of the saved step, and the epoch continues as it did.

Which loaders (:attr:`LoaderReplay.mode`):

* ``"replay"``: map-style datasets with any sampler or batch sampler whose order is a function of the
  states above (``shuffle=True/False``, ``batch_sampler=``, ``SubsetRandomSampler``,
  ``WeightedRandomSampler``, ``DistributedSampler`` after ``set_epoch``, custom ones, DataLoader
  subclasses that iterate through ``batch_sampler``). A sampler keepalive does not know is checked
  once: two deep copies generate their first batches from the same states; different batches, or a
  sampler that changes its own attributes (other than integers, such as an epoch count, which are
  saved and restored) when iterated, cannot be replayed (``why_not``).
* ``"stateful"``: a loader with ``state_dict()`` / ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``), or, with ``num_workers=0``, a dataset with them (a Hugging Face
  ``datasets.IterableDataset``): saved and restored through that protocol.
* ``"epoch"``: everything else (other ``IterableDataset`` s, ``in_order=False``): checkpoints at
  epoch ends only, and :attr:`why_not` says why.

Worker processes: the order and the workers' base seed replay exactly. Random draws *inside* workers
(augmentation) do not after a mid-epoch resume: PyTorch seeds each worker once per epoch, and which
worker fetched how many batches before the saved one is not replayed. keepalive notices draws in
workers (:meth:`LoaderReplay.workers_draw`) so that the adapter can say so at the first mid-epoch
save; from then on each batch a worker fetches carries the random state it starts from
(:class:`keepalive.callbacks.replay.WorkerStates`, shared with the fastai adapter), and a mid-epoch
checkpoint keeps those of the next ``num_workers`` batches. Workers that live on across epochs
(``persistent_workers=True``) draw their base seed once and carry their random states from one epoch to
the next: :class:`PersistentWorkers` saves those states and the seed's generator, so that the new
workers of a resumed process go on as the uninterrupted run's did.

The steps of an iteration are public (:meth:`LoaderReplay.position_at`, :meth:`~LoaderReplay.open`,
:meth:`~LoaderReplay.counted`, ...) for an adapter that creates the iterator itself (Lightning's).
"""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import random
import sys
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, get_worker_info

from .. import rng
from .replay import WorkerStates
from .torchstate import FABRIC_MODULES, RandomState

__all__ = ["LoaderReplay", "ForeignIterators", "LoaderBirths", "DatasetKeys", "batch_len", "samples_in"]

_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_KNOWN_SAMPLERS = frozenset({
    "torch.utils.data.sampler.SequentialSampler", "torch.utils.data.sampler.RandomSampler",
    "torch.utils.data.sampler.SubsetRandomSampler", "torch.utils.data.sampler.WeightedRandomSampler",
    "torch.utils.data.sampler.BatchSampler", "torch.utils.data.distributed.DistributedSampler",
})
_PROBE_BATCHES = 3
#: the flag a loader's workers leave once a fetch drew random numbers (augmentation in workers)
_DRAWS = "draws"


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class _Positioned:
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
                b = _Tagged(b)
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


class _Tagged(list):
    """A batch of indices that carries ``(iteration, batch number)`` to the worker fetching it."""

    tag: Tuple[int, int] = (0, 0)


def _full_state() -> Tuple[bytes, Any, Any]:
    """This process's global random states (torch CPU, python, numpy), picklable."""
    return (bytes(torch.random.get_rng_state().numpy().tobytes()), random.getstate(), np.random.get_state())


def _plain_state(state: Tuple[bytes, Any, Any]) -> Dict[str, Any]:
    """:func:`_full_state` as plain values a checkpoint stores (a checkpoint is never unpickled)."""
    version, internal, gauss = state[1]
    name, keys, pos, has_gauss, cached = state[2]
    return {"torch": torch.frombuffer(bytearray(state[0]), dtype=torch.uint8).clone(),
            "python": [int(version), np.asarray(internal, dtype=np.uint64), gauss],
            "numpy": [str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)]}


def _set_plain_state(state: Dict[str, Any]) -> None:
    torch.random.set_rng_state(state["torch"].clone())
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))


class _WorkerDraws:
    """The dataset as the workers of one loader see it (a stand-in made around ``iter(loader)``).

    It fetches exactly what the user's dataset fetches. Around each fetch it compares the worker's
    global random states: once a fetch draws random numbers (augmentation in workers), it notes so
    (a flag) and from then on notes, before each fetch, the worker's random state for that batch
    (:class:`keepalive.callbacks.replay.WorkerStates`, which also gives a resumed iteration's first
    batches the states the uninterrupted run's workers had)."""

    def __init__(self, dataset: Any, states: WorkerStates, serial: int = 0):
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "_states", states)
        #: the iteration that started the workers: a resumed one's saved states are its batches' only
        #: (persistent workers make the same batch numbers again in later iterations)
        object.__setattr__(self, "_serial", serial)

    def __getattr__(self, name: str) -> Any:  # worker_init_fn / collate code reading the dataset
        if name in ("dataset", "_states", "_serial"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:  # a worker_init_fn opening a file handle
        setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self._watch(index, lambda: self.dataset[index])

    def __getitems__(self, indices: List[Any]) -> Any:
        plain = list(indices)
        inner = getattr(self.dataset, "__getitems__", None)
        if inner is not None:
            return self._watch(indices, lambda: inner(plain))
        return self._watch(indices, lambda: [self.dataset[i] for i in plain])

    def _watch(self, indices: Any, fetch: Callable[[], Any]) -> Any:
        global _making
        tag = getattr(indices, "tag", None)
        info = get_worker_info()
        if tag is None or info is None:
            return fetch()
        serial, number = tag
        states = self._states
        _making = tag
        if serial != self._serial and states.resume:
            states.resume.clear()
        if number < info.num_workers:  # persistent workers: a resumed run hands them their states
            handed = states.handed(serial, number)
            if handed is not None:
                _set_plain_state(handed)
        drawing = states.marked(_DRAWS)
        before = states.start(serial, number, info.num_workers, _full_state, note=drawing)
        out = fetch()
        if not drawing and not _same_state(before, _full_state()):
            states.note(serial, number, info.num_workers, before)
            states.mark(_DRAWS)
        return out


def _same_state(a: Tuple[bytes, Any, Any], b: Tuple[bytes, Any, Any]) -> bool:
    return a[0] == b[0] and a[1] == b[1] and int(a[2][2]) == int(b[2][2]) and bool((a[2][1] == b[2][1]).all())


#: in a worker: the batch it is making, ``(iteration, number)`` (read by :class:`_NoteAfter`)
_making: Optional[Tuple[int, int]] = None
#: persistent workers' states and base seed carried across a resume (False: not, as keepalive did
#: before; the tests' control)
CARRY_PERSISTENT = True


class _NoteAfter:
    """Stands in for the ``collate_fn`` of a loader with persistent workers. In a worker, once a batch is
    made (collated: a random collator's draws included), the worker's state is noted as that of the
    batch it makes next, ``number + num_workers``: in this iteration, or for its last batch, the state
    it starts the next iteration from."""

    def __init__(self, inner: Callable[[Any], Any], states: WorkerStates):
        self.inner, self.states = inner, states

    def __call__(self, data: Any) -> Any:
        out = self.inner(data)
        info = get_worker_info()
        if info is not None and _making is not None:
            serial, number = _making
            self.states.note(serial, number + info.num_workers, info.num_workers, _full_state())
        return out


class PersistentWorkers:
    """What the workers of a loader with ``persistent_workers=True`` carry from one iteration to the next,
    and how a resumed process goes on with them.

    The loader's first ``iter()`` starts the workers, and draws their base seed (from torch's global
    generator, or the loader's ``generator=``); each later ``iter()`` resets the same iterator: no seed
    is drawn, and each worker's generators go on from where its last batch left them. A resumed
    process has no workers yet: its first ``iter()`` starts new ones. So that it goes on as the
    uninterrupted run did, when that run's ``iter()`` was a reset:

    * the base seed is drawn from a copy of the generator as it was when the uninterrupted run started
      its workers (the same seed for ``worker_init_fn``; nothing is drawn from the generator itself);
    * each worker notes its state after each batch (:class:`_NoteAfter`); a checkpoint keeps, per slot
      (the worker that makes batch ``j`` of every iteration, round-robin from batch 0), the state it
      starts its next batch from, where the batches saved by position do not give it;
    * the new workers start their first batches from these states. A resume inside an epoch starts at
      batch ``k`` on the first worker, another slot: at the next iteration each slot's state is handed
      (:meth:`WorkerStates.hand`) to the worker that makes that slot's batches from then on.
    """

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.workers = int(loader.num_workers)
        self.states: Optional[WorkerStates] = None
        self.seed_state: Optional[torch.Tensor] = None  # the base seed's generator when the workers started
        self.running = False   # the uninterrupted run has started the workers: its next iter() resets them
        self.reset = False     # the running iteration reset the workers (or stands for a reset)
        self.rebuilt = False   # the training builds this loader anew each epoch (new workers each time)
        self.carry: Dict[int, Any] = {}        # slot -> a saved state this process's workers do not have yet
        self.start_slots: Dict[int, Any] = {}  # slot -> the state it began the running iteration with
        self.offset = 0        # the running iteration's first batch made in this process
        self.opened = False    # this process has iterated the loader
        self.inexact = ""

    def load(self, saved: Dict[str, Any]) -> None:
        """A checkpoint's :meth:`state` (before this process iterates the loader)."""
        workers = int(saved.get("workers", self.workers))
        if workers != self.workers:
            self.inexact = (f"the checkpoint was written with {workers} persistent loader worker(s), this "
                            f"training has {self.workers}: the data order resumes exactly, the workers' "
                            f"random draws do not. Keep num_workers={workers} for an exact resume")
        self.running = bool(saved.get("reset"))
        self.seed_state = saved.get("seed")
        self.carry = {int(j): s for j, s in (saved.get("next") or {}).items()}

    def opening(self, states: WorkerStates, pos: "_Positioned", resume: Optional[Dict[int, Any]]
                ) -> Tuple[Dict[int, Any], Optional[torch.Generator]]:
        """Before ``iter(loader)`` makes the iteration after ``pos.serial`` (from batch ``pos.first``):
        the saved states of its first batches, for new workers, and the generator that draws their base
        seed (None: the loader's own)."""
        self.states = states
        resume, gen = dict(resume or {}), None
        if self.loader._iterator is None:  # iter() starts the workers
            if self.running and self.seed_state is not None:  # where the uninterrupted run reset them
                gen = torch.Generator()
                gen.set_state(self.seed_state.clone())
            elif not self.running:
                g = self.loader.generator
                self.seed_state = g.get_state() if g is not None else torch.get_rng_state()
            self.reset, self.offset, self.start_slots = self.running, pos.first, dict(self.carry)
            if not pos.first:
                total = _length(pos, self.workers)
                resume.update({j: s for j, s in self.carry.items() if j < total})
                self.carry = {}
        else:  # a reset: the workers go on from their last batches
            if not self.opened:
                self.inexact = (
                    f"the loader's {self.workers} persistent worker(s) (persistent_workers=True) were started "
                    "before its first ckpt.batches() loop (the loader was iterated before): a resume starts "
                    "new ones, whose seed and random states differ from the uninterrupted run's. Iterate it "
                    "only through ckpt.batches(), or use persistent_workers=False")
            slots = self._slots(pos.serial, pos.made, pos.made) if self._needed() else {}
            if self.offset % self.workers or self.carry:  # this process's workers are on other slots
                for j, state in slots.items():
                    states.hand(pos.serial + 1, j, state)
            self.start_slots, self.carry, self.offset, self.reset = slots, {}, 0, True
        self.running = self.opened = True
        return resume, gen

    def around_iter(self, loader: DataLoader, gen: Optional[torch.Generator]) -> Callable[[], None]:
        """Put in the collator noting the workers' states (and ``gen``) for ``iter(loader)``; returns
        what puts the loader's own back."""
        collate, generator = loader.collate_fn, loader.generator
        assert self.states is not None
        object.__setattr__(loader, "collate_fn", _NoteAfter(collate, self.states))
        if gen is not None:
            object.__setattr__(loader, "generator", gen)

        def put_back() -> None:
            object.__setattr__(loader, "collate_fn", collate)
            object.__setattr__(loader, "generator", generator)
        return put_back

    def state(self, pos: "_Positioned", consumed: Optional[int] = None, running_pass: bool = False
              ) -> Optional[Dict[str, Any]]:
        """What a checkpoint keeps (None: nothing; a resume starts the workers as the uninterrupted run
        did). ``running_pass``: an iteration is under way, with ``consumed`` batches trained (a training
        pass saved by position) or None (an evaluation, made again whole by a resume)."""
        if not self.opened:  # loaded, not iterated in this process yet: as loaded
            return {"reset": self.running, "seed": self.seed_state, "workers": self.workers,
                    "next": {str(j): s for j, s in self.carry.items()}} if self.running or self.carry else None
        if not running_pass and self.rebuilt:
            return None  # the next epoch's loader starts new workers, as it does in the uninterrupted run
        if running_pass and consumed is None:
            slots = dict(self.start_slots)
        elif not self._needed():
            slots = {}
        elif running_pass:
            slots = self._slots(pos.serial, _length(pos, pos.made), int(consumed or 0))
        else:
            slots = self._slots(pos.serial, pos.made, pos.made)
        reset = self.reset if running_pass else True
        return {"reset": reset, "seed": self.seed_state, "workers": self.workers,
                "next": {str(j): s for j, s in slots.items()}}

    def _needed(self) -> bool:
        """The workers draw random numbers (their states matter), or states wait to be handed."""
        return bool(self.carry) or (self.states is not None and self.states.marked(_DRAWS))

    def _slots(self, serial: int, sent: int, upto: int) -> Dict[int, Any]:
        """Slot -> the state its worker starts its next batch from, once the batches before ``sent`` of
        iteration ``serial`` are made; only the slots whose last such batch is before ``upto`` (the
        others' next batches are in this iteration, saved by position)."""
        w, out = self.workers, {}
        for j in range(w):
            last = j + (sent - 1 - j) // w * w if j < sent else -1  # the slot's last batch
            if last >= upto:
                continue
            state = None
            if last >= self.offset and self.states is not None:  # made by this process's workers
                got = self.states.look_ahead(serial, last + w, 1, last + w + 1, _plain_state)
                state = got[str(last + w)] if got else None
            elif last < self.offset:
                state = self.start_slots.get(j)
            if state is None:
                self.inexact = (
                    f"the loader's {w} persistent worker(s) (persistent_workers=True) draw random numbers, "
                    "and keepalive could not take the state of each for this checkpoint (a worker "
                    "that made no batch in this process, or did not note its state in time): a resume "
                    "from it replays the data order exactly, but not the workers' draws. "
                    "persistent_workers=False resumes bit-exactly")
            else:
                out[j] = state
        return out


def _length(pos: Any, default: int) -> int:
    """Batches in an iteration of ``pos`` (``default`` without a length)."""
    try:
        return len(pos)
    except TypeError:
        return default


class LoaderReplay:
    """How keepalive positions one user ``DataLoader`` (see the module docstring)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        #: the torch DataLoader whose sampler and dataset are stood in for: Accelerate's DataLoaderShard
        #: is no DataLoader (it poses as one through __class__) and iterates the one it wraps
        self.base: DataLoader = _base_loader(loader)
        #: Accelerate's DataLoaderDispatcher: rank 0 reads the batches of every rank from ``base``
        self.dispatch = _Dispatch.of(loader)
        #: integer attributes as the code built them: those that change later are counters (an epoch)
        self._initial_ints = self._ints()
        self.why_not = ""
        #: why a mid-epoch resume of this loader is not bit-exact although it is positioned ('' if it is)
        self.inexact = ""
        self.mode = self._mode()
        if self.dispatch is not None and self.dispatch.completes_last_batch(loader):
            self.inexact = (
                "the DataLoaderDispatcher (dispatch_batches=True) completes each epoch's last, uneven "
                "batch with samples of the epoch's first batch, and a resumed epoch's first batch is "
                "another one: from a mid-epoch checkpoint that last batch differs from an uninterrupted "
                "run's. Make the dataset's length a multiple of batch_size x processes, or pass "
                "drop_last=True, for an exact resume")
        self.start_state: Optional[Dict[str, Any]] = None  # recorded at the running iteration's iter()
        self._positioned: Optional[_Positioned] = None
        self._states: Optional[WorkerStates] = None  # the workers' random states (workers > 0)
        if self.mode == "replay":
            index_sampler = _index_sampler(loader, self.base)
            self._positioned = _Positioned(index_sampler)
            self._positioned.by_samples = type(index_sampler) is BatchSampler
            # a wrapper around the DataLoader (Accelerate's) fetches ahead: note from the first batch
            self._positioned.noting = self.base is not loader
            self.why_not = _probe(self.loader, index_sampler, self._samplers())
            if self.why_not:
                self.mode, self._positioned = "epoch", None
        base = self.base
        #: what persistent workers carry from one iteration to the next (None: no such workers)
        self.persistence = PersistentWorkers(base) if self._positioned is not None and CARRY_PERSISTENT \
            and base.persistent_workers and base.num_workers > 0 else None

    @property
    def mid_epoch(self) -> bool:
        """A checkpoint can be resumed inside an epoch of this loader."""
        return self.mode != "epoch"

    @property
    def batch_size(self) -> Optional[int]:
        return self.loader.batch_size

    @property
    def by_samples(self) -> bool:
        """Positions count samples (the batch size may change between sessions), not batches."""
        return self._positioned is not None and self._positioned.by_samples

    # ------------------------------------------------------------------------------ what it is
    def stateful_source(self) -> Optional[Any]:
        """What saves and restores this loader's position through ``state_dict()`` /
        ``load_state_dict()`` (``"stateful"`` mode): the loader, or its dataset; else None."""
        # Accelerate's wrappers have state_dict() whatever they wrap; only a StatefulDataLoader's works
        if callable(getattr(self.loader, "state_dict", None)) and \
                callable(getattr(self.loader, "load_state_dict", None)) and \
                (self.base is self.loader or callable(getattr(self.base, "state_dict", None))):
            return self.loader
        ds = self.loader.dataset
        if isinstance(ds, IterableDataset) and callable(getattr(ds, "state_dict", None)) and \
                callable(getattr(ds, "load_state_dict", None)) and self.loader.num_workers == 0:
            return ds
        return None

    def _mode(self) -> str:
        holder = self.stateful_source()
        if holder is not None:
            if _buffered_shuffle(holder):
                self.inexact = (f"{type(holder).__name__} shuffles with a buffer that its state_dict() does "
                                "not hold: a resume from a mid-epoch checkpoint refills the buffer, so the "
                                "rest of that epoch sees another order than an uninterrupted run")
            return "stateful"
        loader = self.loader
        name = type(loader).__name__
        if isinstance(loader.dataset, IterableDataset):
            if callable(getattr(loader.dataset, "state_dict", None)):
                self.why_not = (f"{name} over a {type(loader.dataset).__name__} with {loader.num_workers} "
                                "workers: its state_dict() cannot see the workers' position; use "
                                "torchdata's StatefulDataLoader (or num_workers=0) to resume mid-epoch. "
                                "Until then checkpoints are taken at epoch ends only")
            else:
                self.why_not = (f"{name} over an IterableDataset ({type(loader.dataset).__name__}) cannot be "
                                "positioned without reading it; checkpoints are taken at epoch ends only. "
                                "Give it state_dict()/load_state_dict() (or use torchdata's "
                                "StatefulDataLoader) to resume mid-epoch")
            return "epoch"
        if getattr(loader, "in_order", True) is False:
            self.why_not = ("DataLoader(in_order=False) yields batches in the order workers finish them: "
                            "checkpoints at epoch ends only (in_order=True resumes anywhere)")
            return "epoch"
        return "replay"

    def _samplers(self) -> List[Tuple[str, Any]]:
        """The sampler objects an iteration uses, by path (samplers inside samplers too: a batch
        sampler's sampler, Accelerate's shard around the user's batch sampler)."""
        found: List[Tuple[str, Any]] = []
        seen = {id(self.loader.dataset)}
        todo: List[Tuple[str, Any, int]] = [("batch_sampler", self.loader.batch_sampler, 0),
                                            ("sampler", self.loader.sampler, 0)]
        while todo:
            path, obj, depth = todo.pop(0)
            if obj is None or id(obj) in seen or isinstance(obj, (_Positioned, torch.Tensor, list, tuple)):
                continue
            seen.add(id(obj))
            found.append((path, obj))
            if depth < 3:
                todo += [(f"{path}.{a}", getattr(obj, a, None), depth + 1) for a in ("batch_sampler", "sampler")]
        return found

    def _counters(self) -> Dict[str, Dict[str, int]]:
        """The integer attributes of the loader and its samplers that changed since the code built
        them (an epoch count, such as ``set_epoch`` or Accelerate's sampler keep): the order may
        depend on them."""
        now = self._ints()
        return {p: {k: v for k, v in attrs.items() if self._initial_ints.get(p, {}).get(k) != v}
                for p, attrs in now.items() if attrs != self._initial_ints.get(p)}

    def _ints(self) -> Dict[str, Dict[str, int]]:
        objects = [("loader", self.loader), *self._samplers()]
        return {p: {k: v for k, v in _plain_attrs(o).items() if type(v) is int} for p, o in objects}

    def _load_counters(self, saved: Dict[str, Dict[str, int]]) -> None:
        objects = dict(self._samplers())
        objects["loader"] = self.loader
        for path, attrs in saved.items():
            obj = objects.get(path)
            if obj is not None:
                for k, v in attrs.items():
                    object.__setattr__(obj, k, int(v))

    def _generators(self) -> Dict[str, Any]:
        """Every private generator the iteration may draw from, by path (each object once)."""
        gens: Dict[str, Any] = {}
        seen = set()
        if self.loader.generator is not None:
            gens["generator"] = self.loader.generator
            seen.add(id(self.loader.generator))
        for path, obj in self._samplers():
            for attr, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
                if isinstance(value, _GENERATOR_TYPES) and id(value) not in seen:
                    seen.add(id(value))
                    gens[f"{path}.{attr}"] = value
        return gens

    # ---------------------------------------------------------------------------- iteration
    def iterate(self, start: Optional[Dict[str, Any]] = None,
                on_positioned: Optional[Callable[[], None]] = None) -> Iterator[Tuple[Any, int]]:
        """Yields ``(batch, samples in it)``. With ``start`` (a saved :meth:`position`), the
        iteration continues from there; ``on_positioned`` runs once the loader is positioned, right
        before the first batch is fetched (to put back the random state of the saved step)."""
        if self.mode == "stateful":
            self.start_state = None
            yield from _stateful_batches(self.loader, self.stateful_source(), start, on_positioned)
            return
        if self.mode == "epoch" or self._positioned is None:
            for batch in _ours(iter(self.loader)):
                yield batch, samples_in(batch, self.loader.batch_size)
            return
        pos = self._positioned
        resume = self.position_at(start, on_positioned) if start else None
        self.record_start()
        it, first = self.open(resume)
        if self.dispatch is not None and not self.dispatch.reads and pos.on_positioned is not None:
            # a rank that reads nothing (rank 0 sends it its part) never runs its index sampler, where
            # the positioning hook runs: it is positioned once its first batch has come
            hook, pos.on_positioned = pos.on_positioned, None
            pos.skip, pos.first, pos.ahead = 0, 0, []
            hook()
        self.check_opened()
        for batch in itertools.chain(first, _ours(it)):
            if self.dispatch is not None:
                yield self._dispatched(pos, batch)
                continue
            if not pos.generated:
                yield self.unpositioned(batch)
                continue
            pos.last_noted = pos.noted.popleft()
            if len(pos.generated) > 1:  # a batch made ahead of this one: note states from now on
                pos.noting = True
            yield batch, pos.generated.popleft()

    def _dispatched(self, pos: _Positioned, batch: Any) -> Tuple[Any, int]:
        """A batch of a ``DataLoaderDispatcher``: on rank 0 it stands for the base batches read for it
        (one per rank, or one split between them); another rank reads none (its index sampler is
        positioned all the same: a resume on rank 0 is what every rank gets)."""
        assert self.dispatch is not None
        if self.dispatch.reads:
            for _ in range(min(self.dispatch.base_batches, len(pos.generated))):
                pos.last_noted = pos.noted.popleft()
                pos.generated.popleft()
            if pos.generated:  # read ahead of this one: note states from now on
                pos.noting = True
        return batch, samples_in(batch, self.loader.batch_size)

    def unpositioned(self, batch: Any) -> Tuple[Any, int]:
        """A batch that no batch of indices stands for: a subclass yields more batches than its batch
        sampler gives, so this loader cannot be positioned (from now on: epoch ends)."""
        self.mode, self.why_not = "epoch", (
            f"{type(self.loader).__name__} overrides DataLoader.__iter__ and yields other batches "
            "than its batch sampler's, which keepalive cannot position: checkpoints at epoch ends only")
        return batch, samples_in(batch, self.loader.batch_size)

    # ------------------------------------------------- the steps of an iteration (public for adapters)
    @property
    def positioner(self) -> Optional[Any]:
        """The stand-in for the loader's index sampler that positions an iteration (None: this loader
        is not replayed)."""
        return self._positioned

    def position_at(self, start: Dict[str, Any], on_positioned: Optional[Callable[[], None]] = None
                    ) -> Dict[int, Any]:
        """Make the next :meth:`open` continue from ``start`` (a saved :meth:`position`); returns the
        workers' saved random states by batch number, for :meth:`open`.

        The states the epoch's ``iter()`` drew from are put back now, so that the positioning draws
        (the workers' base seed, the sampler's seed) are the same; once the loader is positioned the
        random state of now is put back, then ``on_positioned`` runs (for the first pass of a resumed
        epoch: the saved step's state)."""
        pos = self._positioned
        assert pos is not None
        now = rng.capture()
        self._load_start(start)
        scale = self.dispatch.base_batches if self.dispatch is not None else 1
        samples_scale = self.dispatch.base_samples if self.dispatch is not None else 1
        pos.skip = int(start["samples"]) * samples_scale if pos.by_samples else int(start["batches"]) * scale
        pos.first = int(start["batches"]) * scale
        pos.on_positioned = lambda: _then(rng.restore, now, on_positioned)
        pos.ahead = list(start.get("ahead") or [])
        return {int(k): v for k, v in (start.get("workers") or {}).items()}

    def record_start(self) -> Dict[str, Any]:
        """Note the states the iteration about to be opened starts from (:attr:`start_state`, saved
        with a mid-epoch checkpoint)."""
        self.start_state = self._record()
        return self.start_state

    def open(self, resume: Optional[Dict[int, Any]] = None, index: Optional[Any] = None,
             first: bool = True) -> Tuple[Iterator[Any], List[Any]]:
        """``iter(loader)`` with keepalive's stand-ins in place, put back right after (the iterator
        keeps them): ``index`` (default :attr:`positioner`, or a wrapper around it) for the index
        sampler and, with workers, the dataset noting their random states (``resume``: those of a
        resumed iteration's first batches, from :meth:`position_at`). Returns the iterator and, with
        ``first``, its first batch (a subclass whose ``__iter__`` is a generator creates the real
        iterator at the first ``next()``)."""
        pos = self._positioned
        assert pos is not None
        loader = self.base  # iter(self.loader) below: a wrapper iterates this one
        attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        original = getattr(loader, attr)
        dataset = loader.dataset
        workers = loader.num_workers > 0
        if workers and self._states is None:
            self._states = WorkerStates.create("keepalive-workers-", sweep=True)
        kept, put_back = self.persistence, None
        if kept is not None and self._states is not None:
            resume, gen = kept.opening(self._states, pos, resume)
            put_back = kept.around_iter(loader, gen)
        if self._states is not None:
            self._states.forget_before(pos.serial + 1)  # the earlier iterations' states are not needed
        pos.used = False
        pos.serial += 1
        pos.tagging = workers
        object.__setattr__(loader, attr, pos if index is None else index)
        try:
            if workers and self._states is not None:
                object.__setattr__(loader, "dataset", _WorkerDraws(
                    dataset, self._states.resuming(resume, _set_plain_state), pos.serial))
            it = iter(self.loader)
            return it, list(itertools.islice(_ours(it), 1)) if first else []
        finally:
            object.__setattr__(loader, attr, original)
            if workers:
                object.__setattr__(loader, "dataset", dataset)
            if put_back is not None:
                put_back()

    def check_opened(self, when: str = "") -> bool:
        """Whether the iterator :meth:`open` made went through the positioning stand-in; if it did not
        (a subclass whose ``__iter__`` iterates after the stand-in left), this loader cannot be
        positioned: checkpoints at epoch ends only (``when``: said after "batch_sampler")."""
        if self._positioned is not None and self._positioned.used:
            return True
        self.why_not = (f"{type(self.loader).__name__} does not iterate through its batch_sampler{when}: "
                        "checkpoints at epoch ends only")
        self.mode = "epoch"
        return False

    def counted(self, batch: Any) -> Tuple[Any, int]:
        """``(batch, samples in it)`` for a batch the opened iterator yields, counted by the batch of
        indices made for it (none: see :meth:`unpositioned`)."""
        pos = self._positioned
        if pos is None or not pos.generated:  # a subclass yields more batches than its batch sampler gives
            return self.unpositioned(batch)
        return batch, pos.generated.popleft()

    # --------------------------------------------------------------------------------- states
    def _record(self) -> Dict[str, Any]:
        """The states this iteration starts from (saved with a mid-epoch checkpoint)."""
        state: Dict[str, Any] = {"rng": rng.capture(),
                                 "generators": {p: RandomState(g).state_dict()
                                                for p, g in self._generators().items()},
                                 "counters": self._counters()}
        samplers = {p: s.state_dict() for p, s in self._samplers() if callable(getattr(s, "state_dict", None))
                    and callable(getattr(s, "load_state_dict", None))}
        if samplers:
            state["samplers"] = samplers
        return state

    def _load_start(self, start: Dict[str, Any]) -> None:
        at = start.get("at_iter") or {}
        if at.get("rng") is not None:
            rng.restore(at["rng"])
        self._load_generators(at.get("generators") or {})
        self._load_counters(at.get("counters") or {})
        samplers = dict(self._samplers())
        for path, sd in (at.get("samplers") or {}).items():
            if path in samplers:
                samplers[path].load_state_dict(sd)

    def generators_now(self) -> Dict[str, Any]:
        """The private generators' states and the samplers' counters now (an epoch-end checkpoint:
        where the next epoch starts)."""
        return {"generators": {p: RandomState(g).state_dict() for p, g in self._generators().items()},
                "counters": self._counters()}

    def load_generators(self, states: Dict[str, Any]) -> None:
        """Put back :meth:`generators_now`."""
        self._load_generators(states.get("generators") or {})
        self._load_counters(states.get("counters") or {})

    def _load_generators(self, states: Dict[str, Any]) -> None:
        gens = self._generators()
        for path, sd in states.items():
            if path in gens:
                RandomState(gens[path]).load_state_dict(sd)

    def position(self, samples: int, batches: int) -> Dict[str, Any]:
        """What a mid-epoch checkpoint saves of this loader after ``batches`` batches (``samples``)."""
        if self.mode == "stateful":
            holder = self.stateful_source()
            return {"samples": samples, "batches": batches,
                    "state": holder.state_dict() if holder is not None else None}
        out: Dict[str, Any] = {"samples": samples, "batches": batches, "at_iter": self.start_state}
        read = batches * (self.dispatch.base_batches if self.dispatch is not None else 1)  # of the base loader
        if self.workers_draw():
            out["workers"] = self._worker_states(read)
        pos = self._positioned
        if pos is not None and not pos.tagging:  # batches made (no workers) that no step trained yet
            made = ([pos.last_noted] if pos.last_noted is not None else []) + list(pos.noted)
            ahead = [state for number, state in made if number >= read]
            if any(state is None for state in ahead):
                self.inexact = (f"{type(self.loader).__name__} made a batch ahead of the step being saved "
                                "before keepalive noted its random state: a resume from this checkpoint "
                                "makes that batch from another random state than the uninterrupted run")
            elif ahead:
                out["ahead"] = ahead
        return out

    def workers_draw(self) -> bool:
        """A worker of this loader drew random numbers while fetching (augmentation in workers)."""
        return self._states is not None and self._states.marked(_DRAWS)

    def _worker_states(self, batches: int) -> Optional[Dict[str, Any]]:
        """The random states the workers start the next ``num_workers`` batches from (None: one is
        missing, the resume will not replay the workers' draws)."""
        assert self._states is not None and self._positioned is not None
        try:
            total = len(self._positioned)
        except TypeError:
            total = batches + self.loader.num_workers
        return self._states.look_ahead(self._positioned.serial, batches, self.loader.num_workers, total,
                                       _plain_state)

    def close(self) -> None:
        if self._states is not None:
            self._states.remove()
            self._states = None


def _stateful_batches(loader: Any, holder: Optional[Any], start: Optional[Dict[str, Any]],
                      on_positioned: Optional[Callable[[], None]]) -> Iterator[Tuple[Any, int]]:
    """``(batch, samples in it)`` of a loader positioned through ``holder``'s ``load_state_dict()`` (the
    loader or its dataset: ``"stateful"`` mode), from ``start`` (a saved position) if given."""
    if start and start.get("state") is not None and holder is not None:
        holder.load_state_dict(start["state"])
    it = iter(loader)
    if on_positioned is not None and start:
        on_positioned()
    for batch in _ours(it):
        yield batch, samples_in(batch, loader.batch_size)


def _probe(loader: Any, index_sampler: Any, samplers: List[Tuple[str, Any]]) -> str:
    """'' when the order of ``loader`` (its ``samplers``, by path) replays from the recorded states,
    else why not. Known samplers pass; another one generates its first batches twice, on deep copies
    of ``index_sampler`` (the dataset shared, not copied), from the same states."""
    if all(_qualname(s) in _KNOWN_SAMPLERS for _, s in samplers):
        return ""
    name = type(next(s for _, s in samplers if _qualname(s) not in _KNOWN_SAMPLERS)).__name__
    saved = rng.capture()
    memo_base = {id(loader.dataset): loader.dataset}
    firsts, mutated = [], False
    try:
        for _ in range(2):
            rng.restore(saved)
            twin = copy.deepcopy(index_sampler, dict(memo_base))
            before = _chain_attrs(twin, ints=False)
            firsts.append([_as_list(b) for b in itertools.islice(iter(twin), _PROBE_BATCHES)])
            mutated = mutated or _chain_attrs(twin, ints=False) != before
    except Exception as e:  # a sampler that cannot be copied: cannot be checked either
        return (f"sampler {name} cannot be copied to check that its order replays ({type(e).__name__}: "
                f"{e}); checkpoints at epoch ends only")
    finally:
        rng.restore(saved)
    if firsts[0] != firsts[1]:
        return (f"sampler {name} gives another order from the same random state (it draws from a "
                "source keepalive cannot save: a time, os.urandom, an unregistered generator); a "
                "resumed epoch would see other batches: checkpoints at epoch ends only")
    if mutated and not callable(getattr(index_sampler, "state_dict", None)):
        return (f"sampler {name} changes its own attributes when iterated, which keepalive cannot "
                "restore: give it state_dict()/load_state_dict(); until then checkpoints at epoch "
                "ends only")
    return ""


class _Dispatch:
    """How Accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``) reads: rank 0 iterates
    the base loader, ``base_batches`` of its batches for each batch a rank gets (one per rank and
    concatenated, or one split between the ranks), and sends every rank its part; each rank's sample
    is ``base_samples`` samples of the base loader's order."""

    def __init__(self, reads: bool, base_batches: int, base_samples: int):
        self.reads, self.base_batches, self.base_samples = reads, base_batches, base_samples

    def completes_last_batch(self, loader: Any) -> bool:
        """Whether the epoch's last batch is uneven across the ranks, so that the dispatcher completes
        it with the first samples of the batch the iteration began with (``_drop_last`` False)."""
        if getattr(loader, "_drop_last", True):
            return False
        try:
            length, size = len(loader.dataset), int(loader.batch_size)
        except TypeError:
            return False
        base_drop = bool(getattr(loader.batch_sampler, "drop_last", False))
        sizes = [size] * (length // size) + ([length % size] if length % size and not base_drop else [])
        last = sizes[-(len(sizes) % self.base_batches or self.base_batches):]
        return sum(last) % self.base_samples != 0

    @staticmethod
    def of(loader: Any) -> Optional["_Dispatch"]:
        if f"{type(loader).__module__}.{type(loader).__qualname__}" != "accelerate.data_loader.DataLoaderDispatcher":
            return None
        state = loader.state  # accelerate's PartialState: this process and how many there are
        ranks = int(state.num_processes)
        return _Dispatch(int(state.process_index) == 0, 1 if loader.split_batches else ranks, ranks)


def _base_loader(loader: Any) -> Any:
    """The torch ``DataLoader`` an Accelerate ``DataLoaderShard`` / ``DataLoaderDispatcher`` iterates
    (``base_dataloader``) or a Lightning Fabric ``_FabricDataLoader`` wraps (``_dataloader``; no
    DataLoader itself: it copies the wrapped one's attributes, sets its sampler's epoch from its own
    count of ``iter()`` calls and moves batches to the device), or ``loader`` itself."""
    attrs = getattr(loader, "__dict__", {})
    base = attrs.get("base_dataloader")
    if base is None and fabric_loader(loader):
        base = attrs.get("_dataloader")
    return base if isinstance(base, DataLoader) else loader


def fabric_loader(loader: Any) -> bool:
    """A Lightning Fabric ``_FabricDataLoader`` (``fabric.setup_dataloaders``)."""
    return type(loader).__qualname__ == "_FabricDataLoader" and type(loader).__module__ in FABRIC_MODULES


def _index_sampler(loader: Any, base: Any) -> Any:
    """The index sampler the iteration draws from: the loader's own (a DataLoader or a subclass), or
    the wrapped DataLoader's for a wrapper that is none (Fabric's)."""
    return loader._index_sampler if isinstance(loader, DataLoader) else base._index_sampler


def _worker_state() -> Tuple[torch.Tensor, Any, bytes, int]:
    """The global random states of this process, cheaply comparable (numpy: position and first words)."""
    np_state: Any = np.random.get_state()
    return (torch.random.get_rng_state(), random.getstate(), bytes(np_state[1][:4].tobytes()), int(np_state[2]))


def _buffered_shuffle(obj: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` shuffled with ``.shuffle(buffer_size=...)``."""
    ex = getattr(obj, "_ex_iterable", None)
    for _ in range(16):
        if ex is None:
            return False
        if "BufferShuffled" in type(ex).__name__:
            return True
        ex = getattr(ex, "ex_iterable", None)
    return False


def _then(first: Callable[[Any], None], arg: Any, then: Optional[Callable[[], None]]) -> None:
    first(arg)
    if then is not None:
        then()


def _chain_attrs(sampler: Any, ints: bool = True) -> List[Dict[str, Any]]:
    """The plain attributes of a sampler and of the samplers inside it (``ints=False``: without its
    integers, which keepalive saves and restores when they change: an epoch counter)."""
    out = []
    for _ in range(4):
        if sampler is None:
            break
        out.append({k: v for k, v in _plain_attrs(sampler).items() if ints or type(v) is not int})
        sampler = getattr(sampler, "sampler", None) or getattr(sampler, "batch_sampler", None)
    return out


def _plain_attrs(obj: Any) -> Dict[str, Any]:
    if not hasattr(obj, "__dict__"):
        return {}
    return {k: v for k, v in vars(obj).items() if isinstance(v, (int, float, str, bool, tuple, type(None)))}


def _as_list(b: Any) -> Any:
    if isinstance(b, torch.Tensor):
        return b.tolist()
    if isinstance(b, (list, tuple)):
        return [_as_list(v) for v in b]
    return b


def samples_in(batch: Any, default: Optional[int]) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (``default`` if none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return samples_in(batch[0], default)
    if isinstance(batch, dict) and batch:
        return samples_in(next(iter(batch.values())), default)
    return int(default or 1)


# ------------------------------------------------------------------ loaders outside ckpt.batches()
_depth = 0  # > 0 while keepalive itself takes a batch from a loader


def _ours(it: Iterator[Any]) -> Iterator[Any]:
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

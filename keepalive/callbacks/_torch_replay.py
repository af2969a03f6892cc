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

Worker processes: the order and the workers' base seed replay exactly; the random state each worker
batch starts from is kept and handed back, for workers that live on across epochs
(``persistent_workers=True``) with their base seed's generator
(:mod:`keepalive.callbacks._torch_workers`).

The parts, one module each: the index sampler's stand-in (:mod:`~keepalive.callbacks._torch_positioned`),
what the order is drawn from (:mod:`~keepalive.callbacks._torch_order`), the workers' random states
(:mod:`~keepalive.callbacks._torch_workers`), and the loaders the loop handles itself
(:mod:`~keepalive.callbacks._torch_loaders`: iterators advanced outside ``ckpt.batches()``, loaders
built in an epoch, dataset names); their names the adapters use are importable from here too.

The steps of an iteration are public (:meth:`LoaderReplay.position_at`, :meth:`~LoaderReplay.open`,
:meth:`~LoaderReplay.counted`, ...) for an adapter that creates the iterator itself (Lightning's).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .. import rng
from ._torch_loaders import DatasetKeys, ForeignIterators, LoaderBirths, ours
from ._torch_order import OrderSources, probe
from ._torch_positioned import Positioned, batch_len
from ._torch_workers import DRAWS, PersistentWorkers, WorkerDraws, plain_state, set_plain_state
from .replay import WorkerStates
from .torchstate import FABRIC_MODULES

__all__ = ["LoaderReplay", "ForeignIterators", "LoaderBirths", "DatasetKeys", "PersistentWorkers", "batch_len",
           "samples_in", "fabric_loader"]

#: persistent workers' states and base seed carried across a resume (False: not, as keepalive did
#: before; the tests' control)
CARRY_PERSISTENT = True


class LoaderReplay:
    """How keepalive positions one user ``DataLoader`` (see the module docstring)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        #: the torch DataLoader whose sampler and dataset are stood in for: Accelerate's DataLoaderShard
        #: is no DataLoader (it poses as one through __class__) and iterates the one it wraps
        self.base: DataLoader = _base_loader(loader)
        #: Accelerate's DataLoaderDispatcher: rank 0 reads the batches of every rank from ``base``
        self.dispatch = _Dispatch.of(loader)
        #: what its order is drawn from: samplers, private generators, counters
        self.order = OrderSources(loader)
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
        self._positioned: Optional[Positioned] = None
        self._states: Optional[WorkerStates] = None  # the workers' random states (workers > 0)
        if self.mode == "replay":
            index_sampler = _index_sampler(loader, self.base)
            self._positioned = Positioned(index_sampler)
            self._positioned.by_samples = type(index_sampler) is BatchSampler
            # a wrapper around the DataLoader (Accelerate's) fetches ahead: note from the first batch
            self._positioned.noting = self.base is not loader
            self.why_not = probe(self.loader, index_sampler, self.order.samplers())
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
            for batch in ours(iter(self.loader)):
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
        for batch in itertools.chain(first, ours(it)):
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

    def _dispatched(self, pos: Positioned, batch: Any) -> Tuple[Any, int]:
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
        self.order.load(start.get("at_iter") or {})
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
        self.start_state = self.order.record()
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
                object.__setattr__(loader, "dataset", WorkerDraws(
                    dataset, self._states.resuming(resume, set_plain_state), pos.serial))
            it = iter(self.loader)
            return it, list(itertools.islice(ours(it), 1)) if first else []
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
    def generators_now(self) -> Dict[str, Any]:
        """The private generators' states and the samplers' counters now (an epoch-end checkpoint:
        where the next epoch starts)."""
        return self.order.generators_now()

    def load_generators(self, states: Dict[str, Any]) -> None:
        """Put back :meth:`generators_now`."""
        self.order.load_generators(states)

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
        return self._states is not None and self._states.marked(DRAWS)

    def _worker_states(self, batches: int) -> Optional[Dict[str, Any]]:
        """The random states the workers start the next ``num_workers`` batches from (None: one is
        missing, the resume will not replay the workers' draws)."""
        assert self._states is not None and self._positioned is not None
        try:
            total = len(self._positioned)
        except TypeError:
            total = batches + self.loader.num_workers
        return self._states.look_ahead(self._positioned.serial, batches, self.loader.num_workers, total,
                                       plain_state)

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
    for batch in ours(it):
        yield batch, samples_in(batch, loader.batch_size)


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


def samples_in(batch: Any, default: Optional[int]) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (``default`` if none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return samples_in(batch[0], default)
    if isinstance(batch, dict) and batch:
        return samples_in(next(iter(batch.values())), default)
    return int(default or 1)

"""Data positioning and random-state replay for the Hugging Face ``Trainer``'s training ``DataLoader``.

Map-style datasets. The Trainer builds its training loader in ``train()`` (``get_train_dataloader``: a
``DataLoader`` with a ``BatchSampler`` over a ``RandomSampler`` / ``SequentialSampler``, wrapped by
accelerate, which swaps the ``RandomSampler`` for a ``SeedableRandomSampler`` whose order is a function
of ``(seed, epoch)``). :func:`install` puts a :class:`PositionedBatchSampler` in the place of that
``BatchSampler``: the same batches in the same order (a run with the callback sees the data a run
without it sees), and an epoch can start at any batch without computing, fetching or collating the
batches before it. The Trainer's own loop still decides the step counter of a resumed epoch: it is
handed ``steps_trained_in_current_epoch`` and wraps the loader in accelerate's ``SkipBatchSampler``,
which drops that many batches from the front; for that one iteration the positioned sampler yields as
many empty placeholders first (nothing is loaded for them) and then the epoch's batches.

Several processes: accelerate wraps that ``BatchSampler`` in a ``BatchSamplerShard`` that gives each rank every
``num_processes``-th batch (and repeats the first ones at the end so that every rank trains as many). The
positioned sampler then stands in for the shard: it keeps the shard's settings and runs accelerate's own class
over the epoch's batches, so each rank yields exactly its shard, and a resumed epoch starts at the rank's batch
``start`` (indices only before it). Every rank runs the same number of steps, so all reach the same boundaries.

Random draws while batches are made (a random collator such as ``DataCollatorForLanguageModeling``'s
masking, augmentation in ``__getitem__``) replay exactly after a mid-epoch resume. The Trainer fetches
an optimizer step's micro-batches before the step begins, and accelerate's loader fetches one batch
ahead, so a batch is made while earlier steps still train. :class:`Replay` keeps what is needed:

* no workers: the sampler notes the main process's CPU generators (python, numpy, torch) just before a
  step's first batch is fetched (once per optimizer step, tens of microseconds); a checkpoint keeps that
  of the batch fetched ahead of the trained ones (accelerate's one; more is told), and the resumed pass
  puts it back just before the same batch is fetched again, then the saved step's own state before the
  first batch that was not fetched yet;
* worker processes: each worker's generators continue from one batch to the next. Every batch the
  positioned sampler yields is tagged with its number, and the dataset the workers see
  (:class:`WorkerData`) starts each tagged batch through :class:`keepalive.callbacks.replay.WorkerStates`
  (shared with the torch, fastai and Lightning adapters): the worker notes the state the batch starts
  from. A checkpoint keeps those of the next ``num_workers`` batches, and the torch generator's state
  before the epoch's iterator was created (it draws the workers' base seed). The resumed epoch
  recreates the iterator from that state, and the worker that makes batch ``k + w`` first starts it
  from the state the uninterrupted run had; batches go to the workers round-robin, so each worker's
  generators then go on as the uninterrupted run's did. (A checkpoint of keepalive before this
  kept one state per worker, the state after its last trained batch: :func:`per_batch` reads it.)

The states, how they leave the workers, and the notes and plan of the batches made in the main process
are those of :mod:`keepalive.callbacks.replay` (:func:`~keepalive.callbacks.replay.cpu_rng`,
:class:`~keepalive.callbacks.replay.WorkerStates`, :class:`~keepalive.callbacks.replay.MadeStates`).

With ``persistent_workers=True`` the workers of a resumed pass end with it (accelerate rebuilt its loader
to skip batches), so the next pass's new workers take over their states (each worker also notes the
state after each batch it makes: the state its next batch, in the next pass, starts from), and the main
generator's state is put back after their creation, which the uninterrupted run does not have. A
checkpoint at an epoch's end keeps those states too (:meth:`Replay.capture_carry`): a resume there starts
new workers where the uninterrupted run's go on.

The wrappers draw nothing, so a run with the callback is bit-identical to one without it.

Iterable datasets (a stream with no length, typically with ``max_steps``): :func:`stream_kind` says how a
resumed pass is positioned. One with ``state_dict()`` / ``load_state_dict()`` (a Hugging Face
``datasets.IterableDataset``; no workers) is saved through that protocol: its state is noted after each
batch is made (:class:`Replay`), the one before the first untrained batch goes into the checkpoint, and a
resume loads it and reads on from there. Any other stream is positioned by the Trainer's own skip: it reads
the pass again from its start and drops the batches already trained (exact when the stream yields the
same items in the same order on every pass; the adapter says so at the first save).
"""
from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from ..dataorder import mix
from .replay import MadeStates, WorkerStates, cpu_rng

__all__ = ["PositionedBatchSampler", "Replay", "WorkerData", "install", "base_loader", "stream_kind", "per_batch"]

#: accelerate's ``BatchSamplerShard`` settings a positioned sampler takes over on several processes
SHARD_SETTINGS = ("num_processes", "process_index", "split_batches", "even_batches")
#: the worker-state folders' names: keepalive-hf-workers-{pid}-... (those of dead processes are swept)
_FOLDER = "keepalive-hf-workers-"


class _Placeholder(list):
    """A batch the Trainer's ``SkipBatchSampler`` drops unseen (never fetched)."""


class _Tagged(list):
    """A batch's indices with the batch's place, ``tag = (pass, batch number)``: a worker reads it to
    start the batch from its noted or saved random state (:class:`WorkerData`)."""

    tag: Tuple[int, int]


#: in a worker process: the batch being made, between the dataset's fetch and the collator (one at a time)
_making: Optional[Tuple[int, int]] = None


class PositionedBatchSampler(BatchSampler):
    """The batches of an epoch's order, from batch ``start`` on (after ``placeholders`` empty ones)."""

    def __init__(self, n: int, batch_size: int, drop_last: bool, kind: str, seed: int,
                 shard: Optional[Dict[str, Any]] = None):
        # no super().__init__: the index sampler is ours (self.sampler stays for accelerate's set_epoch)
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last
        self.kind, self.seed = kind, seed
        #: several processes: the settings of accelerate's BatchSamplerShard this sampler stands in for (its
        #: num_processes, process_index, split_batches, even_batches); each rank yields its own shard
        self.shard = dict(shard) if shard else None
        for name, value in (self.shard or {}).items():
            setattr(self, name, value)  # read by accelerate (DataLoaderShard.total_batch_size)
        self.epoch = 0
        self.start = 0          # batches of the running epoch already trained (resume)
        self.placeholders = 0   # empty batches first: what the Trainer's SkipBatchSampler drops
        self.tagging = False    # batches carry their place (worker processes make them: see WorkerData)
        self.serial = 0         # passes begun (with tagging: the first part of each batch's tag)
        #: the random states of a step's first batches (no workers: made here; every: gradient accumulation),
        #: and a resumed pass's plan (batch -> random state to put back before its fetch)
        self.states = MadeStates()
        self.last = -1          # the last batch yielded in this pass
        self.sampler = self  # type: ignore[assignment]  # accelerate: batch_sampler.sampler.set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def unposition(self) -> None:
        """Forget a resume position no pass consumed (a resume after an epoch's last step fetches no
        batch of that epoch: the next epoch starts at its beginning)."""
        self.start = self.placeholders = 0
        self.states.plan = {}

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order, as the replaced sampler would have drawn it."""
        if self.kind == "sequential":
            return torch.arange(self.n)
        g = torch.Generator()
        # accelerate's SeedableRandomSampler: a generator seeded with seed + epoch, one randperm
        g.manual_seed(self.seed + epoch if self.kind == "seedable" else mix(self.seed, epoch))
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[List[int]]:
        start, placeholders, plan = self.start, self.placeholders, self.states.plan
        self.start = self.placeholders = 0  # once: the next epoch starts at its beginning
        self.states.noted.clear()
        self.last = -1
        self.serial += 1
        serial, tagging = self.serial, self.tagging
        for _ in range(placeholders):
            yield _Placeholder()
        for b, batch in self._batches(self.order(self.epoch), start):
            self.states.making(b, plan)
            self.last = b
            if tagging:
                batch = _Tagged(batch)
                batch.tag = (serial, b)
            yield batch

    def _batches(self, idx: torch.Tensor, start: int) -> Iterator[Tuple[int, List[int]]]:
        """The epoch's batches of this process from batch ``start`` on, numbered: on one process the order's
        slices (those before ``start`` not made), on several the shard accelerate's ``BatchSamplerShard``
        gives this rank (its own code, run on the epoch's batches: the same split, the same batches repeated
        at the end; those before ``start`` only as indices, nothing is loaded for them)."""
        size = self.batch_size
        if self.shard is None:
            return ((b, idx[b * size:(b + 1) * size].tolist()) for b in range(start, self._global_len()))
        from accelerate.data_loader import BatchSamplerShard

        every = (idx[b * size:(b + 1) * size].tolist() for b in range(self._global_len()))
        mine = BatchSamplerShard(_EpochBatches(every, size, self.drop_last, self._global_len()),  # type: ignore[arg-type]
                                 **self.shard)
        return itertools.islice(enumerate(mine), start, None)

    def _global_len(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def __len__(self) -> int:
        if self.shard is None:
            return self._global_len()
        from accelerate.data_loader import BatchSamplerShard

        return len(BatchSamplerShard(_EpochBatches(iter(()), self.batch_size, self.drop_last,  # type: ignore[arg-type]
                                                   self._global_len()), **self.shard))


class _EpochBatches:
    """One epoch's batches over all processes, as the ``BatchSampler`` inside accelerate's
    ``BatchSamplerShard`` yields them (what the shard reads of it: its batches, their size, drop_last, length)."""

    def __init__(self, batches: Iterator[List[int]], batch_size: int, drop_last: bool, length: int):
        self.batches, self.batch_size, self.drop_last, self.length = batches, batch_size, drop_last, length

    def __iter__(self) -> Iterator[List[int]]:
        return self.batches

    def __len__(self) -> int:
        return self.length


class _Collate:
    """Stands in for the loader's ``collate_fn`` (the wrapped one does the work). In a worker with
    persistent workers it notes the state after each batch (see :class:`WorkerData`); in the main process
    it counts batches, puts planned random states back and notes a stream's state (see :class:`Replay`)."""

    def __init__(self, inner: Callable[[Any], Any]):
        self.inner = inner
        self.made = 0                               # batches made in this pass (main process)
        self.states = MadeStates()                  # made in the main process (see PositionedBatchSampler)
        self.stream: Any = None                     # a stream with state_dict(): noted after each batch
        self.stream_noted: Deque[Tuple[int, Any]] = collections.deque(maxlen=4)
        self.workers: Optional[WorkerStates] = None  # persistent workers: the states after their batches

    def __call__(self, items: Any) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            batch = self.inner(items)
            if self.workers is not None and _making is not None:
                # the state the worker's next batch starts from, in this pass or (persistent) the next
                self.workers.note(_making[0], _making[1] + info.num_workers, info.num_workers, cpu_rng())
            return batch
        b = self.made
        self.made += 1
        self.states.making(b)
        batch = self.inner(items)
        if self.stream is not None and not (b + 1) % self.states.every:
            self.stream_noted.append((b + 1, self.stream.state_dict()))  # the stream before batch b + 1
        return batch

    def new_pass(self) -> None:
        self.made = 0
        self.states.noted.clear()
        self.stream_noted.clear()


class WorkerData:
    """The map-style dataset as the loader's workers see it: it fetches what the dataset fetches, and
    starts each tagged batch (:class:`PositionedBatchSampler`) through ``states``
    (:meth:`keepalive.callbacks.replay.WorkerStates.start`: a resumed batch's saved state is put back, the
    state the batch starts from is noted). Reads and writes of other attributes go to the dataset."""

    def __init__(self, dataset: Any, states: WorkerStates):
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "states", states)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "states"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "states":
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: List[Any]) -> Any:
        global _making
        tag = getattr(indices, "tag", None)
        info = torch.utils.data.get_worker_info()
        _making = tag if info is not None else None
        if tag is not None and info is not None:
            self.states.start(tag[0], tag[1], info.num_workers)
        plain = list(indices)
        inner = getattr(self.dataset, "__getitems__", None)
        return inner(plain) if inner is not None else [self.dataset[i] for i in plain]


def per_batch(saved: Mapping[str, Any], trained: int, workers: int) -> Dict[int, Any]:
    """The worker states of a checkpoint (``replay`` part), by the batch each starts: ``worker_starts``
    (batch number -> state), or those of keepalive's earlier format, ``workers`` (worker -> the state
    after its last trained batch, with batch ``b`` made by worker ``b % workers``: that state is what its
    next batch, the first at or after ``trained`` with its number, starts from)."""
    if saved.get("worker_starts") is not None:
        return {int(b): dict(s) for b, s in saved["worker_starts"].items()}
    old = saved.get("workers") or {}
    return {trained + (int(w) - trained) % workers: dict(s) for w, s in old.items()} if workers else {}


class Replay:
    """The random states (and a stream's position) one training loader needs to resume mid-epoch."""

    def __init__(self, base: Any, sampler: Optional[PositionedBatchSampler], stateful_stream: bool,
                 accumulation: int = 1):
        self.base, self.sampler = base, sampler
        self.workers = int(getattr(base, "num_workers", 0) or 0)
        self.persistent = bool(getattr(base, "persistent_workers", False))
        self.collate = _Collate(base.collate_fn)
        # a save lands between steps, when the next step's first batch may be fetched already: only a
        # step's first batch needs its random state noted (once per optimizer step, tens of microseconds)
        self.collate.states.every = max(1, int(accumulation))
        if sampler is not None:
            sampler.states.every = self.collate.states.every
        base.collate_fn = self.collate
        self.data: Optional[WorkerData] = None  # the dataset the workers see (workers, positioned sampler)
        if self.workers and sampler is not None:
            self.data = WorkerData(base.dataset, WorkerStates.create(_FOLDER, sweep=True))
            object.__setattr__(base, "dataset", self.data)  # the DataLoader refuses a new one once built
            sampler.tagging = True
            if self.persistent:
                self.collate.workers = self.data.states
        elif sampler is not None:
            sampler.states.watch = True
        elif not self.workers:
            self.collate.states.watch = True
            self.collate.stream = base.dataset if stateful_stream else None
        self.iter_rng: Optional[torch.Tensor] = None  # torch's state before the epoch's iterator
        self.feed: Optional[Iterator[Any]] = None
        self.source: Any = None
        self.workers_lost = False  # a worker's state did not come in time for a save (not replayed)
        self.deep_ahead = False  # more than one batch was fetched ahead of a save (only one is replayed)
        # persistent workers: a resumed pass runs on the loader accelerate rebuilt to skip batches, and its
        # workers end with it; the next pass starts new ones, which take over the workers' states
        self.carry = False
        self.keep_rng: Optional[torch.Tensor] = None  # ... and the main state their creation must not draw from
        self.carried: Dict[int, Any] = {}  # saved states past the resumed pass's end (made before the resume)
        self.carry_from = 0  # the first noted state past the pass's end its own workers leave
        self.next_states: Optional[Dict[int, Any]] = None  # saved at an epoch's end: the next pass's

    # ----------------------------------------------------------------------- while training
    def epoch_iterator(self, it: Any) -> Iterator[Any]:
        """The Trainer's epoch iterator, seen through a filter that drops the placeholders of a resumed
        pass (one filter per iterator; a new iterator is a new pass)."""
        if it is not self.source:
            self.source = it
            if self.workers and not (self.persistent and self.iter_rng is not None):
                self.iter_rng = torch.get_rng_state()  # the next fetch creates the iterator from it
            if self.carry and self.data is not None and self.sampler is not None:
                self.carry = False
                taken = self.next_states if self.next_states is not None else self.after_pass(self.sampler)
                self.data.states = self.data.states.resuming(taken)
                self.keep_rng = torch.get_rng_state()  # the uninterrupted run creates no iterator here
            self.next_states = None
            self.carried, self.carry_from = {}, 0  # this pass's own workers note all their states
            self.collate.new_pass()
            self.feed = it
        assert self.feed is not None
        return self.feed

    def after_pass(self, sampler: PositionedBatchSampler) -> Dict[int, Any]:
        """Persistent workers: the states the next pass's batches ``0 .. workers - 1`` start from, where
        the last pass left each worker's generators. Batch ``j`` of a pass is made by worker
        ``j % workers``, which made the last batch of the pass before with that remainder; the state
        after it was noted under the number ``workers`` further on (or was saved, for a batch made
        before a resume)."""
        assert self.data is not None
        end, first = len(sampler) + self.workers, max(len(sampler), self.carry_from)
        noted = self.data.states.look_ahead(sampler.serial, first, end - first, end) if first < end else {}
        self.workers_lost = self.workers_lost or noted is None
        after = {**self.carried, **{int(k): s for k, s in (noted or {}).items()}}
        return {k % self.workers: s for k, s in after.items()}

    def capture_carry(self) -> Optional[Dict[str, Any]]:
        """At an epoch's end, persistent workers: what the next epoch's workers start from (a resume
        there starts new workers, where the uninterrupted run's go on); None when there is nothing."""
        if not self.persistent or self.data is None or self.sampler is None:
            return None
        if self.carry and self.next_states is not None:  # restored here, no pass since
            return {str(j): s for j, s in self.next_states.items()}
        if not self.sampler.serial:
            return None
        return {str(j): s for j, s in self.after_pass(self.sampler).items()} or None

    def resume_carry(self, saved: Mapping[str, Any]) -> None:
        """A resume at an epoch's start: its new persistent workers take over the saved states."""
        if self.persistent and self.data is not None:
            self.next_states = {int(j): dict(s) for j, s in saved.items()}
            self.carry = True

    def capture(self, trained: int) -> Dict[str, Any]:
        """What a resume at batch ``trained`` of this pass needs, beyond the step's own random state."""
        out: Dict[str, Any] = {}
        if self.sampler is not None and self.sampler.states.watch:
            out["ahead"] = self.sampler.states.ahead_of(trained)
            self.deep_ahead = self.deep_ahead or self.sampler.last > trained
        elif self.collate.states.watch:
            out["ahead"] = self.collate.states.ahead_of(trained)
            self.deep_ahead = self.deep_ahead or self.collate.made - 1 > trained
        if self.workers:
            out["iter_rng"] = self.iter_rng
        if self.data is not None and self.sampler is not None:
            # persistent workers: the states of the pass's last batches' successors, up to `workers` past its end
            total = len(self.sampler) + (self.workers if self.persistent else 0)
            starts = self.data.states.look_ahead(self.sampler.serial, trained, self.workers, total)
            self.workers_lost = self.workers_lost or starts is None
            out["worker_starts"] = starts or {}
        if self.collate.stream is not None:
            before = [s for b, s in self.collate.stream_noted if b == trained]
            out["stream"] = before[-1] if before else None
        return out

    # ----------------------------------------------------------------------- resuming
    def prepare(self, saved: Mapping[str, Any], trained: int, step_rng: Optional[Mapping[str, Any]]) -> bool:
        """Before the resumed pass's iterator is created (batch ``trained``): plan the random states and
        position the stream. True when the step's own state ``step_rng`` is put back by the plan."""
        plan: Dict[int, Dict[str, Any]] = {int(b): dict(s) for b, s in saved.get("ahead") or []}
        in_plan = False
        if step_rng is not None and not self.workers:
            plan[trained + len(plan)] = dict(step_rng)  # the first batch not fetched before the save
            in_plan = True
        if self.sampler is not None and self.sampler.states.watch:
            self.sampler.states.plan = plan
        elif self.collate.states.watch:
            self.collate.states.plan = plan
        else:
            in_plan = False
        if self.workers and saved.get("iter_rng") is not None:
            self.iter_rng = saved["iter_rng"]
            torch.set_rng_state(saved["iter_rng"].clone())  # the workers' base seed is drawn again from it
        if self.data is not None and self.sampler is not None:
            starts = per_batch(saved, trained, self.workers)
            self.data.states = self.data.states.resuming(starts)
            end = len(self.sampler)  # persistent workers: what the next pass's take over (see _take_over)
            self.carried = {b: s for b, s in starts.items() if b >= end}
            self.carry_from = max(end, trained + self.workers)
        if self.workers and self.persistent:
            self.carry = True
        if self.collate.stream is not None and saved.get("stream") is not None:
            self.collate.stream.load_state_dict(saved["stream"])
            self.collate.made = trained  # the pass continues at that batch (no batch is read again)
        return in_plan

    def end_pass(self) -> None:
        """The pass is over: let go of its iterator (its worker processes end with it, as without keepalive)."""
        self.source = self.feed = None

    def fetched(self) -> None:
        """A pass's first fetch is done: new workers that took over states start as seeded from now on."""
        if self.keep_rng is not None:
            torch.set_rng_state(self.keep_rng)
            self.keep_rng = None
            self._forget_resume()

    def plan_pending(self) -> bool:
        """Part of a resume plan has not run (the pass ended before that batch)."""
        holder = self.sampler if self.sampler is not None and self.sampler.states.watch else self.collate
        return bool(holder.states.plan)

    def settled(self) -> None:
        """The resumed pass's first fetch is done: forget what is left of its plan; new workers start as
        seeded."""
        if self.sampler is not None:
            self.sampler.states.plan = {}
        self.collate.states.plan = {}
        self._forget_resume()

    def _forget_resume(self) -> None:
        if self.data is not None:
            self.data.states = self.data.states.resuming(None)

    def close(self) -> None:
        """``train()`` ended: the dataset goes back into the loader, the workers' folder goes."""
        if self.data is not None:
            object.__setattr__(self.base, "dataset", self.data.dataset)
            self.data.states.remove()
            self.data = None


def base_loader(loader: Any) -> Any:
    """The ``torch.utils.data.DataLoader`` inside accelerate's wrapper (or the loader itself)."""
    return getattr(loader, "base_dataloader", loader)


def stream_kind(loader: Any) -> str:
    """For a loader over an ``IterableDataset``: ``"stateful"`` (positioned through the dataset's
    ``state_dict()``), ``"reread"`` (the Trainer's skip reads the pass again); ``""`` for map-style data."""
    ds = base_loader(loader).dataset
    if not isinstance(ds, IterableDataset):
        return ""
    if callable(getattr(ds, "state_dict", None)) and callable(getattr(ds, "load_state_dict", None)) and \
            not int(getattr(base_loader(loader), "num_workers", 0) or 0):
        return "stateful"
    return "reread"


def install(loader: Any, fallback_seed: int) -> Tuple[Optional[PositionedBatchSampler], str]:
    """Replace the Trainer's training batch sampler by a positioned one; (sampler, "") or (None, why not)."""
    base = base_loader(loader)
    if isinstance(base.dataset, IterableDataset):
        return None, "iterable"
    bs = base.batch_sampler
    if isinstance(bs, PositionedBatchSampler):
        return bs, ""
    dispatcher = type(loader).__name__ == "DataLoaderDispatcher"
    if dispatcher and int(getattr(getattr(loader, "state", None), "num_processes", 1)) > 1:
        # rank 0 reads every rank's batches and sends each its slice: the ranks hold no position of their own
        return None, "several processes with dispatch_batches=True: checkpoints at epoch ends only"
    shard: Optional[Dict[str, Any]] = None
    if type(bs).__name__ == "BatchSamplerShard":  # several processes: accelerate's split of the batches
        if not bs.even_batches and not bs.drop_last:
            # the ranks may train different numbers of steps: they could not meet at the same boundaries
            return None, "several processes with even_batches=False: checkpoints at epoch ends only"
        shard = {name: getattr(bs, name) for name in SHARD_SETTINGS}
        bs = bs.batch_sampler
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
    sampler = PositionedBatchSampler(n, int(bs.batch_size), bool(bs.drop_last), kind, seed, shard)
    # The DataLoader refuses a new batch_sampler once built; no iterator exists yet (train() has not
    # begun its first epoch), so replacing it here is what building it with ours would have been.
    object.__setattr__(base, "batch_sampler", sampler)
    return sampler, ""

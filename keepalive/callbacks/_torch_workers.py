"""The random states of a ``DataLoader``'s worker processes, as a replayed loader keeps them.

Random draws *inside* workers (augmentation in ``__getitem__``, a random collator) depend on where each
worker's generators stand when it starts a batch. PyTorch seeds each worker once per epoch (once for
all epochs with ``persistent_workers=True``), and which worker fetched how many batches before the saved
one is not replayed by positioning the order alone. So:

* :class:`WorkerDraws` stands in for the dataset the workers see: it fetches exactly what the user's
  dataset fetches, notices once a fetch draws random numbers (the :data:`DRAWS` flag, so that the
  adapter can say so at the first mid-epoch save), and from then on notes the random state each batch
  starts from (:class:`keepalive.callbacks.replay.WorkerStates`, shared with the fastai adapter); a
  mid-epoch checkpoint keeps those of the next ``num_workers`` batches, and a resumed iteration's
  workers start these batches from them;
* :class:`PersistentWorkers`: workers that live on across epochs draw their base seed once and carry
  their random states from one epoch to the next; it saves those states and the seed's generator, so
  that the new workers of a resumed process go on as the uninterrupted run's did.

States travel as plain values (:func:`plain_state` / :func:`set_plain_state`): a checkpoint is never
unpickled.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from ._torch_positioned import Positioned
from .replay import WorkerStates

__all__ = ["PersistentWorkers", "WorkerDraws", "plain_state", "set_plain_state", "DRAWS"]


#: the flag a loader's workers leave once a fetch drew random numbers (augmentation in workers)
DRAWS = "draws"


def _full_state() -> Tuple[bytes, Any, Any]:
    """This process's global random states (torch CPU, python, numpy), picklable."""
    return (bytes(torch.random.get_rng_state().numpy().tobytes()), random.getstate(), np.random.get_state())


def plain_state(state: Tuple[bytes, Any, Any]) -> Dict[str, Any]:
    """:func:`_full_state` as plain values a checkpoint stores (a checkpoint is never unpickled)."""
    version, internal, gauss = state[1]
    name, keys, pos, has_gauss, cached = state[2]
    return {"torch": torch.frombuffer(bytearray(state[0]), dtype=torch.uint8).clone(),
            "python": [int(version), np.asarray(internal, dtype=np.uint64), gauss],
            "numpy": [str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)]}


def set_plain_state(state: Dict[str, Any]) -> None:
    """Put back a :func:`plain_state` as this process's global random states."""
    torch.random.set_rng_state(state["torch"].clone())
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))


class WorkerDraws:
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
                set_plain_state(handed)
        drawing = states.marked(DRAWS)
        before = states.start(serial, number, info.num_workers, _full_state, note=drawing)
        out = fetch()
        if not drawing and not _same_state(before, _full_state()):
            states.note(serial, number, info.num_workers, before)
            states.mark(DRAWS)
        return out


def _same_state(a: Tuple[bytes, Any, Any], b: Tuple[bytes, Any, Any]) -> bool:
    return a[0] == b[0] and a[1] == b[1] and int(a[2][2]) == int(b[2][2]) and bool((a[2][1] == b[2][1]).all())


#: in a worker: the batch it is making, ``(iteration, number)`` (read by :class:`_NoteAfter`)
_making: Optional[Tuple[int, int]] = None


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

    def opening(self, states: WorkerStates, pos: "Positioned", resume: Optional[Dict[int, Any]]
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

    def state(self, pos: "Positioned", consumed: Optional[int] = None, running_pass: bool = False
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
        return bool(self.carry) or (self.states is not None and self.states.marked(DRAWS))

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
                got = self.states.look_ahead(serial, last + w, 1, last + w + 1, plain_state)
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

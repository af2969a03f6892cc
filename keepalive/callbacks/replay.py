"""The random state each batch of a torch ``DataLoader`` is made from, kept so that a resume replays it.

Random draws while batches are made (augmentation in ``__getitem__``, a random collator) depend on
where the generators stand when each batch begins. An uninterrupted run makes batch ``k`` from one
state; a run resumed at batch ``k`` makes it from the same one only if that state was kept and is
put back just before the batch is made again. The adapters whose data goes through a torch
``DataLoader`` (torch, fastai, Hugging Face, Lightning) share this module for it:

* :func:`cpu_rng`: the generators a batch is made with (python, numpy's legacy one, torch's CPU one),
  in the format :func:`keepalive.rng.restore` takes (:func:`sendable` / :func:`received`: as a worker
  sends one along with a batch, which the Hugging Face adapter does instead of leaving files);
* :class:`WorkerStates`: worker processes. Each worker leaves the state each of its batches starts
  from in a private folder (``/dev/shm`` where it can: about 0.15 ms a batch), one small file per
  batch named ``{iteration}-{batch}``, the last :data:`KEPT_PER_WORKER` per worker kept. At a
  mid-epoch save the main process reads those of the next ``num_workers`` batches
  (:meth:`WorkerStates.look_ahead`: a worker writes one as it starts the batch, which it has
  queued already); the resumed iteration starts at batch ``k`` and hands the workers these states
  (:meth:`WorkerStates.resuming`): the worker that makes batch ``k + w`` first starts it from the
  state the uninterrupted run's worker had, and its generators go on from there as they did
  (workers that live on across iterations, ``persistent_workers=True``, are handed theirs with
  :meth:`WorkerStates.hand`);
* :class:`MadeStates`: the main process. A loader that makes batches ahead of the step that trains
  them (a prefetching wrapper, an optimizer step's micro-batches fetched together) makes one before
  the steps before it have trained: the state it was made from is noted as it is made, a checkpoint
  keeps those of the batches made but not trained, and a resumed pass puts each back just before
  the same batch is made again (the plan).

Nothing here draws random numbers: a run that keeps these states is bit-identical to one that does
not. Which batch an adapter's loader makes when, and how it hands batches to workers, is the
adapter's (its ``_*_data`` module); the states and how they travel are here.
"""
from __future__ import annotations

import collections
import os
import pickle
import random
import shutil
import tempfile
import time
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from .. import rng

__all__ = ["cpu_rng", "sendable", "received", "WorkerStates", "MadeStates", "KEPT_PER_WORKER", "STATE_WAIT_S"]

#: worker random states kept per worker (the main process reads those of the next batches to fetch,
#: which a worker with prefetched batches may have passed by ``prefetch_factor`` batches)
KEPT_PER_WORKER = 6
#: how long a mid-epoch save waits for a worker to start a batch whose random state it needs
STATE_WAIT_S = 5.0


def cpu_rng() -> Dict[str, Any]:
    """The generators a batch is made with, on the CPU: python's, numpy's legacy one, torch's (plain
    values :func:`keepalive.rng.restore` takes, stored in a checkpoint without pickle)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}


def sendable(state: Dict[str, Any]) -> Dict[str, Any]:
    """A :func:`cpu_rng` state a worker sends along with a batch: torch's as bytes (a tensor would go
    through shared memory)."""
    out = dict(state)
    out["torch_cpu"] = out["torch_cpu"].numpy().tobytes()
    return out


def received(state: Dict[str, Any]) -> Dict[str, Any]:
    """A :func:`sendable` state as :func:`keepalive.rng.restore` takes it."""
    out = dict(state)
    if isinstance(out.get("torch_cpu"), bytes):
        out["torch_cpu"] = torch.frombuffer(bytearray(out["torch_cpu"]), dtype=torch.uint8)
    return out


def _shared_memory() -> Optional[str]:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class WorkerStates:
    """The random state each batch of one loader's workers starts from, in a private folder (see the
    module docstring). Picklable: the same object goes to the workers (with the loader's dataset or
    iterable), where :meth:`start` runs; the main process reads with :meth:`look_ahead`.

    The files pass between this process and its own workers only: a checkpoint gets the values."""

    def __init__(self, folder: str, resume: Optional[Mapping[int, Any]] = None,
                 restore: Callable[[Any], None] = rng.restore):
        self.folder = folder
        #: a resumed iteration: batch number -> the state its worker starts it from (popped when used)
        self.resume: Dict[int, Any] = dict(resume or {})
        self.restore = restore

    @classmethod
    def create(cls, prefix: str, sweep: bool = False) -> "WorkerStates":
        """A new folder (in ``/dev/shm`` where it can). ``sweep``: its name carries this process's
        id, and the folders of processes that are gone (killed: they could not remove theirs) go."""
        shm = _shared_memory()
        if sweep:
            _sweep(shm or tempfile.gettempdir(), prefix)
            prefix = f"{prefix}{os.getpid()}-"
        return cls(tempfile.mkdtemp(prefix=prefix, dir=shm))

    def resuming(self, resume: Optional[Mapping[int, Any]], restore: Callable[[Any], None] = rng.restore
                 ) -> "WorkerStates":
        """The same folder, for an iteration whose first batches start from the saved ``resume``
        (batch number -> state, as :meth:`look_ahead` read them; ``restore`` puts one back)."""
        return WorkerStates(self.folder, resume, restore)

    def _path(self, serial: int, number: int) -> str:
        return os.path.join(self.folder, f"{serial}-{number}")

    # ------------------------------------------------------------------------- in a worker
    def start(self, serial: int, number: int, workers: int, capture: Callable[[], Any] = cpu_rng,
              note: bool = True) -> Any:
        """A worker starts batch ``number`` of iteration ``serial``: the saved state of a resumed batch
        is put back; returns the state the batch starts from (``capture()``), noted when ``note``."""
        saved = self.resume.pop(number, None)
        if saved is not None:
            self.restore(saved)
        state = capture()
        if note:
            self.note(serial, number, workers, state)
        return state

    def note(self, serial: int, number: int, workers: int, state: Any) -> None:
        """Leave ``state`` for the main process; drop the one this worker left
        :data:`KEPT_PER_WORKER` batches ago (``workers``: how many share the batches round-robin)."""
        path = self._path(serial, number)
        try:
            with open(path + ".tmp", "wb") as f:
                pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(path + ".tmp", path)
            old = number - workers * KEPT_PER_WORKER
            if old >= 0:
                os.unlink(self._path(serial, old))
        except OSError:
            pass

    def mark(self, name: str) -> None:
        """Leave a flag ``name`` (seen by every process of the loader)."""
        try:
            open(os.path.join(self.folder, name), "a").close()
        except OSError:
            pass

    def marked(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.folder, name))

    def handed(self, serial: int, number: int) -> Any:
        """The state the main process left (:meth:`hand`) for batch ``number`` of iteration ``serial``
        (taken: read once), or None."""
        path = os.path.join(self.folder, f"h{serial}-{number}")
        try:
            with open(path, "rb") as f:  # written by this loader's own main process, never a checkpoint
                state = pickle.load(f)
            os.unlink(path)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        return state

    # -------------------------------------------------------------------- in the main process
    def hand(self, serial: int, number: int, state: Any) -> None:
        """Leave ``state`` for the worker that starts batch ``number`` of iteration ``serial``: workers
        that live on from one iteration to the next (``persistent_workers=True``) get the states of a
        resumed run this way, as new ones get them with :meth:`resuming`."""
        path = os.path.join(self.folder, f"h{serial}-{number}")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)

    def look_ahead(self, serial: int, batches: int, workers: int, total: int,
                   convert: Optional[Callable[[Any], Any]] = None) -> Optional[Dict[str, Any]]:
        """The states the workers start the ``workers`` batches after the first ``batches`` of
        iteration ``serial`` from (those before ``total``), by batch number as a string, each through
        ``convert``; None when one did not come within :data:`STATE_WAIT_S` (a resume would not
        replay the workers' draws). A worker starts such a batch as soon as it has handed over its
        previous one, which the main process has already received."""
        out: Dict[str, Any] = {}
        deadline = time.monotonic() + STATE_WAIT_S
        for n in range(batches, min(batches + workers, total)):
            path = self._path(serial, n)
            while True:  # a worker writes it when it starts that batch: it has it queued
                try:
                    with open(path, "rb") as f:  # written by this loader's own workers, never a checkpoint
                        state = pickle.load(f)
                    break
                except (OSError, EOFError, pickle.UnpicklingError):
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(0.002)
            out[str(n)] = convert(state) if convert is not None else state
        return out

    def forget_before(self, serial: int) -> None:
        """Remove the states noted for the iterations before ``serial`` (the last
        :data:`KEPT_PER_WORKER` of each would otherwise stay, for every epoch of a long training)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            iteration, dash, _ = name.lstrip("h").partition("-")
            if dash and iteration.isdigit() and int(iteration) < serial:
                try:
                    os.unlink(os.path.join(self.folder, name))
                except OSError:
                    pass

    def clear(self) -> None:
        """Forget every state noted (an iteration ended: its states are no longer needed)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            try:
                os.unlink(os.path.join(self.folder, name))
            except OSError:
                pass

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _sweep(parent: str, prefix: str) -> None:
    """Remove the folders ``{prefix}{pid}-*`` of processes that are gone, untouched for an hour (a live
    training's workers write in theirs every batch: another PID namespace sharing /dev/shm cannot lose
    a folder in use)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if time.time() - os.path.getmtime(path) < 3600:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # gone meanwhile, or another user's process: alive
            pass


class MadeStates:
    """The random states batches are made from in the main process (see the module docstring): noted
    for a step's first batch (batch ``b`` with ``b % every == 0``) while ``watch``, and a resumed
    pass's ``plan`` (batch -> state to put back just before it is made)."""

    def __init__(self, keep: int = 4):
        self.watch = False
        self.every = 1
        self.noted: Deque[Tuple[int, Dict[str, Any]]] = collections.deque(maxlen=keep)
        self.plan: Dict[int, Dict[str, Any]] = {}

    def making(self, b: int, plan: Optional[Dict[int, Dict[str, Any]]] = None) -> None:
        """Batch ``b`` is about to be made: put back its planned state, note the one it is made from
        (``plan``: the one a pass took at its start, if it keeps its own)."""
        state = (self.plan if plan is None else plan).pop(b, None)
        if state is not None:
            rng.restore(state)
        if self.watch and not b % self.every:
            self.noted.append((b, cpu_rng()))

    def ahead_of(self, trained: int) -> List[List[Any]]:
        """``[batch, state]`` of the batches noted from batch ``trained`` on (made, not trained yet)."""
        return [[b, s] for b, s in self.noted if b >= trained]

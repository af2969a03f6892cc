"""Starting a fastai training epoch at any batch, exactly, by replaying the loader's own randomness.

A fastai ``DataLoader`` computes an epoch's order in the main process (``randomize()`` and
``get_idxs()``: its own ``random.Random``, and for ``TabWeightedDL`` / ``SortedDL`` the global NumPy
generator), then iterates its ``fake_l`` (a ``_FakeLoader``) through a torch iterator, which draws its
workers' base seed from the global torch generator; workers are seeded by fastai's ``_wif`` and take
every ``num_workers``-th batch. keepalive changes none of that: with it and no interruption the training
is the training without it.

For the duration of a fit, :func:`install` turns ``fake_l`` into a :class:`_PositionedLoader`, which
yields what fastai's yields (``sample()``'s indices, fastai's split among workers) and can start an
epoch at a batch: the first ``k`` batches' indices are generated and passed over, no item is loaded.
What it records:

* :func:`epoch_start` (as an epoch's training begins): every global random state and each loader's
  ``rng``; a resumed epoch (:func:`resume_epoch`) puts them back, so that fastai draws the same order
  and the same base seed the normal way, and the random state of the saved step is put back once the
  iterator is made, right before the first batch is fetched (``on_positioned``);
* in worker processes (seeded by fastai's ``_wif``), the random state each batch starts from
  (augmentation in workers draws from it), through :class:`keepalive.callbacks.replay.WorkerStates`:
  a mid-epoch checkpoint keeps those of the next ``num_workers`` batches (:func:`worker_states`), and
  a resumed epoch's worker ``w`` starts its first batch from the state the uninterrupted run's worker
  had for it, so the rest of the epoch draws what it drew then.

Which loaders: fastai's ``DataLoader`` / ``TfmdDL`` / ``TabDataLoader`` and the default loaders of
tabular, text and language-model learners, ``TabWeightedDL``, ``SortedDL`` and ``LMDataLoader``
(:data:`_KNOWN_ORDER`; an ``LMDataLoader``'s text order, which its shuffle permutes in place from epoch
to epoch, is saved and restored with the loaders' RNGs: :func:`dl_rngs`); a loader with
another ``get_idxs`` / ``shuffle_fn`` / ``sample`` / ... cannot be positioned (:func:`positionable`
says why; the adapter then checkpoints at epoch ends only).
"""
from __future__ import annotations

import itertools
import random
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from fastai.data import load as _load
from fastai.data.load import DataLoader as FastaiDataLoader

from .. import rng
from ..errors import StateMismatchError
from . import _compat_fastai as fc
from .replay import STATE_WAIT_S, WorkerStates

# fastai's private iterable that torch's DataLoader iterates; a fastai without it imports this module
# still, and DriveCheckpoint(...) then says what is missing (``_compat_fastai``) instead of an ImportError
_FakeLoader: Any = getattr(_load, "_FakeLoader", object)

__all__ = ["positionable", "check_resumable", "install", "rewind", "uninstall", "dl_rngs", "set_dl_rngs",
           "epoch_start", "resume_epoch", "worker_states", "STATE_WAIT_S"]

#: fastai classes whose order methods replay from the recorded states (module, class, methods)
_KNOWN_ORDER = (("fastai.tabular.core", "TabWeightedDL", ("get_idxs",)),
                ("fastai.text.data", "SortedDL", ("get_idxs", "shuffle_fn")),
                ("fastai.text.data", "LMDataLoader", ("shuffle_fn",)))
#: the worker-state folders' names: keepalive-fastai-workers-{pid}-... (those of dead processes are swept)
_FOLDER = "keepalive-fastai-workers-"


def _known(name: str) -> List[Any]:
    """fastai's own implementations of order method ``name`` (of the classes already imported)."""
    out = [getattr(FastaiDataLoader, name)]
    for module, cls_name, methods in _KNOWN_ORDER:
        cls = getattr(sys.modules.get(module), cls_name, None)
        if cls is not None and name in methods:
            out.append(getattr(cls, name))
    return out


def positionable(dl: Any) -> Optional[str]:
    """None when a fastai DataLoader can start an epoch at any batch exactly, else why not."""
    if not isinstance(dl, FastaiDataLoader):
        return f"the training loader is a {type(dl).__name__}, not a fastai DataLoader"
    if not dl.indexed or dl.bs is None or dl.n is None:
        return "the training loader is not an indexed, batched dataset of known length"
    for name in fc.ORDER_METHODS:
        if name in dl.__dict__:
            return f"the training loader has a custom {name}()"
        if not any(getattr(type(dl), name) is f for f in _known(name)):
            return f"{type(dl).__name__} overrides {name}()"
    if type(dl.fake_l) not in (_FakeLoader, _PositionedLoader):
        return f"the loader's iterator source is a {type(dl.fake_l).__name__}"
    if dl.fake_l.num_workers > 0 and dl.fake_l.persistent_workers:
        return "persistent_workers=True keeps worker state across epochs"
    return None


# -------------------------------------------------------------------------------- iteration
def _indices(dl: FastaiDataLoader, start: int, states: Optional[WorkerStates], serial: int = 0) -> Iterator[Any]:
    """What fastai's ``dl.sample()`` yields, from batch ``start`` on (the same for start 0).

    The indices are those ``get_idxs()`` computed for this epoch in the main process (a list or an
    iterator: ``SortedDL``); the first ``start`` batches' indices are passed over without loading
    anything. Batches go to workers round-robin from ``start`` (fastai's split, shifted), which is
    the order torch's iterator collects them in. In a worker, ``states`` notes the random state each
    of its batches starts from (iteration ``serial``), and puts back a resumed batch's.
    """
    idxs = dl._DataLoader__idxs
    bs = dl.bs
    nw, offs = dl.num_workers, dl.offs  # 1, 0 in the main process; fastai's _wif sets them in workers
    it = iter(idxs)
    skip = start * bs
    if skip:
        for _ in itertools.islice(it, skip):
            pass
    for i, s in enumerate(it, start=skip):
        k = i // bs
        if (k - start) % nw != offs:
            continue
        if states is not None and i % bs == 0:
            states.start(serial, k, nw)
        yield s


class _Counter:
    """Stands in for ``_FakeLoader._index_sampler`` (``Inf.count``: the "indices" torch's iterator hands
    to workers, which fastai ignores). Its first ``next()`` in the main process comes once the
    iterator is made (order and base seed drawn, workers started), right before the first batch is
    fetched: there ``hook`` runs, once."""

    def __init__(self) -> None:
        self.hook: Optional[Callable[[], None]] = None

    def __iter__(self) -> Iterator[int]:
        return self._count()

    def _count(self) -> Iterator[int]:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        yield from itertools.count()

    def __getstate__(self) -> Dict[str, Any]:  # pickled to spawned workers: without the hook
        return {"hook": None}


class _PositionedLoader(_FakeLoader):
    """fastai's ``_FakeLoader`` (the iterable torch's DataLoader iterates) able to start at a batch.

    Put in place (``__class__``) for the duration of a fit. ``_ka_start``: the first batch of the next
    iteration; ``_ka_folder`` / ``_ka_serial``: where workers note their batches' random states (with
    workers), and for which iteration; ``_ka_resume``: the saved states of a resumed epoch's first
    batches (number -> pickled state).
    """

    _ka_start = 0
    _ka_folder: Optional[str] = None
    _ka_serial = 0
    _ka_resume: Optional[Dict[int, Any]] = None

    def __iter__(self):
        states = None
        if self._ka_folder is not None and torch.utils.data.get_worker_info() is not None:
            states = WorkerStates(self._ka_folder, self._ka_resume)
        return iter(self.d.create_batches(_indices(self.d, self._ka_start, states, self._ka_serial)))


def check_resumable(n_saved: int, n_now: int, why_not: Optional[str]) -> None:
    """Refuse a checkpoint taken inside an epoch of ``n_saved`` batches where this loader (``n_now``
    batches; :func:`positionable` said ``why_not``) cannot start at the same item."""
    if n_saved != n_now:
        raise StateMismatchError(
            f"the checkpoint is inside an epoch of {n_saved} batches, the training data now has {n_now} "
            "per epoch: the data or the batch size changed. Nothing was loaded.")
    if why_not is not None:
        raise StateMismatchError(f"the checkpoint is inside an epoch, but this training loader cannot be "
                                 f"positioned ({why_not}). Nothing was loaded.")


def install(dl: FastaiDataLoader) -> None:
    """Make a :func:`positionable` loader's epochs startable at any batch (from batch 0 until told)."""
    fl = dl.fake_l
    fl.__class__ = _PositionedLoader
    fl._ka_start = 0
    fl._ka_resume = None
    fl._index_sampler = _Counter()
    if fl.num_workers > 0 and fl.__dict__.get("_ka_folder") is None:
        fl._ka_folder = WorkerStates.create(_FOLDER, sweep=True).folder


# ------------------------------------------------------------------------------ epoch RNGs
def _lm_order(dl: Any) -> Optional[List[Any]]:
    """An ``LMDataLoader``'s text order: its shuffle permutes the texts in place (``items.idxs``, shared
    with ``lens``), each epoch from the last one's; None for other loaders."""
    cls = getattr(sys.modules.get("fastai.text.data"), "LMDataLoader", None)
    order = getattr(getattr(getattr(dl, "items", None), "idxs", None), "items", None)
    return order if cls is not None and isinstance(dl, cls) and isinstance(order, list) else None


def dl_rngs(learn: Any) -> List[Any]:
    """The state of each fastai ``DataLoader``'s ``random.Random`` (its shuffling order); for an
    ``LMDataLoader`` ``{"rng": that, "order": its texts' order}``."""
    out: List[Any] = []
    for dl in learn.dls.loaders:
        state = dl.rng.getstate() if isinstance(getattr(dl, "rng", None), random.Random) else None
        order = _lm_order(dl)
        out.append(state if order is None else {"rng": state, "order": np.asarray(order, dtype=np.int64)})
    return out


def set_dl_rngs(learn: Any, states: Optional[List[Any]]) -> None:
    for dl, state in zip(learn.dls.loaders, states or []):
        if isinstance(state, dict):
            order, live = state.get("order"), _lm_order(dl)
            if order is not None and live is not None and len(order) == len(live):
                live[:] = [int(i) for i in order]  # in place: items and lens share the list
                dl.make_chunks()
            state = state.get("rng")
        if state is not None and isinstance(getattr(dl, "rng", None), random.Random):
            dl.rng.setstate(_as_tuple(state))


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _next_iteration(dl: FastaiDataLoader) -> None:
    """A new iteration of an installed loader begins: its workers note states under a new number."""
    fl = dl.fake_l
    if not isinstance(fl, _PositionedLoader):
        return
    fl._ka_serial = fl._ka_serial + 1
    folder = fl._ka_folder
    if folder is not None:  # the last iteration's states: no longer needed
        WorkerStates(folder).clear()


def epoch_start(learn: Any, dl: FastaiDataLoader) -> Dict[str, Any]:
    """What an epoch's data depends on, taken as its training begins (its iterator not made yet): every
    global random state (the order of ``TabWeightedDL`` / ``SortedDL``, the base seed) and the
    loaders' RNGs (``randomize`` / ``shuffle_fn``); saved with every mid-epoch checkpoint."""
    _next_iteration(dl)
    return {"rng": rng.capture(), "dl_rngs": dl_rngs(learn), "workers": int(dl.fake_l.num_workers)}


def resume_epoch(learn: Any, dl: FastaiDataLoader, start: Dict[str, Any], batch: int,
                 workers: Optional[Dict[str, Any]], on_positioned: Callable[[], None]) -> Dict[str, Any]:
    """The epoch that began with the saved :func:`epoch_start` ``start`` goes on at ``batch`` of ``dl``
    (an installed loader); returns the running epoch's :func:`epoch_start` record.

    The global and the loaders' random states are put back as they were when the epoch began, so that
    fastai makes the same order and base seed the normal way; ``on_positioned`` (put back the saved
    step's random state) runs once the iterator is made, before the first batch is fetched. Workers
    start their first batches from the saved states ``workers`` (None or empty: none saved).
    """
    _next_iteration(dl)
    fl = dl.fake_l
    if "rng" in start:
        rng.restore(start["rng"])
    else:  # written by keepalive < issue 21: the base seed only (workers were seeded per batch then)
        torch.set_rng_state(start["torch"].clone())
    set_dl_rngs(learn, start["dl_rngs"])
    record = {"rng": rng.capture(), "dl_rngs": dl_rngs(learn), "workers": int(fl.num_workers)}
    fl._ka_start = batch
    fl._ka_resume = {int(k): v for k, v in (workers or {}).items()}
    fl._index_sampler.hook = on_positioned
    return record


def worker_states(dl: FastaiDataLoader, batches: int, n_iter: int) -> Optional[Dict[str, Any]]:
    """The random states the workers start the batches after the first ``batches`` of the running
    epoch from (a mid-epoch checkpoint's): ``{}`` without workers, None when one of them did not come
    in time (a resume would not replay the workers' draws). A worker starts such a batch as soon as
    it has handed over its previous one, which the main process has already received."""
    fl = dl.fake_l
    folder = getattr(fl, "_ka_folder", None)
    if folder is None:
        return {}
    return WorkerStates(folder).look_ahead(fl._ka_serial, batches, fl.num_workers, n_iter)


def rewind(dl: FastaiDataLoader) -> None:
    """After a (possibly resumed) epoch: the next one starts at batch 0."""
    fl = dl.fake_l
    if isinstance(fl, _PositionedLoader):
        fl._ka_start = 0
        fl._ka_resume = None
        fl._index_sampler.hook = None


def uninstall(dl: FastaiDataLoader) -> None:
    """Give the loader its own ``_FakeLoader`` back (the fit ended, or stopped anywhere)."""
    fl = dl.fake_l
    if isinstance(fl, _PositionedLoader):
        folder = fl.__dict__.get("_ka_folder")
        if folder is not None:
            WorkerStates(folder).remove()
        for name in ("_ka_start", "_ka_folder", "_ka_serial", "_ka_resume", "_index_sampler"):
            fl.__dict__.pop(name, None)
        fl.__class__ = _FakeLoader

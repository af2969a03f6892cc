"""Starting a fastai training epoch at any batch, exactly (for the fastai ``DriveCheckpoint``).

A fastai ``DataLoader`` computes an epoch's order in the main process (``get_idxs()``, from its own
``random.Random``) and torch's ``DataLoader`` iterates its ``fake_l`` (a ``_FakeLoader``). For the
duration of a fit, :func:`install` turns that ``fake_l`` into a :class:`_PositionedLoader`, which yields
the same batches from a chosen batch on without loading the skipped items; :func:`uninstall` puts it
back. With worker processes, each batch's worker RNGs are seeded from the iterator's seed and the batch
index (instead of once per worker), so augmentation in workers does not depend on where the epoch began.
The loaders' own RNGs (the order) and the global torch RNG as an epoch's data begins are saved with a
mid-epoch checkpoint (:func:`epoch_start`) and set back when that epoch resumes (:func:`resume_epoch`).
"""
from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Optional

import torch
from fastai.data import load as _load
from fastai.data.load import DataLoader as FastaiDataLoader

from ..dataorder import mix
from ..errors import StateMismatchError
from . import _compat_fastai as fc
from .torchstate import seed_worker_rngs

# fastai's private iterable that torch's DataLoader iterates; a fastai without it imports this module
# still, and DriveCheckpoint(...) then says what is missing (``_compat_fastai``) instead of an ImportError
_FakeLoader: Any = getattr(_load, "_FakeLoader", object)

__all__ = ["positionable", "check_resumable", "install", "rewind", "uninstall", "dl_rngs", "set_dl_rngs",
           "epoch_start", "resume_epoch"]


def positionable(dl: Any) -> Optional[str]:
    """None when a fastai DataLoader can start an epoch at any batch exactly, else why not."""
    if not isinstance(dl, FastaiDataLoader):
        return f"the training loader is a {type(dl).__name__}, not a fastai DataLoader"
    if not dl.indexed or dl.bs is None or dl.n is None:
        return "the training loader is not an indexed, batched dataset of known length"
    for name in fc.ORDER_METHODS:
        if name in dl.__dict__:
            return f"the training loader has a custom {name}()"
        if getattr(type(dl), name) is not getattr(FastaiDataLoader, name):
            return f"{type(dl).__name__} overrides {name}()"
    if type(dl.fake_l) not in (_FakeLoader, _PositionedLoader):
        return f"the loader's iterator source is a {type(dl.fake_l).__name__}"
    if dl.fake_l.num_workers > 0 and dl.fake_l.persistent_workers:
        return "persistent_workers=True keeps worker state across epochs"
    return None


def _indices(dl: FastaiDataLoader, start: int, seed_batches: bool) -> Iterator[Any]:
    """What ``dl.sample()`` yields, from batch ``start`` on (fastai's default ``sample`` for start 0).

    The indices are those ``get_idxs()`` computed for this epoch in the main process (from the
    loader's own RNG, restored on resume), so no skipped item is loaded. Batches go to workers
    round-robin from ``start`` (fastai's split, shifted), which the main process collects in order.
    In a worker process with ``seed_batches`` the RNGs are seeded per batch from the iterator's base
    seed and the batch index, so a batch's augmentation does not depend on which worker made it.
    """
    idxs = dl._DataLoader__idxs
    bs = dl.bs
    nw, offs = dl.num_workers, dl.offs  # 1, 0 in the main process; fastai's _wif sets them in workers
    base = None
    if seed_batches:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            base = info.seed - info.id  # the iterator's base seed
    for i in range(start * bs, len(idxs)):
        k = i // bs
        if (k - start) % nw != offs:
            continue
        if base is not None and i % bs == 0:
            seed_worker_rngs(mix(base, k))
        yield idxs[i]


class _PositionedLoader(_FakeLoader):
    """fastai's ``_FakeLoader`` (the iterable torch's DataLoader iterates) starting at a batch.

    Put in place (``__class__``) for the duration of a fit; ``_ka_start`` is the first batch of the
    next iteration, ``_ka_seed_batches`` turns per-batch worker seeding on, ``_ka_generator`` says that
    ``generator`` is ours (see :func:`resume_epoch`).
    """

    _ka_start = 0
    _ka_seed_batches = False
    _ka_generator = False

    def __iter__(self):
        return iter(self.d.create_batches(_indices(self.d, self._ka_start, self._ka_seed_batches)))


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
    fl._ka_seed_batches = fl.num_workers > 0


# ------------------------------------------------------------------------------ epoch RNGs
def dl_rngs(learn: Any) -> List[Any]:
    """The state of each fastai ``DataLoader``'s ``random.Random`` (its shuffling order)."""
    return [dl.rng.getstate() if isinstance(getattr(dl, "rng", None), random.Random) else None
            for dl in learn.dls.loaders]


def set_dl_rngs(learn: Any, states: Optional[List[Any]]) -> None:
    for dl, state in zip(learn.dls.loaders, states or []):
        if state is not None and isinstance(getattr(dl, "rng", None), random.Random):
            dl.rng.setstate(_as_tuple(state))


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def epoch_start(learn: Any) -> Dict[str, Any]:
    """What an epoch's data depends on, taken as its training begins: the global torch RNG (the
    iterator's base seed) and the loaders' RNGs (the order); saved with every mid-epoch checkpoint."""
    return {"torch": torch.get_rng_state(), "dl_rngs": dl_rngs(learn)}


def resume_epoch(learn: Any, dl: FastaiDataLoader, start: Dict[str, Any], batch: int) -> Dict[str, Any]:
    """The epoch that began with the saved :func:`epoch_start` ``start`` goes on at ``batch`` of ``dl``
    (an installed loader); returns ``start`` as the running epoch's.

    The loaders' RNGs are set so ``get_idxs()`` recomputes the epoch's order. The iterator draws its
    (worker) base seed from the global torch RNG: it gets a private generator in the saved state, so
    the base seed is the same and the global RNGs (restored to the saved step) are not consumed.
    """
    set_dl_rngs(learn, start["dl_rngs"])
    fl = dl.fake_l
    generator = torch.Generator()
    generator.set_state(start["torch"].clone())
    fl.generator = generator
    fl._ka_generator = True
    fl._ka_start = batch
    return {"torch": start["torch"].clone(), "dl_rngs": _as_tuple(start["dl_rngs"])}


def rewind(dl: FastaiDataLoader) -> None:
    """After a (possibly resumed) epoch: the next one starts at batch 0 with the global RNG again."""
    fl = dl.fake_l
    fl._ka_start = 0
    if fl.__dict__.pop("_ka_generator", False):
        fl.__dict__.pop("generator", None)


def uninstall(dl: FastaiDataLoader) -> None:
    """Give the loader its own ``_FakeLoader`` back (the fit ended, or stopped anywhere)."""
    fl = dl.fake_l
    if isinstance(fl, _PositionedLoader):
        rewind(dl)
        for name in ("_ka_start", "_ka_seed_batches"):
            fl.__dict__.pop(name, None)
        fl.__class__ = _FakeLoader

"""Sampler-level mid-epoch positioning of a Lightning training ``DataLoader``.

The ``DataLoader`` that ``train_dataloader()`` returns is rebuilt (once per request; Lightning asks again
only with ``reload_dataloaders_every_n_epochs``) around a batch sampler whose order of an epoch is a
function of ``(seed, epoch)`` (:class:`keepalive.callbacks._torch_data.ResumableBatchSampler`): a resume
at batch ``b`` computes that epoch's permutation (indices only) and starts at sample ``b * batch_size``;
no skipped sample is loaded. The global RNGs are never drawn from, so dropout and augmentation in the
main process see the stream they would have seen without a restart; DataLoader workers are seeded per
batch.

The rebuilt loader speaks Lightning's own resumable-loader protocol (``state_dict`` /
``load_state_dict``, what ``torchdata``'s ``StatefulDataLoader`` offers): Lightning stores its position
in ``fit_loop.state_dict()["combined_loader"]`` and gives it back when a fit restarts inside an epoch,
right before it creates the epoch's iterator. Its length is the whole epoch's (Lightning counts the
epoch's batches from it); a positioned iteration yields the rest of the epoch.

Positioned: ``DataLoader`` s over map-style datasets with a ``RandomSampler`` (without replacement) or
a ``SequentialSampler``. Anything else (``IterableDataset``, custom samplers, ``DataLoader`` subclasses)
is left as it is and the run is checkpointed at epoch ends only (the adapter says so once).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from torch.utils.data import DataLoader

from ..dataorder import mix
from ._torch_data import ResumableBatchSampler, ResumableLoader, SeededDataset

FORMAT = 1


class EpochBatchSampler(ResumableBatchSampler):
    """A :class:`ResumableBatchSampler` whose length is always the whole epoch's number of batches."""

    def __len__(self) -> int:
        return self.batches_per_epoch


class PositionedLoader(DataLoader):
    """The user's training loader on an :class:`EpochBatchSampler`; ``epoch_of()`` says which epoch an
    iteration is (asked when Lightning creates the epoch's iterator)."""

    def __init__(self, original: DataLoader, seed: int, epoch_of: Callable[[], int],
                 warn: Callable[[str, str], None]):
        bs = original.batch_sampler
        sampler = EpochBatchSampler(len(original.dataset), bs.batch_size, bs.drop_last,  # type: ignore
                                    _shuffled(original), seed)
        kwargs: Dict[str, Any] = dict(
            batch_sampler=sampler, num_workers=original.num_workers, collate_fn=original.collate_fn,
            pin_memory=original.pin_memory, timeout=original.timeout,
            worker_init_fn=original.worker_init_fn,
            multiprocessing_context=original.multiprocessing_context,
            persistent_workers=original.persistent_workers, pin_memory_device=original.pin_memory_device)
        if original.num_workers > 0:
            kwargs["prefetch_factor"] = original.prefetch_factor
        if hasattr(original, "in_order"):
            kwargs["in_order"] = original.in_order
        import torch

        gen = torch.Generator()
        super().__init__(SeededDataset(original.dataset), generator=gen, **kwargs)
        self.keepalive_original = original
        self._keepalive_sampler = sampler
        self._keepalive_epoch_of = epoch_of
        self._keepalive_warn = warn
        self._keepalive_pending: Optional[Tuple[int, int]] = None
        self.keepalive_epoch = -1        # the epoch of the running iteration
        self.keepalive_samples = 0       # samples of that epoch's order handed to Lightning

    # --------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self._keepalive_sampler
        epoch = int(self._keepalive_epoch_of())
        start = 0
        pending, self._keepalive_pending = self._keepalive_pending, None
        if pending is not None and pending[0] == epoch:
            start = min(pending[1], sampler.n)
        sampler.epoch, sampler.start_sample = epoch, start
        self.generator.manual_seed(mix(sampler.seed, epoch, 2))  # type: ignore[union-attr]
        self.keepalive_epoch, self.keepalive_samples = epoch, start
        return _Counted(super().__iter__(), self)

    # ---------------------------------------------------- Lightning's resumable-loader protocol
    def state_dict(self) -> Dict[str, Any]:
        """Where the running epoch is: its number and the samples of its order already handed out."""
        return {"keepalive": FORMAT, "epoch": self.keepalive_epoch, "samples": self.keepalive_samples,
                "batch_size": self._keepalive_sampler.batch_size, "seed": self._keepalive_sampler.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The next iteration of that epoch starts at the saved sample."""
        if not isinstance(state, dict) or state.get("keepalive") != FORMAT:
            return
        size = self._keepalive_sampler.batch_size
        if state.get("batch_size") not in (None, size):
            self._keepalive_warn(
                f"the batch size is {size} now, {state['batch_size']} in the checkpoint: epoch "
                f"{state['epoch']} continues at sample {state['samples']} of its order with the same samples, "
                "but its batches (and from here the model) differ from an uninterrupted run: the result is "
                "not bit-identical to one.", "batch-size")
        self._keepalive_pending = (int(state["epoch"]), int(state["samples"]))


class _Counted:
    """The loader's iterator, counting the samples it hands out (not those its workers prefetch)."""

    def __init__(self, it: Iterator[Any], loader: PositionedLoader):
        self.it, self.loader, self.k = it, loader, 0

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        self.loader.keepalive_samples += self.loader._keepalive_sampler.batch_len(self.k)
        self.k += 1
        return batch

    def __len__(self) -> int:
        return len(self.it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # _shutdown_workers() and friends of torch's iterator
        return getattr(self.it, name)


def why_not_positionable(loader: Any) -> Optional[str]:
    """None when :class:`PositionedLoader` can stand in for ``loader``, else why not (for the user)."""
    if isinstance(loader, PositionedLoader):
        return None
    if not isinstance(loader, DataLoader):
        return (f"the training data is a {type(loader).__name__}, not a torch DataLoader: checkpoints at "
                "epoch ends only")
    plain = ResumableLoader(loader, 0)  # the torch adapter's judgement of a loader (builds no workers)
    return None if plain.mid_epoch else plain.why_not


def _shuffled(loader: DataLoader) -> bool:
    plain = ResumableLoader(loader, 0)
    return bool(plain.sampler is not None and plain.sampler.shuffle)


def position(dataloaders: Any, seed: int, epoch_of: Callable[[], int],
             warn: Callable[[str, str], None]) -> Tuple[Any, Optional[str]]:
    """``train_dataloader()``'s result with every positionable DataLoader replaced; and why not, if
    one of them cannot be (then the run is saved at epoch ends only)."""
    if isinstance(dataloaders, (list, tuple)):
        parts = [position(dl, mix(seed, i), epoch_of, warn) for i, dl in enumerate(dataloaders)]
        why = next((w for _, w in parts if w), None)
        return type(dataloaders)(p for p, _ in parts), why
    if isinstance(dataloaders, dict):
        out, why = {}, None
        for i, (k, dl) in enumerate(dataloaders.items()):
            out[k], w = position(dl, mix(seed, i), epoch_of, warn)
            why = why or w
        return out, why
    why = why_not_positionable(dataloaders)
    if why is not None or isinstance(dataloaders, PositionedLoader):
        return dataloaders, why
    return PositionedLoader(dataloaders, seed, epoch_of, warn), None

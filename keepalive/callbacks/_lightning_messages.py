"""What the Lightning adapter tells the user: a ``ckpt_path`` that replaced the run's checkpoint, random
draws of loader workers a resume cannot replay, loaders reloaded every few epochs, a checkpoint of an
older keepalive, a save that waits for the end of a validation. Each is one line, said once (by its key)
through the core."""
from __future__ import annotations

from typing import Any

from ..core import Checkpointer

#: the end of the one line that says a save during a validation had to wait (the state had changed)
PAUSE_HINT = ("To have it saved at once during a validation, change the training state (an EMA, a scheduler, "
              "a callback's counters) in on_train_batch_end or on_validation_end, not in on_validation_start / "
              "on_validation_epoch_start or during the validation")


def tell_ckpt_path(core: Checkpointer, ckpt_path: Any, replaced: str) -> None:
    core.warn(f"fit(ckpt_path={ckpt_path!r}) replaced the run's newest checkpoint ({replaced}) with that file: "
              "training continues from it, as Lightning restores it (no RNG, data position or epoch "
              "accumulators). Leave ckpt_path out to let DriveCheckpoint resume.", key="ckpt_path")


def tell_worker_draws(core: Checkpointer, workers: int) -> None:
    core.warn(f"the training loader's {workers} worker(s) draw random numbers (augmentation in the "
              "dataset), and keepalive could not take their random state for this checkpoint (a "
              "worker that did not start the next batch in time): a resume from it replays the data "
              "order exactly, but not the workers' draws for the rest of that epoch.", key="worker-draws")


def tell_persistent_draws(core: Checkpointer, workers: int) -> None:
    core.warn(f"the training loader's {workers} persistent worker(s) (persistent_workers=True) draw random "
              "numbers (augmentation in the dataset): a resume starts new workers, which do not continue the "
              "random streams of the ones they replace, so the augmentation after a resume differs from an "
              "uninterrupted run (the data order and the main process's draws are exact). "
              "persistent_workers=False resumes bit-exactly.", key="persistent-worker-draws")


def tell_reload_every(core: Checkpointer, every: int) -> None:
    core.warn(f"Trainer(reload_dataloaders_every_n_epochs={every}): a resumed fit builds its training loaders "
              "in its first epoch and counts the next reloads from there, so they fall on other epochs than "
              "in an uninterrupted fit, whose data order and worker seeds then differ. "
              "reload_dataloaders_every_n_epochs=1 (or 0) resumes bit-exactly.", key="reload-every")


def tell_old_position(core: Checkpointer, epoch: int, batches: int) -> None:
    core.warn(f"this checkpoint was written by an older keepalive, whose data order differs: epoch "
              f"{epoch} restarts from its first batch (its first {batches} "
              "batches are trained again).", key="old-position")

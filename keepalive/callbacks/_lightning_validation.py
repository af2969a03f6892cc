"""The validations of a Lightning fit, as the checkpoints see them.

Lightning validates inside the epoch loop's ``on_advance_end``, after the training batch is done but before
that batch's boundary (and before its plateau schedulers and logger counters move): the batch's boundary is
made at the validation's start instead, and a save during the validation holds that state, with the
validation loop's progress as Lightning writes it for a validation that was interrupted: a resume runs the
validation again, from its first batch, then goes on. :class:`ValidationPhase` keeps the state a
validation started from and where the fit is in it (running, its end hooks done, weights swapped in).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

try:  # the unified package first; the classic namespace is the same code
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from . import _lightning_state as lstate

#: the key of the data part (which the core keeps per rank: :data:`keepalive.distributed.PER_RANK`) under
#: which a rank's own accumulators travel
OWN = "rank_state"
#: callbacks that swap other weights into the model for a validation (through .data): the state during
#: the validation is not the last step's, whatever its version counters say
WEIGHT_SWAPPERS = tuple(c for c in (getattr(pl.callbacks, "WeightAveraging", None),) if c is not None)


def own_state(trainer: Any) -> Dict[str, Any]:
    """What each rank accumulates itself and a checkpoint holds per rank: torchmetrics states and the
    trainer's last logged values."""
    return {"metrics": lstate.capture_metrics(trainer.lightning_module),
            "trainer_metrics": lstate.capture_trainer_metrics(trainer)}


class ValidationPhase:
    """Where the fit is with respect to its validations (not ``trainer.validate()``'s, nor the sanity check)."""

    def __init__(self) -> None:
        #: while a validation of the fit runs: the state it started from (what a save during it holds)
        self.start: Optional[Dict[str, Any]] = None
        self.over = False            # its end hooks ran: the loop moves on from here
        self.counted_before = False  # the batch's boundary was made before its validation
        self.resumed_in = False      # this fit resumed from a save made during a validation
        #: during a validation whose hooks swap averaged weights into the model (see :meth:`started`)
        self.weights_swapped = False

    @property
    def running(self) -> bool:
        return self.start is not None

    def begin(self, trainer: Any) -> None:
        """The validation loop of the fit is about to run (before it builds its loader's iterator, which
        draws a random seed): keep the state a save during it holds."""
        own = own_state(trainer)
        self.start = {
            "val_progress": trainer.fit_loop.epoch_loop.val_loop.batch_progress.state_dict(),
            # what the validation's logging changes (copied now: a save during it holds the start's)
            OWN: {"metrics": lstate.copy_tensors(own["metrics"]), "trainer_metrics": own["trainer_metrics"]},
            "loggers": lstate.capture_csv(trainer)}
        self.over = False

    def started(self, trainer: Any, fitting: bool) -> None:
        """``on_validation_start`` of any validation; ``fitting``: one of this callback's fit."""
        if self.start is not None and not trainer.sanity_checking:
            # from the next hook on, a weight-averaging callback evaluates the average swapped into the
            # model's parameters through .data (no version counter moves): no save until it swapped back
            self.weights_swapped = any(isinstance(cb, WEIGHT_SWAPPERS) for cb in trainer.callbacks)
        if self.resumed_in and not trainer.sanity_checking and fitting:
            # the interrupted validation's batch Lightning counted as started: not started after all
            self.resumed_in = False
            total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
            total.ready = total.started = total.processed

    def ended(self, trainer: Any) -> None:
        """``on_validation_end``: its end hooks (EarlyStopping, ModelCheckpoint, the module's) move the state
        on: no save between steps until the next boundary."""
        if self.start is not None and not trainer.sanity_checking:
            self.over = True
            self.weights_swapped = False

    def clear(self) -> None:
        """The boundary after the validation is made: the fit is between validations again."""
        self.start, self.over = None, False

    # ----------------------------------------------------------------------- what a save holds
    def checkpoint(self, ckpt: Dict[str, Any]) -> Dict[str, Any]:
        """Lightning's checkpoint, during a validation as its start's: the validation runs again."""
        return lstate.validation_again(ckpt, self.start["val_progress"]) if self.start is not None else ckpt

    def loggers(self, trainer: Any) -> List[Dict[str, Any]]:
        return self.start["loggers"] if self.start is not None else lstate.capture_csv(trainer)

    def own(self, trainer: Any) -> Dict[str, Any]:
        """This rank's accumulators (see :func:`own_state`), during a validation as its start's."""
        return dict(self.start[OWN]) if self.start is not None else own_state(trainer)

"""``DriveCheckpoint`` for PyTorch Lightning: a ``Callback`` that makes re-running the same cell enough.

::

    trainer = Trainer(max_epochs=20, callbacks=[DriveCheckpoint("/content/drive/MyDrive/runs/lit")])
    trainer.fit(model, datamodule=dm)   # after a reset: continues from the newest valid checkpoint

No ``ckpt_path``: ``fit`` finds the run's newest valid checkpoint itself (falling back past torn or
corrupt ones) and continues bit for bit as if never interrupted, inside an epoch too.

What is saved: exactly what Lightning's own checkpoint holds (``trainer._checkpoint_connector.
dump_checkpoint()``: model, optimizers, LR schedulers, precision plugin / GradScaler, the loops'
progress, every callback's ``state_dict`` (``EarlyStopping``, ``ModelCheckpoint``, yours), the
datamodule's state, your ``on_save_checkpoint`` additions), restored by Lightning's own code
(``_CheckpointConnector``: model, datamodule, callbacks, then precision, loops, optimizers and
schedulers); plus what Lightning leaves out: every RNG (python, numpy, torch CPU / CUDA), the data
position, the epoch's ``self.log(on_epoch=True)`` accumulators, ``torchmetrics`` states and the
trainer's last metrics (:mod:`keepalive.callbacks._lightning_state`). Checkpoints go to keepalive's
store (manifest last, checksums, retention, spool for Drive / gs:// / s3://), never through
``torch.save``; ``keepalive ls`` / ``verify`` see them.

Data: Lightning iterates your training loaders as they are (same objects, same sampler, same worker
seeds), so a fit with keepalive trains on exactly the data a fit without it does. A resumed epoch
continues at its saved sample by replaying the loader's own randomness where Lightning calls ``iter()``
on it (the random states of the epoch's ``iter()`` put back, index generation skipped to the saved
sample without loading the skipped ones, the workers' random states per batch):
:mod:`keepalive.callbacks._lightning_data`. Map-style datasets with any sampler or batch sampler whose
order replays (``shuffle=True/False``, ``batch_sampler=``, ``WeightedRandomSampler``, custom samplers;
an unknown one is checked once), ``StatefulDataLoader`` (through its ``state_dict()``). Other loaders
(``IterableDataset``, a sampler whose order does not replay): checkpoints at epoch ends only, said once.
A ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (the OneCycleLR recipe),
which makes Lightning build the training loader before its loop state is restored, resumes exactly too.
``persistent_workers=True``: exact, augmentation in the workers included (a checkpoint carries their seed
and states). ``reload_dataloaders_every_n_epochs=1`` (a new loader each epoch, which Lightning calls
``iter()`` on twice): exact; every N > 1 epochs is said once (a resume shifts Lightning's reload epochs).

When: ``every=`` (epochs, optimizer steps = ``trainer.global_step``, a duration), before the session's
deadline (then ``trainer.should_stop`` ends the fit, which raises the stop: ``cb.stopped``, a script's
``SystemExit(143)``), at the end of training, on
Ctrl-C / SIGTERM (at the end of the running batch). Saves inside an epoch land between two batches,
after that batch's logging, never while gradients are accumulated (``accumulate_grad_
batches``; with manual optimization a batch without an optimizer step counts as accumulating). A batch
followed by a validation (inside the epoch or at its end) has its boundary at the validation's start:
a save there, or one made during the validation (a signal, a preemption notice, the deadline: saved
at once, see keepalive.pauses), holds the state before the validation, and a resume runs the validation
again from its first batch.

Works with ``lightning.pytorch`` and, by duck typing, with a ``pytorch_lightning`` ``Trainer`` (the same
code under its older name). Several processes: ``strategy="ddp"`` (the script run by ``torchrun`` or
started by Lightning itself, one process per device): replicated state (model, optimizers, schedulers,
loops, callbacks) is rank 0's, every rank's RNGs and position in its shard of the ``DistributedSampler``
Lightning gives it are its own, gathered into one checkpoint that rank 0 commits
(:mod:`keepalive.savepath`, the torch adapter's path); each rank resumes from its own part. Sharded
``strategy="ddp_notebook"`` (``ddp_fork``: the processes forked from the notebook's, what a notebook
with several GPUs uses) works the same way inside the forked processes; the notebook's own copy of the
callback does not follow their fit (``cb.step`` and ``cb.stopped`` stay as they were; the model comes
back from rank 0, as Lightning returns it). Sharded strategies (FSDP, DeepSpeed) and ``ddp_spawn`` (a
pickled callback) are refused in one line that says what to use.

Versions: every Lightning internal this relies on (the loop methods it stands in front of, the
connectors it reads) is listed in :mod:`keepalive.callbacks._compat_lightning` and checked when the
callback is created: a Lightning without one is refused then, in one line, never in the middle of a fit.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Union

try:  # the unified package first; the classic namespace is the same code
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from . import _compat_lightning as lc
from . import _lightning_data as data
from . import _lightning_fit as fit
from . import _lightning_messages as lmsg
from . import _lightning_state as lstate
from ._lightning_attach import LoopEvents, StandIns, attach
from ._lightning_messages import PAUSE_HINT
from ._lightning_validation import OWN, ValidationPhase
from .torchstate import gate_steps, state_summary

__all__ = ["DriveCheckpoint"]

FORMAT = 1


class DriveCheckpoint(CheckpointAdapter, pl.Callback):
    """Checkpoint a Lightning ``Trainer.fit`` to a local folder, a mounted Drive or any fsspec URL.

    Options: see :class:`keepalive.config.CheckpointConfig`. What is saved and restored, and when: see
    the module. ``cb.counters`` / ``cb.step`` / ``cb.epoch`` count the run (``step`` =
    ``trainer.global_step``); ``cb.save()`` works while a fit runs.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, **options: Any):
        lc.COMPAT.check()  # every Lightning internal this adapter uses exists (else one line says which)
        super().__init__()
        cfg = CheckpointConfig.strict(path, config, options, "DriveCheckpoint")
        self.core = Checkpointer(config=cfg, framework="lightning")
        self.core.pause_hint = PAUSE_HINT
        # Lightning runs forward and backward inside optimizer.step(closure), after torch's step
        # pre-hook: a lazy snapshot settled there would overlap nothing. It is settled in
        # on_before_optimizer_step instead (after the closure, before the update) and, for a step
        # without Lightning's closure, at that step's start (_settle_at_plain_step)
        self.core.step_gate.settle_at_step_start = False
        self._trainer_ref: Optional["weakref.ReferenceType[Any]"] = None
        self._stand_ins = StandIns()  # in front of the trainer's loop methods, for one fit
        self.data = data.TrainData(lambda msg, key: self.core.warn(msg, key=key))  # this fit's training loaders
        self.why_not: Optional[str] = None      # why the training data cannot be positioned
        self._pending: Optional[Dict[str, Any]] = None  # restored right before training continues
        self._validation = ValidationPhase()  # the fit's validations: the state a save during one holds
        self._gated: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers whose steps the guard waits for
        self._dropped_descriptive = False

    def __repr__(self) -> str:
        return f"DriveCheckpoint({self.core.url!r})"

    @property
    def trainer(self) -> Any:
        """The ``Trainer`` whose fit this callback checkpoints (None outside a fit)."""
        return self._trainer_ref() if self._trainer_ref is not None else None

    # ----------------------------------------------------------------------------- fit lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        _check_strategy(trainer)  # one process, or DDP with one process per device (else one line)
        self._trainer_ref = weakref.ref(trainer)
        self.data.close()
        self.data = data.TrainData(lambda msg, key: self.core.warn(msg, key=key))
        self._attach(trainer)
        self._resume(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.core.resumed_from is not None and getattr(trainer, "ckpt_path", None):
            lmsg.tell_ckpt_path(self.core, trainer.ckpt_path, self.core.resumed_from.name)
            self._pending = None
            self.data.forget_resume()
            c = self.core.counters
            c["epoch"], c["step"], c["batch"] = trainer.current_epoch, trainer.global_step, 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        core = self.core
        core.total_epochs = trainer.max_epochs if (trainer.max_epochs or -1) > 0 else None
        core.check_storable(self.capture)  # a value that cannot be stored fails now, not at a save
        core.fingerprint = self._fingerprint
        for optimizer in trainer.optimizers:  # automatic and manual optimization: torch optimizers
            if optimizer not in self._gated:  # the guard's thread copies the state only between their steps
                self._gated.add(optimizer)
                gate_steps(core, optimizer)
                optimizer.register_step_pre_hook(_settle_at_plain_step(core))
        core.install_signal_handlers()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning calls this after the closure (forward and backward, every accumulated micro-batch)
        # and before the optimizer changes anything, in automatic and manual optimization, AMP's
        # GradScaler path included: the last moment a lazy snapshot's background copy may run on
        self.core.settle_snapshot()

    # ------------------------------------------------------------------- validation of the fit
    # (see keepalive.callbacks._lightning_validation: a batch's boundary is made at its validation's start)
    def _validation_begins(self, trainer: Any) -> bool:
        """The epoch loop's validation is about to run; True: skip it (the deadline's stop, saved)."""
        if not trainer.sanity_checking and self._fitting(trainer):
            # before it builds its loader's iterator, which draws a random seed: the training batch's
            # boundary, and the state a save during it holds
            self._validation.begin(trainer)
            self._step_boundary(trainer, before_validation=True)
            if self.core.stopped:
                return True  # no validation first
        # a validation may swap the weights in place through .data, which moves no version counter
        # (WeightAveraging / EMAWeightAveraging evaluate the average that way): a lazy snapshot's
        # copy is done and checked before its first hook
        self.core.settle_snapshot()
        return False

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._validation.started(trainer, self._fitting(trainer))

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._validation.running and not trainer.sanity_checking:
            # a signal, a notice or the deadline that came during the validation is saved now (the
            # core makes no such save with several processes: a save is a collective)
            self.core.active(self.capture)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._validation.ended(trainer)

    def _fitting(self, trainer: Any) -> bool:
        """A validation of this callback's fit (not ``trainer.validate()``)."""
        return self.trainer is trainer and trainer.state.fn == "fit"  # TrainerFn is a str enum

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._end(trainer)

    def _end(self, trainer: Any) -> None:
        self._stand_ins.put_back()
        self.data.close()
        self.core.uninstall_signal_handlers()
        self.core.close()  # waits for the write in flight, releases the writer lease

    # ------------------------------------------------------------------------------------ resume
    def _resume(self, trainer: Any, pl_module: Any) -> None:
        core = self.core
        core.new_fit()
        self._pending = None
        settings = lstate.module_settings(pl_module)  # another lr than a finished unnamed run's: a run of its own
        if settings:
            core.metadata["settings"] = settings
            core.training_settings = lambda: dict(settings)
        tree = core.load(describe=fit.describe, check=lambda t: fit.check_fits(t, pl_module, self._where()))
        if tree is None:
            lstate.watch_new_csv(trainer)
            return
        self.restore(tree)

    def restore(self, tree: StateTree) -> None:
        """Hand a loaded tree to Lightning's own restore (the connector's loaded checkpoint: model,
        datamodule, callbacks, precision, loops, optimizers, schedulers) and keep what Lightning leaves
        out (RNGs, the epoch's accumulators, metrics) for the moment training continues."""
        core, trainer = self.core, self.trainer
        if trainer is None:
            raise RuntimeError("DriveCheckpoint: no fit is running")
        lt = tree["lightning"]
        saved = tree.get("data") or {}
        fit.position_data(core, self.data, lt, saved)
        # Lightning's own restore takes it from here: _restore_modules_and_callbacks (model,
        # datamodule, callbacks) and restore_training_state (precision, loops, optimizers, schedulers)
        # read the checkpoint the connector holds when no ckpt_path is given.
        trainer._checkpoint_connector._loaded_checkpoint = lt["checkpoint"]
        # the CSV logs go on in the run's version, as they stood at the checkpoint
        lstate.restore_csv(trainer, lt.get("loggers") or [], lambda msg, key: core.warn(msg, key=key))
        lstate.watch_new_csv(trainer)  # those the checkpoint has no entry for (an older keepalive's)
        self._validation.resumed_in = bool(lt.get("in_validation"))
        own = saved.get(OWN) or lt  # this rank's (an older checkpoint kept them with the replicated state)
        self._pending = {"rng": tree.get("rng"), **lstate.pending_state(own)}
        if lt.get("finished"):
            fit.finished_fit(core, trainer, lt)

    def _where(self) -> str:
        """The checkpoint being loaded (for a line that refuses it)."""
        return self.core.loaded_url

    def _restore_pending(self, trainer: Any) -> None:
        """Right before training continues (the first epoch start of a resumed fit, where the run
        that saved went on from its save): the RNGs, the epoch's accumulators, metrics."""
        p, self._pending = self._pending, None
        if p is None:
            return
        lstate.restore_pending(trainer, p, mid_epoch=bool(self.core.counters["batch"]))
        if p["rng"]:
            self.core.restore_rng({"rng": p["rng"]})

    # ---------------------------------------------------------------------------- loop stand-ins
    def _attach(self, trainer: Any) -> None:
        """Stand in front of the trainer's loop methods for this fit (see :mod:`._lightning_attach`): the
        boundaries where a save is exact."""
        self._stand_ins.put_back()

        def epoch_start() -> None:
            at_epoch_end = self._pending is not None and not self.core.counters["batch"]
            self._restore_pending(trainer)
            if at_epoch_end and fit.reloads_loaders(trainer, int(trainer.current_epoch)):
                # the uninterrupted fit builds this epoch's loaders now and calls iter() twice on them
                self.data.iterate_unread()
            self.core.start_epoch()

        events = LoopEvents(epoch_start=epoch_start, epoch_end=lambda: self._epoch_boundary(trainer),
                            batch_end=lambda: self._step_boundary(trainer),
                            validation_begins=lambda: self._validation_begins(trainer),
                            loaders_ready=lambda: self._install(trainer),  # Lightning calls iter() next
                            positioned=lambda: self.why_not is None)
        if not attach(trainer, self._stand_ins, events):
            self.why_not = f"Lightning {pl.__version__} builds its training data in an unknown way"

    def _install(self, trainer: Any) -> None:
        """The fit loop's training loaders are built: iterate them through :class:`data.TrainData`,
        and say now (once) if they cannot be positioned inside an epoch."""
        combined = trainer.fit_loop._combined_loader
        if combined is None:
            return
        why: Optional[str]
        if trainer.overfit_batches:
            why = "Trainer(overfit_batches=...) resamples the data: checkpoints at epoch ends only"
        else:
            why = self.data.check(list(combined.flattened))
        data.install(combined, self.data)
        self.why_not = None
        self.core.trigger.mid_epoch = True
        self.core.mid_epoch_obstacle = None
        if why is not None:
            self._cannot_position(why)

    def _cannot_position(self, why: Optional[str]) -> None:
        """The training data cannot be positioned inside an epoch: checkpoints at epoch ends, said once."""
        self.why_not = why
        self.core.trigger.mid_epoch = False
        self.core.mid_epoch_obstacle = why
        self.core.warn(str(why), key=f"lightning-data:{why}")

    # -------------------------------------------------------------------------------- boundaries
    def _step_boundary(self, trainer: Any, before_validation: bool = False) -> None:
        """After a training batch and its logging; before its validation, if it has one (called then
        by :meth:`_validation_begins`; the call after the validation makes no second boundary)."""
        core, validation = self.core, self._validation
        if not before_validation and validation.counted_before:
            validation.counted_before = False
            validation.clear()
            return
        validation.counted_before = before_validation
        epoch_loop = trainer.fit_loop.epoch_loop
        steps = int(trainer.global_step) - core.counters["step"]
        if trainer.lightning_module.automatic_optimization:
            pending = bool(epoch_loop._should_accumulate())
        else:
            pending = steps == 0  # no optimizer step in this batch: gradients may be accumulated
        if self.why_not is None and self.data.why_now() is not None:  # found out while iterating
            self._cannot_position(self.data.why_now())
        bp = epoch_loop.batch_progress
        # the last batch's boundary before its (epoch-end) validation can be saved: the resume runs the
        # validation again, then the epoch's end
        can_save = (self.why_not is None and (before_validation or not bp.is_last_batch)
                    and not trainer.should_stop)
        decision = core.advance(self.capture, steps=max(steps, 0), batch=int(bp.current.completed),
                                samples=self._batch_samples(trainer), can_save=can_save, pending=pending)
        if decision.stop:
            fit.stop(trainer, self._stand_ins)

    def _epoch_boundary(self, trainer: Any) -> None:
        """After an epoch: its validation, epoch-end hooks, epoch schedulers and epoch metrics done."""
        self._validation.counted_before = False
        self._validation.clear()
        # a resume at the epoch's last batch (saved during its validation) fetches no batch in that
        # epoch: its position must not apply to the next epoch's pass
        self.data.forget_resume()
        if self.core.stopped:
            return  # the checkpoint of the deadline stop is the run's; this partial epoch's end is not
        self.core.heartbeat.log(trainer.callback_metrics)  # the epoch's logged metrics, into the session record
        core = self.core
        decision = core.end_epoch(self.capture, last=fit.is_last_epoch(trainer),
                                  epoch=int(trainer.current_epoch))
        if decision.stop:
            fit.stop(trainer, self._stand_ins)

    def _batch_samples(self, trainer: Any) -> int:
        return self.data.take_samples()

    def _fingerprint(self) -> Tuple[Any, Any]:
        """What :meth:`capture` reads beside tensors, cheaply: the core saves during a validation only
        while this is what it was at the last boundary. The objects' state: the step and loop counters,
        the schedulers, the other callbacks' state (an ``on_validation_start`` that steps a scheduler or
        a callback that counts); the position: the training data handed out, the validation's phase."""
        trainer = self.trainer
        if trainer is None:
            return None, None
        epoch_loop = trainer.fit_loop.epoch_loop
        schedulers = tuple(state_summary(config.scheduler) for config in trainer.lr_scheduler_configs)
        callbacks = tuple(state_summary(cb) for cb in trainer.callbacks if cb is not self)
        objects = (int(trainer.global_step), epoch_loop._batches_that_stepped, schedulers, callbacks,
                   _progress(epoch_loop.batch_progress), _progress(trainer.fit_loop.epoch_progress),
                   self._validation.weights_swapped)
        streams = tuple((i, s.batches, s.samples) for i, s in sorted(self.data.streams.items()))
        return objects, (streams, self.data.samples_out, self._validation.running, self._validation.over,
                         bool(trainer.should_stop))

    # ----------------------------------------------------------------------------------- capture
    def capture(self) -> Captured:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("DriveCheckpoint: no fit is running")
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt = lstate.storable_checkpoint(ckpt, self._say_once)
        validation = self._validation  # at or during a validation of the fit: the state it started from
        lt: Dict[str, Any] = {
            "format": FORMAT, "version": pl.__version__, "checkpoint": validation.checkpoint(ckpt),
            "finished": bool(self.core.finished), "should_stop": bool(trainer.should_stop),
            "loggers": validation.loggers(trainer), "in_validation": validation.running}
        # what each rank accumulates itself (the epoch's self.log values before their sync, torchmetrics
        # states, the last logged values): with the data position, in the part the core keeps per rank
        own = validation.own(trainer)
        saved: Dict[str, Any] = {"positioned": self.why_not is None, OWN: own}
        if self.core.counters["batch"]:
            own["results"] = lstate.capture_results(trainer.fit_loop.epoch_loop._results)
            saved["loaders"] = positions = self.data.positions()  # where each training loader's pass is
            workers = self.data.workers_untold(positions)
            if workers is not None:
                lmsg.tell_worker_draws(self.core, workers)
        else:
            # where the next epoch's order starts (nothing when Lightning builds its loaders anew)
            saved["generators"] = self.data.generators_now(
                reloaded=fit.reloads_loaders(trainer, int(trainer.current_epoch) + 1))
        if int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0) > 1:
            lmsg.tell_reload_every(self.core, int(trainer.reload_dataloaders_every_n_epochs))
        persistent = self.data.persistent_draws()
        if persistent is not None:
            lmsg.tell_persistent_draws(self.core, persistent)
        return {"lightning": lt, "data": saved}

    def _say_once(self, message: str, key: str) -> None:
        """A note that is news, not a problem: said once per callback."""
        seen = self.__dict__.setdefault("_said", set())
        if key not in seen:
            seen.add(key)
            self.core.say(message)

    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``); exact at the boundaries keepalive uses, so
        prefer ``every=``. Works while a fit runs."""
        if self.trainer is None:
            raise RuntimeError("DriveCheckpoint.save() works while a fit runs (e.g. from a callback)")
        super().save(sync=sync)


def _progress(progress: Any) -> Any:
    """A loop progress's counters as a comparable value."""
    return repr(progress.state_dict())


def _check_strategy(trainer: Any) -> None:
    """Refuse, in one line saying what to use, a fit on several processes whose state keepalive cannot
    save exactly: a sharded model (FSDP, DeepSpeed, model parallel), or processes that get this
    callback pickled (``ddp_spawn``)."""
    if int(getattr(trainer, "world_size", 1)) <= 1:
        return
    strategy = trainer.strategy
    name = type(strategy).__name__
    if not isinstance(strategy, pl.strategies.DDPStrategy):
        raise RuntimeError(
            f"keepalive's Lightning DriveCheckpoint saves replicated models (strategy=\"ddp\"); {name} "
            f"shards the model over the {trainer.world_size} processes, which it cannot save yet: use "
            "strategy=\"ddp\" when the model fits on one device, or keepalive.callbacks.torch.DriveCheckpoint "
            "in a torch loop with FSDP2 (fully_shard), which saves the shards through torch.distributed.checkpoint")
    start = getattr(strategy, lc.DDP_START_METHOD, "popen")
    if start not in ("popen", "fork"):
        raise RuntimeError(
            f"keepalive's Lightning DriveCheckpoint cannot follow DDPStrategy(start_method={start!r}) "
            "(strategy=\"ddp_spawn\"): its processes train on a pickled copy of the callback, started afresh: "
            "use strategy=\"ddp\" (the script run by torchrun --nproc_per_node=N, or python script.py: "
            "Lightning starts the other processes), or strategy=\"ddp_notebook\" in a notebook")


def _settle_at_plain_step(core: Checkpointer) -> Callable[..., None]:
    """A step pre-hook: a step given no closure (AMP's ``scaler.step``, which Lightning calls after
    on_before_optimizer_step; a raw optimizer a manual ``training_step`` steps itself) settles the lazy
    snapshot at its start, as in a plain torch loop. A step with Lightning's closure runs forward and
    backward first and is settled in ``on_before_optimizer_step``. Holds the core weakly (the hook
    lives as long as the optimizer)."""
    ref = weakref.ref(core)

    def hook(_optimizer: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        target = ref()
        if target is not None and not args and kwargs.get("closure") is None:
            target.settle_snapshot()

    return hook

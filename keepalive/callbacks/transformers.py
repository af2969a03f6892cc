"""``DriveCheckpoint`` for the Hugging Face ``transformers.Trainer``: a ``TrainerCallback``.

::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DriveCheckpoint("/content/drive/MyDrive/runs/lora")])
    trainer.train()

Run the same cell again after a crash, a disconnect or a new session: ``trainer.train()`` continues
from the newest valid checkpoint as if never interrupted (no ``resume_from_checkpoint`` needed).

What is saved and restored: the model (for a PEFT model, or any model with frozen parameters, only
what trains: the adapter weights and buffers, not the frozen base), the optimizer, the LR scheduler,
the grad scaler, ``TrainerState`` (global step, epoch, log history, best metric, FLOs, tokens seen), the
Trainer's running loss sums (so the first loss logged after a resume is the one an uninterrupted run
logs), the state of stateful callbacks (``EarlyStoppingCallback``'s patience), a ``Trainer`` subclass's own
counters (TRL's ``SFTTrainer``: ``_metrics``, ``num_tokens``; :mod:`keepalive.callbacks._hf_counters`), every
RNG, and the data position: the epoch and the batch within it.

When: ``every=`` counts optimizer steps (with gradient accumulation a save never lands between two
micro-batches), or ``"epoch"`` / a duration; the session's deadline saves and stops the training
(``control.should_training_stop``; ``train()`` then raises the stop: a script's ``SystemExit(143)``).
A due save is written after the Trainer's own logging, evaluation
and checkpointing of that step and before the next step's micro-batches are fetched (the Trainer fetches
them before ``on_step_begin``), so the checkpoint holds their results and no random draw of the next step.

A signal, a preemption notice or the deadline that comes during the evaluation at an epoch's end
(``eval_strategy="epoch"``) is saved then (:mod:`keepalive.pauses`): at the next evaluation batch
(``on_prediction_step``), or from the core's guard thread when one batch runs long (the Trainer's optimizer
steps are gated). The state saved is that of the epoch's last step with the epoch end not yet counted: a
resume runs the evaluation again, once. What changed since that step (the Trainer's epoch-end log, a callback's
state) makes it wait for the next boundary, said once; so does the evaluation the Trainer runs for a step
(``eval_strategy="steps"``), which comes before that step's boundary.

Data position (:mod:`keepalive.callbacks._hf_data`):

* map-style datasets with the Trainer's default sampling (random or sequential), one process: the
  training loader's batch sampler is replaced, at the start of ``train()``, by one that yields the same
  batches in the same order and can start an epoch at any batch: a resume computes the epoch's order and
  continues at the saved batch without fetching the ones before it. Epochs completed before the restart
  are not run at all. Exact.
* random draws while batches are made (``DataCollatorForLanguageModeling``'s masking, augmentation),
  in the main process or in ``dataloader_num_workers`` workers: replayed, so the first resumed step masks
  what the uninterrupted run masked. Exact. Told: a collator with its own ``seed=`` generator.
* ``IterableDataset`` (a stream, typically with ``max_steps``; it may never end an epoch): checkpoints at
  steps too. One with ``state_dict()`` / ``load_state_dict()`` (a ``datasets.IterableDataset``, no workers)
  is saved and restored through them: exact. Any other is positioned by the Trainer's own skip, which
  reads its pass again from the start: exact when the stream yields the same items on every pass, which
  the first mid-epoch save says once.
* several processes (``torchrun``, ``accelerate launch``, ``notebook_launcher``; DDP): accelerate splits each
  epoch's batches between the ranks (``BatchSamplerShard``); the positioned sampler takes over that split (run
  by accelerate's own class over the epoch's batches) and each rank starts a resumed epoch at its batch in its
  shard. Every rank's random states and position go into one checkpoint that rank 0 commits (manifest last:
  a rank killed at any moment, mid-save included, leaves a whole checkpoint or none); all ranks decide
  together when to save. Exact. Told: ``even_batches=False`` and streams on several processes (checkpoints at
  epoch ends only).
* sentence-transformers' own batch samplers (its default, ``NO_DUPLICATES``, ``GROUP_BY_LABEL``), one process:
  run again from the generator states their epoch began with, the trained batches dropped as indices
  (:mod:`keepalive.callbacks._hf_samplers`). Exact, a one-epoch run included.
* other samplers: checkpoints at epoch ends only (said once).

The Trainer's own checkpoints (``save_strategy`` / ``save_steps``, written to ``output_dir``) are
independent of this callback: they may stay on (e.g. for ``load_best_model_at_end`` or to push to the
Hub) or be turned off (``save_strategy="no"``), which also removes their stall. Beside ``resume_from_checkpoint=``
(``True``, or the notebook guard ``get_last_checkpoint(output_dir)``) the newer checkpoint wins, said in one
line: keepalive's (as new or newer) replaces what the Trainer loaded; the Trainer's (newer, or keepalive has
none) resumes as the Trainer resumes it, keepalive counting from the state it loaded (the epoch loop starts
where the Trainer's resume starts it either way). With ``load_best_model_at_end`` the best model's trainable
weights are kept in keepalive's checkpoint: a best folder lost with a local ``output_dir`` still ends the
training with the best model. ``eval_on_start`` runs once per run, not at each resume. The plan (epochs,
steps, schedule) is stored; a longer one continues the run, a finished one too ("one more epoch").

How: the callback finds its ``Trainer`` when training begins and, for that ``train()`` call only, puts two
stand-ins on the instance: one in front of ``_run_epoch`` that skips completed epochs and hands the resumed
epoch its step counter (the same arguments the Trainer's own resume passes), and one in front of
``get_batch_samples`` where a step's boundary is acted on and a resumed pass's random states are planned.
Nothing is patched globally and no subclass is needed. Every Trainer internal this relies on is listed in
:mod:`keepalive.callbacks._compat_transformers` and checked when the callback is created: a
transformers version without one is refused then, in one line, never in the middle of a training.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..statetree import Captured, StateTree
from . import _compat_transformers as hfc
from . import _hf_messages as hfmsg
from . import _hf_restore as hfrestore
from . import _hf_resume as hfresume
from . import _hf_state as hfstate
from ._hf_best import BestModelLoader, keep_best
from ._hf_counters import SubclassCounters
from ._hf_position import DataPosition
from ._hf_resume import NO_CHECKPOINT, TrainersResume
from .torchstate import gate_steps

__all__ = ["DriveCheckpoint"]

FORMAT = hfstate.FORMAT


class DriveCheckpoint(CheckpointAdapter, TrainerCallback):
    """Checkpoint a ``transformers.Trainer`` training to a local folder, a mounted Drive or any fsspec URL.

    Pass it in ``Trainer(..., callbacks=[DriveCheckpoint(path)])`` (or ``trainer.add_callback``).
    Options: see :class:`keepalive.config.CheckpointConfig`. What is saved, when, and how the position is
    restored: see the module.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, **options: Any):
        hfc.COMPAT.check()  # every Trainer internal this adapter uses exists (else one line says which)
        cfg = CheckpointConfig.strict(path, config, options, "DriveCheckpoint")
        self.core = Checkpointer(config=cfg, framework="transformers")
        self.core.fingerprint = self._fingerprint
        self._trainer: Optional[Trainer] = None
        #: the torch optimizers whose steps wait while the core's pause guard copies the state (once each)
        self._gated: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._fetches = 0               # fetches of a step's micro-batches begun (a step under way)
        self._position = DataPosition()  # the training data's: sampler, stream, replayed random states
        self._active = False
        self._epoch = 0                 # the running epoch
        self._epochs_begun = 0          # on_epoch_begin calls in this train() call
        self._batches = 0               # batches (micro-batches) done in the running epoch
        self._batches_counted = 0       # ... of which counted by the core (samples)
        self._pending_step = False      # an optimizer step ended; its boundary is after the Trainer's logging
        self._pending_epoch: Optional[int] = None  # an epoch ended (its number); boundary at the next event
        self._resume: Optional[Dict[str, Any]] = None   # where the restored checkpoint continues
        self._rng_tree: Optional[Dict[str, Any]] = None  # RNGs to put back at the resume point
        self._finishing = False
        self._complete = False          # the run had finished before this train() call
        self._restored = False          # this train() call continues a keepalive checkpoint
        self._from_trainer: Optional[TrainersResume] = None  # the Trainer's own checkpoint won: its position
        self._put_back: List[Any] = []  # (object, attribute, value) changed for this train() call only
        #: the best model's trainable weights (load_best_model_at_end): (its Trainer folder, weights), kept
        #: in keepalive's checkpoint so the best model survives the loss of a local output_dir
        self._best: Optional[hfstate.Best] = None
        self._counters: Optional[SubclassCounters] = None  # the Trainer subclass's own (TRL's _metrics ...)

    def __repr__(self) -> str:
        return f"DriveCheckpoint({self.core.url!r})"

    # ------------------------------------------------------------------------------ train begin
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer, loop = _find_trainer(self)
        self._trainer = trainer
        core = self.core
        core.new_fit()
        self._put_back_args()
        # the Trainer loaded its own checkpoint (train(resume_from_checkpoint=...)): its epoch loop starts
        # at that checkpoint's epoch, whichever checkpoint is restored below
        own = TrainersResume.of(loop, state)
        loader = kwargs.get("train_dataloader")
        self._reset(trainer, loader)
        self._counters = SubclassCounters(trainer, core)  # noted before a checkpoint is restored
        self._position_data(args, loader)
        core.plan = hfresume.plan_of(args, state)
        self._note_settings(args, trainer)
        self._load(trainer, state, own)
        if (self._restored or own is not None) and args.eval_on_start:
            # the run evaluated when it started: its entry is in the restored log history already
            self._change(args, "eval_on_start", False)
        self._active = True
        core.total_epochs = int(state.num_train_epochs or 0) or None
        # The instance attribute comes before the class's method: this train() call only (see module)
        setattr(trainer, hfc.RUN_EPOCH, _EpochRunner(self, trainer))
        setattr(trainer, hfc.GET_BATCH_SAMPLES, _BatchFetcher(self, trainer))
        setattr(trainer, hfc.LOAD_BEST_MODEL, BestModelLoader(core, trainer, lambda: self._active, lambda: self._best))
        if self._complete:
            control.should_training_stop = True
            return
        core.check_storable(self.capture)  # a value that cannot be stored fails now
        optimizer = hfstate.inner_optimizer(trainer.optimizer)
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer not in self._gated:
            # the Trainer counts its steps itself; the gate only lets the core's pause guard save while
            # an evaluation calls no hook for long (one slow batch, a metric computation)
            self._gated.add(optimizer)
            gate_steps(core, optimizer)
        core.install_signal_handlers()

    def _note_settings(self, args: TrainingArguments, trainer: Trainer) -> None:
        """The training's settings, recorded with each checkpoint and compared with a finished unnamed run's
        (keepalive.runidentity); not while the model's training on this run ended in this process (a
        further train() call on it)."""
        settings = hfresume.settings_of(args)
        self.core.metadata["settings"] = settings
        model = trainer.model
        self.core.training_settings = lambda: None if self.core.trained_in_a_fit_here(model) else dict(settings)

    def _reset(self, trainer: Trainer, loader: Any) -> None:
        """A new ``train()`` call: nothing of the last one's position carries over."""
        self._best, self._from_trainer = None, None
        self._active, self._finishing, self._complete = False, False, False
        self._pending_step, self._pending_epoch, self._resume, self._rng_tree = False, None, None, None
        self._epoch = self._batches = self._epochs_begun = 0
        self._position = DataPosition(_length(loader), int(trainer._train_batch_size))

    def _position_data(self, args: TrainingArguments, loader: Any) -> None:
        """Position the training data, or say once why saves inside an epoch are not possible."""
        why = self._position.install(loader, args)
        self.core.trigger.mid_epoch, self.core.mid_epoch_obstacle = self._positionable, why or None
        if why:
            self.core.warn(why, key="hf-positionable")

    def _load(self, trainer: Trainer, state: TrainerState, own: Optional[TrainersResume]) -> None:
        """Restore keepalive's newest checkpoint, unless the Trainer's own (``own``) is newer: then the
        training continues from the Trainer's as the Trainer resumes it, keepalive counting from there."""
        self._epochs_begun = own.epoch if own is not None else 0  # the Trainer's loop variable starts there
        self._restored, newer = hfrestore.load(self.core, trainer, state, own, self._check_fits, self.restore)
        if not self._restored and own is not None:
            hfrestore.count_from_trainers(self.core, own, self._position, newer)
            self._from_trainer = own

    @property
    def _positionable(self) -> bool:
        return self._position.positionable

    # ---------------------------------------------------------------------------------- events
    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if not self._active:
            return
        self._put_back_args()  # read before the first epoch only (eval_on_start)
        epoch, self._epochs_begun = self._epochs_begun, self._epochs_begun + 1  # the Trainer's loop variable
        if self._resume is not None and epoch < self._resume["epoch"]:
            return  # completed before the restart: the runner skips it
        self._epoch_boundary(control)
        if self.core.stopped:
            return
        self._epoch, self._batches = epoch, 0
        self._position.epoch_fix = None
        self.core.start_epoch()
        resume = self._resume
        if resume is not None and epoch == resume["epoch"]:
            self._batches = int(resume["batch"])
        own, self._from_trainer = self._from_trainer, None
        if own is not None and epoch == own.epoch:
            self._batches = own.batches  # the Trainer skips them itself (its own resume)
        self._batches_counted = self._batches
        if resume is not None and epoch == resume["epoch"]:
            if not self._batches:
                self._put_back_rng()  # before the epoch's iterator is made (it draws a seed)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if not self._active:
            return
        # both ran before this step's batches were fetched (_BatchFetcher); left for a Trainer that
        # fetched without it
        self._put_back_rng()
        self._step_boundary(control)

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._active:
            self._batches += 1

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._active:
            self._batches += 1
            self._pending_step = True  # acted on after the Trainer's logging / evaluation / saving
            fix = self._position.epoch_fix
            if fix is not None and fix[0] == self._epoch:
                # a stream read on from its saved state: the Trainer counts this pass's batches from
                # the resume; the epoch fraction is the one the uninterrupted pass computes
                state.epoch = fix[0] + self._batches / fix[1]

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if not self._active:
            return
        self._put_back_rng()  # a resume at an epoch's very last step: the epoch-end work comes next
        self._step_boundary(control)
        if self.core.stopped:
            # stopped for the deadline inside the epoch: no epoch-end logging / evaluation / saving
            control.should_log = control.should_evaluate = control.should_save = False
            return
        steps = self._position.steps_in_epoch  # an IterableDataset's epoch has no length: it ends when it ends
        if (self._batches >= steps) if steps > 0 else not control.should_training_stop:
            self._pending_epoch = self._epoch + 1

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        if self._active and logs:  # the entry the Trainer appends to log_history, into the session record
            self.core.heartbeat.log(logs, step=state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if not self._active:
            return
        core = self.core
        try:
            if not core.stopped and not self._complete:
                self._finishing = True
                epochs = self._pending_epoch if self._pending_epoch is not None else self._epoch
                if self._pending_epoch is not None:
                    self._epoch, self._batches = epochs, 0
                self._pending_epoch = None
                self._note_counters()
                core.end_epoch(self.capture, last=True, epoch=epochs)
        finally:
            if not core.stopped:  # trained to its end, or found complete: a further train() of it is a stage
                core.fit_trained(core.plan, [self._trainer.model] if self._trainer is not None else [])
            self._active = False
            self._put_back_args()
            self._position.close()
            core.uninstall_signal_handlers()
            core.close()

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        """An evaluation batch ran (the Trainer's evaluation inside ``train()``): no boundary, a pause of the
        training loop. A signal, a preemption notice or the deadline that comes now is saved now when the
        state is still that of the last step boundary (the core checks it: :mod:`keepalive.pauses`)."""
        if not self._active:
            return  # trainer.evaluate() / predict() outside train()
        before = hfmsg.watching(self.core)
        try:
            self.core.active(self.capture)
        except BaseException:  # a signal saved here now takes effect: train() ends
            self._active = False
            raise
        if self._pending_step:
            # eval_strategy="steps": the Trainer evaluates for a step before the step's boundary (the
            # boundary is after the Trainer's work for it, so that a checkpoint holds its results)
            hfmsg.tell_eval_for_step(self.core, before, state.global_step)

    def _fingerprint(self) -> Tuple[Any, Any]:
        """What :meth:`capture` reads beside tensors, cheaply, as the core's pair (objects' state, loop
        position). The state during the evaluation at an epoch's end is the state of its last step's
        boundary (all batches done, the epoch end not counted: a resume runs the epoch-end work again);
        the evaluation the Trainer runs for a step (``eval_strategy="steps"``) comes before that step's
        boundary, and the moved ``global_step`` makes the core wait for it."""
        trainer = self._trainer
        if trainer is None:
            return None, None
        st = trainer.state
        objects = hfstate.fingerprint(trainer, self._best, DriveCheckpoint)
        position = (st.global_step, st.epoch, self._epoch, self._batches, self._fetches, self._finishing)
        return objects, position

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """The Trainer saved its own checkpoint: when it is the new best one (``load_best_model_at_end``),
        keep its weights, so that the best model outlives a lost ``output_dir`` (a VM reset)."""
        if self._active and self._trainer is not None:
            self._best = keep_best(self._trainer, args, state, self._best)

    # ------------------------------------------------------------------- this train() call's settings
    def _change(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute for this ``train()`` call only (put back by :meth:`_put_back_args`)."""
        self._put_back.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _put_back_args(self) -> None:
        while self._put_back:
            obj, name, value = self._put_back.pop()
            setattr(obj, name, value)


    # ------------------------------------------------------------------------------ boundaries
    def _step_boundary(self, control: TrainerControl) -> None:
        """The optimizer step that ended last, after the Trainer's own work for it: count, save, stop."""
        if not self._pending_step:
            return
        self._pending_step = False
        self._note_counters()
        try:
            decision = self.core.advance(self.capture, steps=1, batch=self._batches,
                                         samples=self._position.batch_size * self._batches_since_step(),
                                         can_save=self._positionable)
        except BaseException:  # an interrupt saved and now takes effect (or a failure): train() ends
            self._active = False
            raise
        if decision.stop:
            control.should_training_stop = True

    def _batches_since_step(self) -> int:
        """Batches of the optimizer step being counted (gradient accumulation: several)."""
        new = max(0, self._batches - self._batches_counted)
        self._batches_counted = self._batches
        return new

    def _epoch_boundary(self, control: TrainerControl) -> None:
        if self._pending_epoch is None:
            return
        epochs, self._pending_epoch = self._pending_epoch, None
        self._epoch, self._batches = epochs, 0
        self._note_counters()
        try:
            decision = self.core.end_epoch(self.capture, epoch=epochs)
        except BaseException:
            self._active = False
            raise
        if decision.stop:
            control.should_training_stop = True

    def _note_counters(self) -> None:
        if self._counters is not None:
            self._counters.at_boundary()

    def _put_back_rng(self) -> None:
        tree, self._rng_tree = self._rng_tree, None
        if tree is not None:
            self.core.restore_rng(tree)

    # --------------------------------------------------------------------------------- capture
    def capture(self) -> Captured:
        trainer = self._trainer
        assert trainer is not None
        objects, hf = hfstate.capture(trainer, finishing=self._finishing, best=self._best, skip=DriveCheckpoint)
        if self._counters is not None:
            hf["counters"] = self._counters.capture()
        data = self._position.capture(trainer.args, self._epoch, self._batches, finishing=self._finishing)
        if "replay" in data:  # inside an epoch: said at the first such save, what its resume cannot replay
            hfmsg.tell_inexact(self.core, trainer, self._position.stream, self._position.replay)
        return {"objects": objects, "hf": hf, "data": data}

    # --------------------------------------------------------------------------------- restore
    def _check_fits(self, tree: StateTree) -> None:
        assert self._trainer is not None
        hfrestore.check_fits(self.core, self._trainer, tree, self._position)

    def restore(self, tree: StateTree) -> None:
        """Put a loaded tree into the Trainer of this ``train()`` (:func:`~._hf_restore.put_back`)."""
        if self._trainer is None:
            raise RuntimeError("DriveCheckpoint: no train() is running")
        got = hfrestore.put_back(self.core, self._trainer, tree, self._position, self._counters, DriveCheckpoint)
        self._best, self._resume, self._rng_tree = got.best, got.resume, got.rng_tree
        self._complete = self._complete or got.complete


class _BatchFetcher:
    """Stands in for ``trainer.get_batch_samples`` (``hfc.GET_BATCH_SAMPLES``) during one ``train()`` call:
    the Trainer fetches an optimizer step's micro-batches with it before the step begins. The step that
    ended last is counted (and saved) here, after the Trainer's logging / evaluation / saving of it and
    before any random draw for the next one; a resumed pass's random states are planned here, before its
    iterator is created (:class:`_hf_data.Replay`)."""

    def __init__(self, cb: DriveCheckpoint, trainer: Trainer):
        self.cb, self.trainer = cb, trainer

    def __call__(self, epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        cb, trainer = self.cb, self.trainer
        fetch = getattr(type(trainer), hfc.GET_BATCH_SAMPLES).__get__(trainer)
        if not cb._active or getattr(trainer, hfc.GET_BATCH_SAMPLES) is not self:
            return fetch(epoch_iterator, *args, **kwargs)
        cb._step_boundary(trainer.control)
        if cb.core.stopped or trainer.control.should_training_stop:
            return [], None  # saved (deadline): no batch of the next step is made
        cb._fetches += 1  # the next step is under way: no save between steps until its boundary
        replay = cb._position.replay
        if replay is None:
            return fetch(epoch_iterator, *args, **kwargs)
        feed = replay.epoch_iterator(epoch_iterator)
        resume, cb._position.replay_resume = cb._position.replay_resume, None
        if resume is None:
            try:
                return fetch(feed, *args, **kwargs)
            finally:
                replay.fetched()
        tree = cb._rng_tree or {}
        in_plan = replay.prepare(resume["saved"], int(resume["batch"]), tree.get("rng"))
        try:
            return fetch(feed, *args, **kwargs)
        finally:
            pending = replay.plan_pending()
            replay.settled()
            if in_plan and not pending:
                cb._rng_tree = None  # put back before the first batch that was not fetched before the save
            else:
                cb._put_back_rng()   # workers make the batches: the main process continues from the step


class _EpochRunner:
    """Stands in for ``trainer._run_epoch`` (``hfc.RUN_EPOCH``) during one ``train()`` call (see the module)."""

    def __init__(self, cb: DriveCheckpoint, trainer: Trainer):
        self.cb, self.trainer = cb, trainer

    def __call__(self, **kwargs: Any) -> Any:
        cb, trainer = self.cb, self.trainer
        run = getattr(type(trainer), hfc.RUN_EPOCH).__get__(trainer)
        if not cb._active or getattr(trainer, hfc.RUN_EPOCH) is not self:
            return run(**kwargs)
        epoch = int(kwargs["epoch"])
        resume = cb._resume
        if cb._complete or cb.core.stopped or trainer.control.should_training_stop:
            return None
        if resume is not None and epoch < resume["epoch"]:
            return None  # completed before the restart
        sampler = cb._position.sampler
        if sampler is not None:
            sampler.set_epoch(epoch)
        if resume is not None and epoch == resume["epoch"] and resume["batch"]:
            done = int(resume["batch"])
            if sampler is not None:
                sampler.start = sampler.placeholders = done
            cb._position.replay_resume = {"batch": done, "saved": resume.get("replay") or {}}
            # the Trainer's own resume arguments: its step counter, epoch fraction and accumulation
            # boundaries continue at batch `done`; its SkipBatchSampler drops our placeholders (a stream
            # without a state: its skip reads the batches again)
            kwargs.update(resume_from_checkpoint=NO_CHECKPOINT, epochs_trained=epoch,
                          steps_trained_in_current_epoch=done)
            ignore = trainer.args.ignore_data_skip
            # a stream loaded from its saved state continues by itself: the Trainer must not skip
            trainer.args.ignore_data_skip = cb._position.stream == "stateful"
            if cb._position.stream == "stateful":
                cb._position.epoch_fix = (epoch, int(kwargs["steps_in_epoch"]))
            try:
                return self._run(run, **kwargs)
            finally:
                trainer.args.ignore_data_skip = ignore
                cb._resume = None
                if sampler is not None:
                    sampler.unposition()
        if resume is not None and epoch >= resume["epoch"]:
            cb._resume = None
        if cb._restored:
            # keepalive's checkpoint is in force: a Trainer checkpoint passed to train() as well must
            # not make it skip batches of this epoch
            kwargs.update(resume_from_checkpoint=None)
        return self._run(run, **kwargs)

    def _run(self, run: Any, **kwargs: Any) -> Any:
        try:
            return run(**kwargs)
        finally:
            self.cb._position.end_pass()



# ------------------------------------------------------------------------------------ helpers
def _find_trainer(cb: DriveCheckpoint) -> Tuple[Trainer, Dict[str, Any]]:
    """The Trainer whose callback handler is calling us (callbacks are given no reference to it), and
    the local variables of its training loop's frame (where its own resume starts the epoch loop)."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer) and any(c is cb for c in obj.callback_handler.callbacks):
            loop = frame.f_locals if frame.f_code.co_name == hfc.INNER_LOOP else {}
            return obj, {k: loop.get(k) for k in hfc.LOOP_LOCALS}
        frame = frame.f_back  # type: ignore[assignment]
    raise RuntimeError("keepalive's DriveCheckpoint works inside transformers.Trainer.train(); "
                       "pass it as Trainer(..., callbacks=[DriveCheckpoint(path)])")


def _length(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0

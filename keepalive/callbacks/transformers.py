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
logs), the state of stateful callbacks (``EarlyStoppingCallback``'s patience), every RNG, and the data
position: the epoch and the batch within it.

When: ``every=`` counts optimizer steps (with gradient accumulation a save never lands between two
micro-batches), or ``"epoch"`` / a duration; the session's deadline saves and stops the training cleanly
(``control.should_training_stop``). A due save is written after the Trainer's own logging, evaluation
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
  what the uninterrupted run masked. Exact. Told: a collator with its own ``seed=`` generator, batches
  that are not mappings (with workers).
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
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from .. import plan as plans
from ..adapter import CheckpointAdapter, check_fits
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..errors import StateMismatchError
from ..interrupts import signal_name
from ..state import frozen_copy  # loaded tensors are views on the file buffer: what is kept gets copies
from ..statetree import Captured, StateTree
from . import _compat_transformers as hfc
from . import _hf_data
from .torchstate import check_optimizer, gate_steps, state_summary

__all__ = ["DriveCheckpoint"]

FORMAT = 1
#: a path that is never a Trainer checkpoint: the Trainer's resume branch runs, its file loads find nothing
_NO_CHECKPOINT = os.path.join(os.sep, "nonexistent", "keepalive-positioned-resume")


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
        self._sampler: Optional[_hf_data.PositionedBatchSampler] = None
        self._stream = ""               # an IterableDataset: "stateful" / "reread" (see _hf_data.stream_kind)
        self._replay: Optional[_hf_data.Replay] = None  # the random states a mid-epoch resume replays
        self._replay_resume: Optional[Dict[str, Any]] = None  # the resumed pass's, until its first fetch
        self._epoch_fix: Optional[Any] = None  # (epoch, steps_in_epoch): state.epoch of a stream read on
        self._active = False
        self._epoch = 0                 # the running epoch
        self._epochs_begun = 0          # on_epoch_begin calls in this train() call
        self._batches = 0               # batches (micro-batches) done in the running epoch
        self._batches_counted = 0       # ... of which counted by the core (samples)
        self._batch_size = 0
        self._steps_in_epoch = 0
        self._pending_step = False      # an optimizer step ended; its boundary is after the Trainer's logging
        self._pending_epoch: Optional[int] = None  # an epoch ended (its number); boundary at the next event
        self._resume: Optional[Dict[str, Any]] = None   # where the restored checkpoint continues
        self._rng_tree: Optional[Dict[str, Any]] = None  # RNGs to put back at the resume point
        self._finishing = False
        self._complete = False          # the run had finished before this train() call
        self._restored = False          # this train() call continues a keepalive checkpoint
        self._from_trainer: Optional[_TrainersResume] = None  # the Trainer's own checkpoint won: its position
        self._put_back: List[Any] = []  # (object, attribute, value) changed for this train() call only
        #: the best model's trainable weights (load_best_model_at_end): (its Trainer folder, weights), kept
        #: in keepalive's checkpoint so the best model survives the loss of a local output_dir
        self._best: Optional[Tuple[str, Dict[str, Any]]] = None

    def __repr__(self) -> str:
        return f"DriveCheckpoint({self.core.url!r})"

    # ------------------------------------------------------------------------------ train begin
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer, loop = self._find_trainer()
        self._trainer = trainer
        core = self.core
        core.new_fit()
        self._put_back_args()
        self._best, self._from_trainer = None, None
        # the Trainer loaded its own checkpoint (train(resume_from_checkpoint=...)): its epoch loop starts
        # at that checkpoint's epoch, whichever checkpoint is restored below
        own = _TrainersResume.of(loop, state)
        self._active, self._finishing, self._complete = False, False, False
        self._pending_step, self._pending_epoch, self._resume, self._rng_tree = False, None, None, None
        self._epoch = self._batches = self._epochs_begun = 0
        loader = kwargs.get("train_dataloader")
        self._steps_in_epoch = _length(loader)
        self._batch_size = int(trainer._train_batch_size)
        self._stream, self._replay, self._replay_resume, self._epoch_fix = "", None, None, None
        self._sampler, why = _hf_data.install(loader, int(args.data_seed if args.data_seed is not None
                                                          else args.seed))
        if why == "iterable" and args.world_size > 1:
            # accelerate shards or dispatches a stream across the processes; neither is positioned
            why = ("a stream (IterableDataset) on several processes: keepalive checkpoints it at epoch ends "
                   "only; a map-style dataset is checkpointed inside epochs too")
        elif why == "iterable":  # a stream: positioned by its state_dict() or read again (see _hf_data)
            self._stream, why = _hf_data.stream_kind(loader), ""
        if not why:
            self._replay = _hf_data.Replay(_hf_data.base_loader(loader), self._sampler,
                                           stateful_stream=self._stream == "stateful",
                                           accumulation=int(args.gradient_accumulation_steps))
        core.trigger.mid_epoch, core.mid_epoch_obstacle = self._positionable, why or None
        if why:
            core.warn(why, key="hf-positionable")
        core.plan = _plan(args, state)
        newer: List[int] = []  # the step of keepalive's checkpoint the Trainer's own is newer than

        def check(tree: StateTree) -> None:
            saved_step = _saved_step(tree)
            if own is not None and own.step > saved_step:
                newer.append(saved_step)
                raise _TrainersIsNewer()
            self._check_fits(tree)

        self._epochs_begun = own.epoch if own is not None else 0  # the Trainer's loop variable starts there
        try:
            tree = core.load(describe=self._describe, check=check)  # may refuse: nothing changed
        except _TrainersIsNewer:
            tree = None
        self._restored = tree is not None
        if tree is not None:
            self._tell_plan(state)
            self.restore(tree)
            if own is not None:
                self._replace_trainers_resume(trainer, own, tree)
        elif own is not None:
            self._continue_trainers_resume(own, newer[0] if newer else None)
        if (tree is not None or own is not None) and args.eval_on_start:
            # the run evaluated when it started: its entry is in the restored log history already
            self._change(args, "eval_on_start", False)
        self._active = True
        core.total_epochs = int(state.num_train_epochs or 0) or None
        # The instance attribute comes before the class's method: this train() call only (see module)
        setattr(trainer, hfc.RUN_EPOCH, _EpochRunner(self, trainer))
        setattr(trainer, hfc.GET_BATCH_SAMPLES, _BatchFetcher(self, trainer))
        setattr(trainer, hfc.LOAD_BEST_MODEL, _BestModelLoader(self, trainer))
        if self._complete:
            control.should_training_stop = True
            return
        core.check_storable(self.capture)  # a value that cannot be stored fails now
        optimizer = _inner_optimizer(trainer.optimizer)
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer not in self._gated:
            # the Trainer counts its steps itself; the gate only lets the core's pause guard save while
            # an evaluation calls no hook for long (one slow batch, a metric computation)
            self._gated.add(optimizer)
            gate_steps(core, optimizer)
        core.install_signal_handlers()

    @property
    def _positionable(self) -> bool:
        return self._sampler is not None or bool(self._stream)

    def _find_trainer(self) -> Tuple[Trainer, Dict[str, Any]]:
        """The Trainer whose callback handler is calling us (callbacks are given no reference to it), and
        the local variables of its training loop's frame (where its own resume starts the epoch loop)."""
        frame = sys._getframe(1)
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer) and any(cb is self for cb in obj.callback_handler.callbacks):
                loop = frame.f_locals if frame.f_code.co_name == hfc.INNER_LOOP else {}
                return obj, {k: loop.get(k) for k in hfc.LOOP_LOCALS}
            frame = frame.f_back  # type: ignore[assignment]
        raise RuntimeError("keepalive's DriveCheckpoint works inside transformers.Trainer.train(); "
                           "pass it as Trainer(..., callbacks=[DriveCheckpoint(path)])")

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
        self._epoch_fix = None
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
            fix = self._epoch_fix
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
        known = self._steps_in_epoch > 0  # an IterableDataset's epoch has no length: it ends when it ends
        if (self._batches >= self._steps_in_epoch) if known else not control.should_training_stop:
            self._pending_epoch = self._epoch + 1

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
                core.end_epoch(self.capture, last=True, epoch=epochs)
        finally:
            self._active = False
            self._put_back_args()
            if self._replay is not None:
                self._replay.end_pass()
            core.uninstall_signal_handlers()
            core.close()

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        """An evaluation batch ran (the Trainer's evaluation inside ``train()``): no boundary, a pause of the
        training loop. A signal, a preemption notice or the deadline that comes now is saved now when the
        state is still that of the last step boundary (the core checks it: :mod:`keepalive.pauses`)."""
        if not self._active:
            return  # trainer.evaluate() / predict() outside train()
        core = self.core
        deadline, notice = core.trigger.deadline_hit, core.trigger.notice_hit
        try:
            core.active(self.capture)
        except BaseException:  # a signal saved here now takes effect: train() ends
            self._active = False
            raise
        signum = core.signals.peek()
        came = (signal_name(signum) if signum is not None else "a preemption notice"
                if core.trigger.notice_hit is not notice else "the deadline"
                if core.trigger.deadline_hit != deadline else None)
        if self._pending_step and came:
            # eval_strategy="steps": the Trainer evaluates for a step before the step's boundary (the
            # boundary is after the Trainer's work for it, so that a checkpoint holds its results)
            core.warn(f"{came} came during the evaluation the Trainer runs for step {state.global_step} "
                      "(eval_strategy=\"steps\"), before keepalive's boundary of that step: the save waits for the "
                      "evaluation's end. During an evaluation at an epoch's end (eval_strategy=\"epoch\") keepalive "
                      "saves at once", key="hf-eval-steps")

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
        objects = (state_summary(trainer.lr_scheduler), len(st.log_history), st.best_metric, st.best_global_step,
                   st.best_model_checkpoint,
                   st.total_flos, st.num_input_tokens_seen, float(trainer._total_loss_scalar),
                   int(trainer._globalstep_last_logged), float(trainer.current_flos),
                   repr(_callback_states(trainer)), self._best[0] if self._best is not None else None)
        position = (st.global_step, st.epoch, self._epoch, self._batches, self._fetches, self._finishing)
        return objects, position

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """The Trainer saved its own checkpoint: when it is the new best one (``load_best_model_at_end``),
        keep its weights, so that the best model outlives a lost ``output_dir`` (a VM reset)."""
        trainer = self._trainer
        if not self._active or trainer is None or not args.load_best_model_at_end:
            return
        best = state.best_model_checkpoint
        if best and state.best_global_step == state.global_step and (self._best is None or self._best[0] != best):
            self._best = (best, {k: v.detach().to("cpu", copy=True)
                                 for k, v in self._model_state(_model(trainer)).items()})

    # ------------------------------------------------------------------------- the Trainer's resume
    def _replace_trainers_resume(self, trainer: Trainer, own: "_TrainersResume", tree: StateTree) -> None:
        """keepalive's checkpoint is as new as the Trainer's own, or newer: it replaced what the Trainer
        loaded (model, optimizer, schedule, TrainerState, callbacks); the run's totals are kept whole."""
        step = _saved_step(tree)
        # as in a resume of keepalive's alone: the loss average and the token rate cover the whole run
        trainer._initial_global_step = 0
        trainer._initial_num_input_tokens_seen = 0
        self.core.say(f"the Trainer's own checkpoint {own.path} (step {own.step}) is not newer than keepalive's "
                      f"(step {step}): keepalive's is restored (weights, optimizer, schedule, data position, "
                      "random states) and the Trainer's is not used.")

    def _continue_trainers_resume(self, own: "_TrainersResume", keepalives: Optional[int]) -> None:
        """The Trainer resumed from its own checkpoint and keepalive's is older (or absent): the training
        continues from the Trainer's as the Trainer resumes it; keepalive counts (and saves) from there."""
        core, c = self.core, self.core.counters
        c["epoch"], c["step"], c["batch"] = own.epoch, own.step, own.batches
        c["samples"] = self._batch_size * (own.epoch * self._steps_in_epoch + own.batches)
        self._from_trainer = own
        if keepalives is None:
            core.say(f"continuing from the Trainer's own checkpoint {own.path} (epoch {own.epoch}, step "
                     f"{own.step}); keepalive checkpoints from there.")
            return
        core.warn(f"the Trainer's own checkpoint {own.path} (step {own.step}) is newer than keepalive's newest "
                  f"(step {keepalives}): training continues from the Trainer's, as the Trainer resumes it (its "
                  "checkpoint has no running loss sum: the first loss logged may differ from an uninterrupted "
                  "run's), and keepalive checkpoints from there. For keepalive's exact resume, leave "
                  "resume_from_checkpoint out.", key="hf-own-resume")

    def _change(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute for this ``train()`` call only (put back by :meth:`_put_back_args`)."""
        self._put_back.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _put_back_args(self) -> None:
        while self._put_back:
            obj, name, value = self._put_back.pop()
            setattr(obj, name, value)

    def _tell_plan(self, state: TrainerState) -> None:
        """Say once what changed in the plan since the checkpoint (its epochs, steps, learning rate,
        schedule) and what happens."""
        core = self.core
        found = plans.changes(core.saved_plan, core.plan)
        if not found:
            return
        done = int(core.counters["step"])
        length = [k for k, _, _ in found if k in ("epochs", "max_steps")]
        lines = [f"the training's plan changed since the checkpoint ({plans.describe(found)})."]
        if length:
            total = int(state.max_steps)
            if done >= total:
                lines.append(f"The checkpoint has trained {done} steps, not fewer than the {total} of this plan: "
                             "nothing more is trained and its state is restored.")
            else:
                lines.append(f"Training continues from step {done} to step {total} with the schedule this code "
                             f"builds ({core.plan.get('scheduler')} over {total} steps), so the learning rates "
                             "from there on are the new plan's.")
        if any(k not in ("epochs", "max_steps") for k, _, _ in found):
            lines.append("The checkpoint's optimizer and scheduler state wins for the learning rate, warmup and "
                         "scheduler settings (restored as saved); to train with the new ones, use another run "
                         "(path or run=).")
        core.warn(" ".join(lines), key="hf-plan")

    # ------------------------------------------------------------------------------ boundaries
    def _step_boundary(self, control: TrainerControl) -> None:
        """The optimizer step that ended last, after the Trainer's own work for it: count, save, stop."""
        if not self._pending_step:
            return
        self._pending_step = False
        try:
            decision = self.core.advance(self.capture, steps=1, batch=self._batches,
                                         samples=self._batch_size * self._batches_since_step(),
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
        try:
            decision = self.core.end_epoch(self.capture, epoch=epochs)
        except BaseException:
            self._active = False
            raise
        if decision.stop:
            control.should_training_stop = True

    def _put_back_rng(self) -> None:
        tree, self._rng_tree = self._rng_tree, None
        if tree is not None:
            self.core.restore_rng(tree)

    # --------------------------------------------------------------------------------- capture
    def _model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        """What trains: with frozen parameters (PEFT / LoRA, a frozen backbone), only the rest."""
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in model.state_dict().items() if k not in frozen}

    def _objects(self, trainer: Trainer) -> Dict[str, Any]:
        objects: Dict[str, Any] = {"model": trainer.model, "optimizer": trainer.optimizer}
        if trainer.lr_scheduler is not None and hasattr(trainer.lr_scheduler, "state_dict"):
            objects["scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        return objects

    def capture(self) -> Captured:
        trainer = self._trainer
        assert trainer is not None
        objects = {name: (self._model_state(obj) if name == "model" else obj.state_dict())
                   for name, obj in self._objects(trainer).items()}
        st = trainer.state
        hf = {
            "format": FORMAT,
            "state": {name: getattr(st, name) for name in hfc.STATE_FIELDS},
            "trainer": {"tr_loss": trainer._tr_loss.detach(),
                        "total_loss_scalar": float(trainer._total_loss_scalar),
                        "globalstep_last_logged": int(trainer._globalstep_last_logged),
                        "current_flos": float(trainer.current_flos)},
            "callbacks": _callback_states(trainer),
            "classes": {"model": type(trainer.model).__name__},
            "finished": self._finishing,
        }
        if self._best is not None:
            hf["best"] = {"path": self._best[0], "model": self._best[1]}
        data: Dict[str, Any] = {"epoch": self._epoch, "batch": self._batches, "steps_in_epoch": self._steps_in_epoch,
                "batch_size": self._batch_size,
                "gradient_accumulation_steps": int(trainer.args.gradient_accumulation_steps),
                "processes": int(trainer.args.world_size),  # each rank's place is in its shard of the batches
                "order": None if self._sampler is None else [self._sampler.kind, self._sampler.seed],
                "stream": self._stream}
        if self._replay is not None and self._batches and not self._finishing:
            data["replay"] = self._replay.capture(self._batches)
            self._tell_inexact(trainer)
        return {"objects": objects, "hf": hf, "data": data}

    def _tell_inexact(self, trainer: Trainer) -> None:
        """At the first mid-epoch save: what a resume from it cannot replay exactly (once each)."""
        core, replay = self.core, self._replay
        if self._stream == "reread":
            name = type(_hf_data.base_loader(trainer.callback_handler.train_dataloader).dataset).__name__
            core.warn(f"the training data is an IterableDataset ({name}) without state_dict(): a resume reads "
                      "its pass again from the start and drops the batches already trained (the Trainer's own "
                      "skip), which is exact only if the stream yields the same items in the same order on "
                      "every pass. Give it state_dict()/load_state_dict() (e.g. a datasets.IterableDataset) "
                      "to continue where it stopped", key="hf-stream")
        collator: Any = getattr(trainer.data_collator, "data_collator", trainer.data_collator)  # columns remover
        if getattr(collator, "seed", None) is not None:  # DataCollatorForLanguageModeling(seed=...)
            core.warn(f"the data collator {type(collator).__name__} draws from its own generator (seed="
                      f"{collator.seed}), which keepalive does not save: after a mid-epoch resume its draws "
                      "differ from the uninterrupted run's. Leave seed= unset (the Trainer's seed then "
                      "decides, and keepalive replays it)", key="hf-collator")
        if replay is not None and replay.deep_ahead:
            core.warn("the training loader fetched more than one batch ahead of a save: a resume replays the "
                      "random state of one, so random draws of the others (augmentation, masking) differ from "
                      "the uninterrupted run's", key="hf-ahead")
        if replay is not None and replay.unstamped:
            core.warn("the training batches are not mappings, so the random state of the loader's worker "
                      "processes cannot travel with them: after a mid-epoch resume, random draws in workers "
                      "(augmentation, masking) differ from the uninterrupted run's", key="hf-workers")

    # --------------------------------------------------------------------------------- restore
    def _describe(self, tree: StateTree) -> str:
        data = tree.get("data") or {}
        if data.get("batch") and not (tree.get("hf") or {}).get("finished"):
            return f"epoch {data['epoch']} continues at batch {data['batch']}/{data.get('steps_in_epoch')}"
        return ""

    def _check_fits(self, tree: StateTree) -> None:
        trainer = self._trainer
        assert trainer is not None
        where = self.core.resumed_from.url if self.core.resumed_from else self.core.url
        saved = tree.get("objects") or {}
        was = ((tree.get("hf") or {}).get("classes") or {}).get("model")
        if was is not None and was != type(trainer.model).__name__:
            raise StateMismatchError(f"model: the checkpoint {where} holds a {was}, this Trainer trains a "
                                     f"{type(trainer.model).__name__}. Nothing was loaded. Use another run "
                                     "(path or run=) for another model.")
        check_fits("model", self._model_state(_model(trainer)), saved.get("model", {}), where=where,
                   lacks="the model (or its trainable part, e.g. the LoRA adapters) differs")
        check_optimizer("optimizer", _inner_optimizer(trainer.optimizer), saved.get("optimizer", {}))
        data = tree.get("data") or {}
        if data.get("batch"):
            saved_world, world = int(data.get("processes") or 1), int(trainer.args.world_size)
            if saved_world != world:
                raise StateMismatchError(
                    f"the checkpoint {where} is inside epoch {data['epoch']} of a training on {saved_world} "
                    f"process(es), where each one's batches are its shard of the epoch; this one runs on {world}. "
                    f"Nothing was loaded. Launch it on {saved_world} process(es) to continue the run, or start a "
                    "new run (path or run=).")
            now = (self._batch_size, int(trainer.args.gradient_accumulation_steps), self._steps_in_epoch)
            then = (data.get("batch_size"), data.get("gradient_accumulation_steps"), data.get("steps_in_epoch"))
            if now != then:
                raise StateMismatchError(
                    f"the checkpoint {where} is inside epoch {data['epoch']} of a training with batch size, "
                    f"gradient accumulation and batches per epoch {then}; this one has {now}. Nothing was "
                    "loaded. Keep the settings to continue the run, or start a new run (path or run=).")
            if not self._positionable:
                raise StateMismatchError(
                    f"the checkpoint {where} is inside epoch {data['epoch']}, but this training's data cannot "
                    f"be positioned ({self.core.mid_epoch_obstacle}). Nothing was loaded.")

    def restore(self, tree: StateTree) -> None:
        """Put a loaded tree into the Trainer of this ``train()``: model (its trainable part),
        optimizer, scheduler, scaler, ``TrainerState``, running loss sums, callbacks, data position."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("DriveCheckpoint: no train() is running")
        state = trainer.state
        objects = tree.get("objects") or {}
        live = self._objects(trainer)
        device = trainer.args.device
        model = _model(trainer)
        saved_model = {k: v.to(device=_device_of(model, k), copy=True) for k, v in objects["model"].items()}
        missing = model.load_state_dict(saved_model, strict=False)
        if missing.unexpected_keys:
            raise StateMismatchError(f"model: unexpected keys {missing.unexpected_keys[:3]} in the checkpoint")
        for name in ("optimizer", "scheduler", "scaler"):
            if name in live and name in objects:
                live[name].load_state_dict(frozen_copy(objects[name]))
        hf = tree.get("hf") or {}
        for name, value in (hf.get("state") or {}).items():
            if name in hfc.STATE_FIELDS:
                setattr(state, name, frozen_copy(value))
        acc = hf.get("trainer") or {}
        if "tr_loss" in acc:
            trainer._tr_loss = acc["tr_loss"].to(device=device, copy=True)
            trainer._total_loss_scalar = float(acc["total_loss_scalar"])
            trainer._globalstep_last_logged = int(acc["globalstep_last_logged"])
            trainer.current_flos = float(acc["current_flos"])  # type: ignore[assignment]
        _restore_callback_states(trainer, hf.get("callbacks") or {})
        best = hf.get("best")
        self._best = (best["path"], frozen_copy(best["model"])) if best else None
        data = tree.get("data") or {}
        if data.get("order") and self._sampler is not None:
            self._sampler.kind, self._sampler.seed = data["order"][0], int(data["order"][1])
        if hf.get("finished") and state.global_step < state.max_steps and plans.changes(
                self.core.saved_plan, self.core.plan, keys=("epochs", "max_steps")):
            # a longer plan than the finished run's ("one more epoch"): continue from its final state, as
            # the Trainer continues its own end-of-training checkpoint; the loss the Trainer's summary
            # added at the end is not counted twice
            trainer._total_loss_scalar -= float(trainer._tr_loss.item())
            # a longer run logs one summary, at its end
            state.log_history = [e for e in state.log_history if "train_runtime" not in e]
        elif hf.get("finished"):
            self._complete = True
            self.core.already_complete(message=f"run '{self.core.store.run}' already completed (global step "
                                               f"{state.global_step}); its final state is restored and "
                                               "nothing is trained. To train again, use another run "
                                               "(path or run=).")
            return
        self._resume = {"epoch": int(data.get("epoch", 0)), "batch": int(data.get("batch", 0)),
                        "replay": data.get("replay") or {}}
        self._rng_tree = {"rng": tree.get("rng")}  # only the RNGs: the tensors are loaded already


class _TrainersIsNewer(Exception):
    """Raised by the load check: the Trainer's own checkpoint is newer than keepalive's (nothing loaded)."""


class _TrainersResume(NamedTuple):
    """Where the Trainer's own resume (``train(resume_from_checkpoint=...)``) starts its epoch loop."""

    path: str
    step: int     # its global step
    epoch: int    # epochs completed: the loop's first epoch
    batches: int  # batches of that epoch the Trainer skips

    @staticmethod
    def of(loop: Mapping[str, Any], state: TrainerState) -> Optional["_TrainersResume"]:
        """From the training loop's local variables, when the Trainer loaded its own ``TrainerState``."""
        path = loop.get("resume_from_checkpoint")
        if not isinstance(path, str) or path == _NO_CHECKPOINT or not state.global_step:
            return None
        return _TrainersResume(path, int(state.global_step), int(loop.get("epochs_trained") or 0),
                               int(loop.get("steps_trained_in_current_epoch") or 0))


class _BestModelLoader:
    """Stands in for ``trainer._load_best_model`` (``hfc.LOAD_BEST_MODEL``) during one ``train()`` call: when
    the best checkpoint's folder is gone (a local ``output_dir`` lost with the VM), the best weights come
    from keepalive's checkpoint, or the user reads that the run ends with the last model."""

    def __init__(self, cb: DriveCheckpoint, trainer: Trainer):
        self.cb, self.trainer = cb, trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cb, trainer = self.cb, self.trainer
        load = getattr(type(trainer), hfc.LOAD_BEST_MODEL).__get__(trainer)
        path = trainer.state.best_model_checkpoint
        if (not cb._active or getattr(trainer, hfc.LOAD_BEST_MODEL) is not self or not path
                or os.path.isdir(path)):
            return load(*args, **kwargs)
        state = trainer.state
        held = cb._best
        if held is not None and held[0] == path:
            model = _model(trainer)
            model.load_state_dict({k: v.to(device=_device_of(model, k), copy=True) for k, v in held[1].items()},
                                  strict=False)
            cb.core.say(f"loaded the best model (step {state.best_global_step}, "
                        f"{trainer.args.metric_for_best_model} {state.best_metric}) from keepalive's checkpoint: "
                        f"the Trainer's folder {path} no longer exists.")
            return None
        cb.core.warn(f"the best model's folder {path} no longer exists (a local output_dir is lost with the VM) "
                     "and keepalive's checkpoint does not hold its weights: the training ends with the last "
                     "model, not the best one. Put output_dir on persistent storage (e.g. Drive) to keep it.",
                     key="hf-best-lost")
        return None


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
        replay = cb._replay
        if replay is None:
            return fetch(epoch_iterator, *args, **kwargs)
        feed = replay.epoch_iterator(epoch_iterator)
        resume, cb._replay_resume = cb._replay_resume, None
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
        sampler = cb._sampler
        if sampler is not None:
            sampler.set_epoch(epoch)
        if resume is not None and epoch == resume["epoch"] and resume["batch"]:
            done = int(resume["batch"])
            if sampler is not None:
                sampler.start = sampler.placeholders = done
            cb._replay_resume = {"batch": done, "saved": resume.get("replay") or {}}
            # the Trainer's own resume arguments: its step counter, epoch fraction and accumulation
            # boundaries continue at batch `done`; its SkipBatchSampler drops our placeholders (a stream
            # without a state: its skip reads the batches again)
            kwargs.update(resume_from_checkpoint=_NO_CHECKPOINT, epochs_trained=epoch,
                          steps_trained_in_current_epoch=done)
            ignore = trainer.args.ignore_data_skip
            # a stream loaded from its saved state continues by itself: the Trainer must not skip
            trainer.args.ignore_data_skip = cb._stream == "stateful"
            if cb._stream == "stateful":
                cb._epoch_fix = (epoch, int(kwargs["steps_in_epoch"]))
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
            if self.cb._replay is not None:
                self.cb._replay.end_pass()


# ------------------------------------------------------------------------------------ helpers
def _plan(args: TrainingArguments, state: TrainerState) -> Dict[str, Any]:
    """What the code asks for: the training's length and its learning-rate schedule."""
    return {"epochs": int(state.num_train_epochs or 0), "max_steps": int(state.max_steps or 0),
            "scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "learning_rate": plans.plain(args.learning_rate), "warmup_steps": plans.plain(args.warmup_steps)}


def _saved_step(tree: StateTree) -> int:
    counters: Mapping[str, Any] = tree.get("counters") or {}
    return int(counters.get("step", 0))


def _length(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0


def _model(trainer: Trainer) -> torch.nn.Module:
    if trainer.model is None:
        raise RuntimeError("the Trainer has no model")
    return trainer.model


def _inner_optimizer(opt: Any) -> torch.optim.Optimizer:
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one


def _device_of(model: torch.nn.Module, key: str) -> Any:
    try:
        return model.get_parameter(key).device
    except (AttributeError, TypeError):
        try:
            return model.get_buffer(key).device
        except (AttributeError, TypeError):
            return next(model.parameters()).device


def _exportable(trainer: Trainer) -> List[Any]:
    return [cb for cb in trainer.callback_handler.callbacks
            if isinstance(cb, ExportableState) and not isinstance(cb, DriveCheckpoint)]


def _callback_states(trainer: Trainer) -> Dict[str, Any]:
    """Stateful callbacks' attributes (EarlyStoppingCallback's patience counter, ...), by class and rank."""
    out: Dict[str, Any] = {}
    for cb in _exportable(trainer):
        name = type(cb).__name__
        out.setdefault(name, []).append(dict((cb.state() or {}).get("attributes") or {}))
    return out


def _restore_callback_states(trainer: Trainer, saved: Dict[str, Any]) -> None:
    ranks: Dict[str, int] = {}
    for cb in _exportable(trainer):
        name = type(cb).__name__
        i = ranks[name] = ranks.get(name, -1) + 1
        states = saved.get(name) or []
        if i < len(states):
            for attr, value in states[i].items():
                setattr(cb, attr, frozen_copy(value))

"""The ``transformers`` / ``accelerate`` / ``torch`` internals the Hugging Face adapter relies on
(``transformers.py``, ``_hf_data.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with transformers 5.23.0 and accelerate 1.15.0. The range starts at transformers 5.3, the first
release whose ``Trainer`` runs an epoch in its own ``_run_epoch`` method with the resume arguments the
adapter passes; ``_tr_loss`` and the running loss sums appeared with it. accelerate's sampler, loader
wrapper and scaler attributes are the same in every 1.x release.
"""
from __future__ import annotations

import importlib
import re

from transformers import Trainer

from . import _hf_data
from ._compat import Framework, Internal, Package, code_names, field, has, local, param, uses

__all__ = ["COMPAT", "INTERNALS", "RUN_EPOCH", "GET_BATCH_SAMPLES", "LOAD_BEST_MODEL", "INNER_LOOP", "LOOP_LOCALS",
           "STATE_FIELDS"]

#: the Trainer method that runs one epoch: replaced on the instance for one ``train()`` call
RUN_EPOCH = "_run_epoch"
#: the Trainer method that fetches one optimizer step's micro-batches: replaced likewise
GET_BATCH_SAMPLES = "get_batch_samples"
#: the Trainer method that loads the best checkpoint at the end (load_best_model_at_end): replaced likewise
LOAD_BEST_MODEL = "_load_best_model"
#: the Trainer's training loop, and its local variables that say where its own resume starts the epoch loop
INNER_LOOP = "_inner_training_loop"
LOOP_LOCALS = ("resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch")
#: TrainerState fields that are training progress (the others are settings the Trainer recomputes)
STATE_FIELDS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
                "best_global_step", "best_model_checkpoint", "trial_name", "trial_params")


def _calls_run_epoch_with_keywords() -> bool:
    """``_inner_training_loop`` calls ``self._run_epoch(epoch=..., ...)`` (the runner reads ``epoch``)."""
    import inspect

    loop = Trainer._inner_training_loop
    try:
        source = inspect.getsource(loop)
    except (OSError, TypeError):  # no source shipped: the name at least
        return RUN_EPOCH in code_names(loop)
    return re.search(r"self\." + RUN_EPOCH + r"\(\s*(?:\w+=[^,]*,\s*)*epoch=", source) is not None


def _calls_get_batch_samples() -> bool:
    """``_run_epoch`` fetches with ``self.get_batch_samples(epoch_iterator, ...)`` (the fetcher's first argument)."""
    import inspect

    run = getattr(Trainer, RUN_EPOCH)
    try:
        source = inspect.getsource(run)
    except (OSError, TypeError):
        return GET_BATCH_SAMPLES in code_names(run)
    return re.search(r"self\." + GET_BATCH_SAMPLES + r"\(\s*epoch_iterator\b", source) is not None


def _skip_keeps_wrappers() -> bool:
    kwargs = getattr(importlib.import_module("accelerate.data_loader"), "_PYTORCH_DATALOADER_KWARGS", {})
    return "collate_fn" in kwargs


def _inner_loop_named() -> bool:
    """The Trainer's training loop is the function of that name (not an alias of another)."""
    return INNER_LOOP == Trainer._inner_training_loop.__name__


_TRAINER = "transformers:Trainer"
_LOOP = f"{_TRAINER}.{INNER_LOOP}"
_LOADERS = "accelerate.data_loader"
_HANDLER = "transformers.trainer_callback:CallbackHandler"
_T, _HS = "transformers.py", "_hf_state.py"

#: the internals, as a table: name, what the adapter does with it, where, the check
INTERNALS = (
    Internal("Trainer._inner_training_loop local 'self'", "the frame the callback walks up to at "
             "on_train_begin to find its Trainer (callbacks get no reference to it)",
             f"{_T}: DriveCheckpoint._find_trainer", (local(_LOOP, "self"), uses(_LOOP, "on_train_begin")),
             token='f_locals.get("self")'),
    Internal(f"Trainer.{INNER_LOOP} locals {', '.join(LOOP_LOCALS)}", "where the Trainer's own resume "
             "(train(resume_from_checkpoint=...)) starts its epoch loop, read at on_train_begin",
             f"{_T}: DriveCheckpoint._find_trainer, _TrainersResume", (_inner_loop_named, local(_LOOP, *LOOP_LOCALS)),
             token="LOOP_LOCALS"),
    Internal(f"Trainer.{LOAD_BEST_MODEL}", "replaced on the instance for one train() call: the best model "
             "comes from keepalive's checkpoint when its folder is gone", "_hf_best.py: BestModelLoader",
             (has(_TRAINER, LOAD_BEST_MODEL), uses(f"{_TRAINER}._finalize_training", LOAD_BEST_MODEL)),
             token="LOAD_BEST_MODEL"),
    Internal("Trainer._initial_global_step / _initial_num_input_tokens_seen", "set to a whole run's when "
             "keepalive's checkpoint replaces the Trainer's own resume",
             "_hf_restore.py: load",
             uses(_TRAINER, "_initial_global_step", "_initial_num_input_tokens_seen"), token="_initial_global_step"),
    Internal("CallbackHandler.callbacks", "the callback list the found Trainer must hold this callback in",
             f"{_T}: DriveCheckpoint._find_trainer, _exportable", uses(_HANDLER, "callbacks"),
             token="callback_handler.callbacks"),
    Internal("CallbackHandler.train_dataloader", "passed to on_train_begin as train_dataloader=: the "
             "loader whose batch sampler is replaced", f"{_T}: DriveCheckpoint.on_train_begin",
             uses(f"{_HANDLER}.call_event", "train_dataloader"), token='"train_dataloader"'),
    Internal("Trainer._train_batch_size", "the per-step batch size (samples counter, resume check)",
             f"{_T}: DriveCheckpoint.on_train_begin", uses(_TRAINER, "_train_batch_size")),
    Internal(f"Trainer.{RUN_EPOCH}", "replaced on the instance for one train() call: skips completed "
             "epochs, starts the resumed one at its batch", f"{_T}: DriveCheckpoint.on_train_begin, "
             "_EpochRunner", has(_TRAINER, RUN_EPOCH), token="RUN_EPOCH"),
    Internal(f"Trainer._inner_training_loop calls {RUN_EPOCH}(epoch=...)", "the runner reads the epoch "
             "from the keyword arguments", f"{_T}: _EpochRunner.__call__", _calls_run_epoch_with_keywords,
             token='kwargs["epoch"]'),
    Internal(f"Trainer.{RUN_EPOCH}(skip_first_batches)", "a resumed epoch's first batches are dropped by "
             "accelerate's skip_first_batches (the positioned sampler yields placeholders for them)",
             f"{_T}: _EpochRunner.__call__", uses(f"{_TRAINER}.{RUN_EPOCH}", "skip_first_batches"),
             token="SkipBatchSampler"),
    Internal(f"Trainer.{GET_BATCH_SAMPLES}", "replaced on the instance for one train() call: the step "
             "that ended is saved before the next step's batches are made; a resumed pass's random "
             "states are planned before its iterator is created", f"{_T}: _BatchFetcher",
             has(_TRAINER, GET_BATCH_SAMPLES), token="GET_BATCH_SAMPLES"),
    Internal(f"Trainer.{RUN_EPOCH} calls {GET_BATCH_SAMPLES}(epoch_iterator, ...)", "the fetcher reads the "
             "epoch iterator as the first argument", f"{_T}: _BatchFetcher.__call__",
             _calls_get_batch_samples, token="epoch_iterator"),
    Internal("accelerate.data_loader.skip_first_batches keeps collate_fn and the dataset", "a resumed "
             "pass's loader is rebuilt by accelerate from the loader's attributes: keepalive's wrappers "
             "of the collator and of the dataset the workers see must be among them", "_hf_data.py: Replay",
             _skip_keeps_wrappers, token="base.collate_fn = self.collate", package="accelerate"),
    Internal("Trainer._tr_loss", "the running loss sum since the last log (saved, restored)",
             f"{_HS}: capture, restore_trainer", uses(_TRAINER, "_tr_loss")),
    Internal("Trainer._total_loss_scalar", "the loss sum of the whole training (saved, restored)",
             f"{_HS}: capture, restore_trainer", uses(_TRAINER, "_total_loss_scalar")),
    Internal("Trainer._globalstep_last_logged", "the step of the last log (saved, restored)",
             f"{_HS}: capture, restore_trainer", uses(_TRAINER, "_globalstep_last_logged")),
    Internal("accelerate.Accelerator.scaler", "the GradScaler of a mixed-precision run (saved, restored)",
             f"{_HS}: trainer_objects", uses("accelerate:Accelerator", "scaler"),
             token='"scaler"', package="accelerate"),
    Internal("accelerate.data_loader.DataLoaderShard.base_dataloader", "the torch DataLoader inside "
             "accelerate's wrapper, whose batch sampler is replaced", "_hf_data.py: base_loader",
             uses(f"{_LOADERS}:DataLoaderShard", "base_dataloader"), package="accelerate"),
    Internal("accelerate.data_loader.SeedableRandomSampler.initial_seed", "the seed of each epoch's order "
             "(seed + epoch), recognised by the class name", "_hf_data.py: install",
             uses(f"{_LOADERS}:SeedableRandomSampler", "initial_seed"), package="accelerate"),
    Internal("accelerate.data_loader.BatchSamplerShard(batch_sampler, num_processes, process_index, "
             "split_batches, even_batches)", "several processes: the Trainer's training batches as accelerate "
             "splits them between the ranks; the positioned sampler takes over these settings and runs the "
             "class itself over each epoch's batches (the same split)", "_hf_data.py: install, "
             "PositionedBatchSampler._batches",
             (param(f"{_LOADERS}:BatchSamplerShard", "batch_sampler", *_hf_data.SHARD_SETTINGS),
              uses(f"{_LOADERS}:BatchSamplerShard", "batch_sampler", *_hf_data.SHARD_SETTINGS)),
             token="SHARD_SETTINGS", package="accelerate"),
    Internal("accelerate.data_loader.DataLoaderDispatcher.state", "recognised by the class name: with "
             "dispatch_batches=True on several processes rank 0 reads every rank's batches (checkpoints at "
             "epoch ends only, said once)", "_hf_data.py: install",
             uses(f"{_LOADERS}:DataLoaderDispatcher", "state"), token="DataLoaderDispatcher", package="accelerate"),
    Internal("torch.utils.data.RandomSampler._num_samples", "None unless num_samples= was given (then the "
             "order cannot be reproduced)", "_hf_data.py: install",
             uses("torch.utils.data:RandomSampler", "_num_samples"), package="torch"),
    *(Internal(f"Trainer.{RUN_EPOCH}({p}=)", "a resume argument the runner passes to the Trainer's "
               "own epoch (its step counter continues at the saved batch)", f"{_T}: _EpochRunner.__call__",
               param(f"{_TRAINER}.{RUN_EPOCH}", p), token=f"{p}=")
      for p in ("resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch")),
    *(Internal(f"TrainerState.{f}", "a progress field saved and restored", f"{_HS}: capture, restore_trainer",
               field("transformers:TrainerState", f), token="STATE_FIELDS")
      for f in STATE_FIELDS),
)


COMPAT = Framework("transformers", [Package("transformers", "transformers", ">=5.3,<6"),
                                    Package("accelerate", "accelerate", ">=1.1,<2"),
                                    Package("torch", "torch", ">=2.1")], INTERNALS)

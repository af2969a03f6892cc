"""The Lightning (and ``torchmetrics``) internals the Lightning adapter relies on (``lightning.py``,
``_lightning_state.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with Lightning 2.6.6. Every name below exists since Lightning 2.2 (the release whose fit loop
hands a training loader its saved position), but the restart code the adapter's exactness depends on
(how the epoch loop re-creates its iterator on a resume, where a stop inside an epoch lands) changed in
2.5.x and 2.6.0, so the range starts at 2.6; minor releases rework these loops, so it ends before 2.7.
Works for the ``lightning.pytorch`` and the ``pytorch_lightning`` namespace (the same code).
"""
from __future__ import annotations

try:  # the same namespace the adapter uses
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ._compat import Framework, Internal, Package, code_consts, code_names, field, has, param, resolve, uses

__all__ = ["COMPAT", "INTERNALS", "EPOCH_START", "EPOCH_END", "BATCH_END", "EPOCH_RESET", "LOAD_LOADER_STATES",
           "NOT_RESUMABLE_WARNING", "DDP_START_METHOD"]

#: the fit loop's method before an epoch (replaced on the instance: restores the pending state)
EPOCH_START = "on_advance_start"
#: the fit loop's method after an epoch (replaced on the instance: the epoch-end checkpoint)
EPOCH_END = "on_advance_end"
#: the epoch loop's method after a training batch (replaced on the instance: the step checkpoint)
BATCH_END = "on_advance_end"
#: the epoch loop's reset (replaced on the instance: its "dataloader is not resumable" warning is
#: silenced when keepalive positions the loaders)
EPOCH_RESET = "reset"
NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
#: the fit loop's method called once its training loaders are built, right before it calls iter() on
#: them (replaced on the instance: the combined loader iterates them through keepalive's replay)
LOAD_LOADER_STATES = "_load_combined_loader_states"
#: how a DDPStrategy starts its processes ("popen": each runs the script itself; spawn / fork: from this one)
DDP_START_METHOD = "_start_method"

_LOG_PARAMS = ("fx", "name", "value", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph",
               "add_dataloader_idx", "batch_size", "sync_dist", "sync_dist_fn", "metric_attribute",
               "rank_zero_only")

# where the internals live, as the checks name them ("module:Class", imported when a check runs),
# and the adapter's files that use them
_PL = pl.__name__
#: Lightning Fabric's namespace, the one that goes with the Lightning namespace in use
_FABRIC = "lightning.fabric" if _PL.startswith("lightning.") else "lightning_fabric"
_FIT_LOOP = f"{_PL}.loops.fit_loop:_FitLoop"
_EPOCH_LOOP = f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop"
_CONNECTOR = f"{_PL}.trainer.connectors.checkpoint_connector:_CheckpointConnector"
_LOGGER = f"{_PL}.trainer.connectors.logger_connector.logger_connector:_LoggerConnector"
_RESULT = f"{_PL}.trainer.connectors.logger_connector.result"
_METRIC, _META, _SYNC = f"{_RESULT}:_ResultMetric", f"{_RESULT}:_Metadata", f"{_RESULT}:_Sync"
_COMBINED = f"{_PL}.utilities.combined_loader"
_CSV = f"{_FABRIC}.loggers.csv_logs"
_L, _S, _D = "lightning.py", "_lightning_state.py", "_lightning_data.py"
_LA, _LF = "_lightning_attach.py", "_lightning_fit.py"


def _closure_then_hook() -> bool:
    """Lightning's precision plugins call on_before_optimizer_step after the closure (through
    ``_after_closure``), and hand ``optimizer.step`` the closure as a keyword."""
    precision = resolve(f"{_PL}.plugins.precision.precision:Precision")
    amp = resolve(f"{_PL}.plugins.precision.amp:MixedPrecision")
    return ("on_before_optimizer_step" in code_consts(precision._after_closure)
            and "_after_closure" in code_names(precision._wrap_closure)
            and "_after_closure" in code_names(amp.optimizer_step)
            and "closure" in code_consts(precision.optimizer_step))  # the keyword's name


#: the internals, as a table: name, what the adapter does with it, where, the check
INTERNALS = (
    Internal(f"_FitLoop.{EPOCH_START}", "replaced on the trainer's fit loop for one fit: the RNGs and "
             "accumulators of a resume go back right before the epoch continues", f"{_LA}: attach",
             has(_FIT_LOOP, EPOCH_START), token="EPOCH_START"),
    Internal(f"_FitLoop.{EPOCH_END}", "replaced on the trainer's fit loop for one fit: the epoch-end "
             "checkpoint", f"{_LA}: attach", has(_FIT_LOOP, EPOCH_END), token="EPOCH_END"),
    Internal(f"_TrainingEpochLoop.{BATCH_END}", "replaced on the trainer's epoch loop for one fit: the "
             "checkpoint between two batches", f"{_LA}: attach", has(_EPOCH_LOOP, BATCH_END),
             token="BATCH_END"),
    Internal(f"_TrainingEpochLoop.{EPOCH_RESET}", "replaced on the trainer's epoch loop for one fit: its "
             "warning that a mid-epoch resume's loader is not resumable is silenced (keepalive positions it)",
             f"{_LA}: attach", has(_EPOCH_LOOP, EPOCH_RESET), token="EPOCH_RESET"),
    Internal(f"_FitLoop.{LOAD_LOADER_STATES}", "replaced on the trainer's fit loop for one fit: called once "
             "the training loaders are built, right before the loop calls iter() on them: keepalive's replay "
             "is installed there", f"{_LA}: attach", has(_FIT_LOOP, LOAD_LOADER_STATES),
             token="LOAD_LOADER_STATES"),
    Internal("_EvaluationLoop.run / batch_progress", "the fit's validation loop's run is wrapped for one fit: "
             "a training batch's boundary is made before it draws its loader's seed; a save during it writes "
             "its batch progress as an interrupted validation, which a resume runs again "
             "(restarted_mid_evaluation)",
             f"{_LA}: attach, _lightning_validation.py: ValidationPhase, {_S}: validation_again",
             has(f"{_PL}.loops.evaluation_loop:_EvaluationLoop", "run", "restarted_mid_evaluation"),
             token="val_loop"),
    Internal("_TrainingEpochLoop._batches_that_stepped", "part of the fingerprint a save during a "
             "validation compares with the last boundary's", f"{_L}: DriveCheckpoint._fingerprint",
             uses(_EPOCH_LOOP, "_batches_that_stepped"), token="_batches_that_stepped"),
    Internal("CombinedLoader.__iter__ / _flattened", "for one fit the fit loop's combined loader is a subclass "
             "whose iter() hands Lightning's mode iterator keepalive's iterables in place of the loaders "
             "(_flattened, read by __iter__)", f"{_D}: install",
             uses(f"{_COMBINED}:CombinedLoader", "_flattened"), token="_flattened"),
    Internal("_ModeIterator.iterables", "iter() is called on each of them (the training loaders' epoch "
             "iterators)", f"{_D}: install", uses(f"{_COMBINED}:_ModeIterator", "iterables"), token="_Feed"),
    Internal(f"DDPStrategy.{DDP_START_METHOD}", "several processes: only those that run the script "
             "themselves (\"popen\": torchrun, or Lightning's own launch) are checkpointed",
             f"{_L}: _check_strategy", uses(f"{_PL}.strategies.ddp:DDPStrategy", DDP_START_METHOD),
             token="DDP_START_METHOD"),
    Internal("Precision._after_closure", "calls the callbacks' on_before_optimizer_step after the closure "
             "(forward, backward) and before the optimizer's update, AMP's MixedPrecision.optimizer_step too; "
             "Precision.optimizer_step passes its closure as optimizer.step(closure=...): a lazy snapshot's "
             "background copy runs on until that hook, a step without a closure settles it at its start",
             f"{_L}: DriveCheckpoint.on_before_optimizer_step, _settle_at_plain_step", _closure_then_hook,
             token="on_before_optimizer_step"),
    Internal("Trainer._checkpoint_connector", "Lightning's own checkpoint: dumped at a save, handed the "
             "loaded one at a resume", f"{_L}: DriveCheckpoint.capture, _resume",
             uses(f"{_PL}:Trainer", "_checkpoint_connector")),
    Internal("_CheckpointConnector.dump_checkpoint(weights_only=)", "what is saved",
             f"{_L}: DriveCheckpoint.capture", param(f"{_CONNECTOR}.dump_checkpoint", "weights_only"),
             token="dump_checkpoint(weights_only="),
    Internal("_CheckpointConnector._loaded_checkpoint", "set at a resume: Lightning's restore reads it",
             f"{_L}: DriveCheckpoint._resume", uses(_CONNECTOR, "_loaded_checkpoint")),
    Internal("_TrainingEpochLoop._results", "the epoch's self.log accumulators (saved, restored)",
             f"{_L}: DriveCheckpoint.capture, _restore_pending", uses(_EPOCH_LOOP, "_results")),
    Internal("_TrainingEpochLoop._should_accumulate", "whether gradients are being accumulated (no save then)",
             f"{_L}: DriveCheckpoint._step_boundary", has(_EPOCH_LOOP, "_should_accumulate")),
    Internal("_TrainingEpochLoop.batch_progress", "the batch position (is_last_batch, current.completed)",
             f"{_L}: DriveCheckpoint._step_boundary", uses(_EPOCH_LOOP, "batch_progress")),
    Internal("_BatchProgress.is_last_batch", "no save after an epoch's last batch (its end comes next)",
             f"{_L}: DriveCheckpoint._step_boundary", has(f"{_PL}.loops.progress:_BatchProgress", "is_last_batch")),
    Internal("_TrainingEpochLoop.min_steps", "cleared at a deadline stop (a stop Lightning would refuse)",
             f"{_LF}: stop", uses(_EPOCH_LOOP, "min_steps"), token='"min_steps"'),
    Internal("_FitLoop.min_epochs", "cleared at a deadline stop (a stop Lightning would refuse)",
             f"{_LF}: stop", uses(_FIT_LOOP, "min_epochs"), token='"min_epochs"'),
    Internal("_FitLoop.epoch_progress", "the epochs done (is this the last epoch)",
             f"{_L}: DriveCheckpoint._is_last_epoch", uses(_FIT_LOOP, "epoch_progress")),
    Internal("_FitLoop.max_epochs / max_steps", "the fit's length (is this the last epoch)",
             f"{_LF}: is_last_epoch", uses(_FIT_LOOP, "max_epochs", "max_steps"),
             token="fit_loop.max_steps"),
    Internal("_FitLoop._can_stop_early", "whether a stop request ends the fit now",
             f"{_LF}: is_last_epoch", has(_FIT_LOOP, "_can_stop_early")),
    Internal("_FitLoop._combined_loader", "the training loaders (checked, iterated through keepalive)",
             f"{_L}: DriveCheckpoint._install", uses(_FIT_LOOP, "_combined_loader")),
    Internal("lightning.pytorch.utilities.exceptions.SIGTERMException", "raised by the loop on SIGTERM: "
             "the boundary is saved before it propagates", f"{_LA}: _sigterm_exception",
             has(f"{_PL}.utilities.exceptions", "SIGTERMException"), token="SIGTERMException"),
    Internal("Trainer._logger_connector", "the trainer's metrics and the first-batch flag of self.log",
             f"{_S}: capture_trainer_metrics", uses(f"{_PL}:Trainer", "_logger_connector")),
    Internal("_LoggerConnector._first_loop_iter", "set after a mid-epoch resume: self.log adds to the "
             "restored accumulators", f"{_S}: restore_pending", uses(_LOGGER, "_first_loop_iter")),
    Internal("_ResultCollection.log(...)", "recreates the accumulators with the metadata self.log gives "
             f"them ({', '.join(_LOG_PARAMS)})", f"{_S}: restore_results",
             param(f"{_RESULT}:_ResultCollection.log", *_LOG_PARAMS), token="results.log("),
    Internal("_Metadata.sync", "an accumulator's sync settings (should, rank_zero_only)",
             f"{_S}: capture_results", (has(_META, "sync"), uses(_SYNC, "should", "rank_zero_only")),
             token="meta.sync"),
    Internal("CSVLogger._version / _experiment", "a resume points the logger back at the version the run "
             "wrote and makes its writer again", f"{_S}: restore_csv",
             uses(f"{_CSV}:CSVLogger", "_version", "_experiment"), token="logger._experiment", package="lightning"),
    Internal("_ExperimentWriter.metrics / metrics_keys / metrics_file_path / _fs / save / NAME_METRICS_FILE",
             "the CSV rows not flushed yet, the file's header keys, its path and filesystem (saved, restored); "
             "save() flushes them (counted)", f"{_S}: capture_csv, restore_csv, watch_csv",
             (uses(f"{_CSV}:_ExperimentWriter", "metrics", "metrics_keys", "metrics_file_path", "_fs"),
              has(f"{_CSV}:_ExperimentWriter", "save", "NAME_METRICS_FILE")),
             token="writer.metrics_keys", package="lightning"),
    *(Internal(f"_LoggerConnector.{a}", "the trainer's last metrics (saved, restored)",
               f"{_S}: capture_trainer_metrics, restore_trainer_metrics", uses(_LOGGER, a))
      for a in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")),
    *(Internal(f"_ResultMetric.{a}", "an epoch accumulator's state (saved, restored)",
               f"{_S}: capture_results, restore_results", uses(_METRIC, a), token=t)
      for a, t in (("meta", "rm.meta"), ("is_tensor", '"is_tensor"'), ("value", "rm.value"),
                   ("has_reset", "rm.has_reset"), ("cumulated_batch_size", "rm.cumulated_batch_size"),
                   ("_forward_cache", "rm._forward_cache"), ("_computed", "rm._computed"))),
    *(Internal(f"_Metadata.{f}", "an accumulator's metadata (saved, recreated)", f"{_S}: capture_results",
               field(_META, f), token=f"meta.{f}")
      for f in ("fx", "name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph",
                "add_dataloader_idx", "metric_attribute")),
    *(Internal(f"torchmetrics.Metric.{a}", "a metric's non-persistent state (saved, restored)",
               f"{_S}: capture_metrics, restore_metrics", uses("torchmetrics:Metric", a), token=a,
               package="torchmetrics")
      for a in ("_defaults", "_update_count", "_computed")),
)


COMPAT = Framework("lightning", [Package("lightning" if _PL.startswith("lightning") else "pytorch-lightning",
                                         _PL, ">=2.6,<2.7"),
                                 Package("torchmetrics", "torchmetrics", ">=1.0,<2", only_if_imported=True)],
                   INTERNALS)

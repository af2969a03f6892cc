"""The Lightning (and ``torchmetrics``) internals the Lightning adapter relies on (``lightning.py``,
``_lightning_state.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with Lightning 2.6.6. Every name below exists since Lightning 2.2 (the release whose fit loop
hands a training loader its saved position), but the restart code the adapter's exactness depends on
(how the epoch loop re-creates its iterator on a resume, where a stop inside an epoch lands) changed in
2.5.x and 2.6.0, so the range starts at 2.6; minor releases rework these loops, so it ends before 2.7.
Works for the ``lightning.pytorch`` and the ``pytorch_lightning`` namespace (the same code).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, List

try:  # the same namespace the adapter uses
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ._compat import Framework, Internal, Package, code_consts, code_names, field, has, module_has, param, uses

__all__ = ["COMPAT", "EPOCH_START", "EPOCH_END", "BATCH_END", "EPOCH_RESET", "LOAD_LOADER_STATES",
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


def _cls(module: str, name: str) -> Callable[[], Any]:
    """A Lightning class, imported when a probe runs (from the namespace in use)."""
    return lambda: getattr(importlib.import_module(f"{pl.__name__}.{module}"), name)


def _internals() -> List[Internal]:
    fit_loop = _cls("loops.fit_loop", "_FitLoop")
    epoch_loop = _cls("loops.training_epoch_loop", "_TrainingEpochLoop")
    connector = _cls("trainer.connectors.checkpoint_connector", "_CheckpointConnector")
    logger = _cls("trainer.connectors.logger_connector.logger_connector", "_LoggerConnector")
    result = "trainer.connectors.logger_connector.result"
    metric, meta, sync = _cls(result, "_ResultMetric"), _cls(result, "_Metadata"), _cls(result, "_Sync")
    L, S, D = "lightning.py", "_lightning_state.py", "_lightning_data.py"
    rows = [
        Internal(f"_FitLoop.{EPOCH_START}", "replaced on the trainer's fit loop for one fit: the RNGs and "
                 "accumulators of a resume go back right before the epoch continues", f"{L}: DriveCheckpoint._attach",
                 has(fit_loop, EPOCH_START), token="EPOCH_START"),
        Internal(f"_FitLoop.{EPOCH_END}", "replaced on the trainer's fit loop for one fit: the epoch-end "
                 "checkpoint", f"{L}: DriveCheckpoint._attach", has(fit_loop, EPOCH_END), token="EPOCH_END"),
        Internal(f"_TrainingEpochLoop.{BATCH_END}", "replaced on the trainer's epoch loop for one fit: the "
                 "checkpoint between two batches", f"{L}: DriveCheckpoint._attach", has(epoch_loop, BATCH_END),
                 token="BATCH_END"),
        Internal(f"_TrainingEpochLoop.{EPOCH_RESET}", "replaced on the trainer's epoch loop for one fit: its "
                 "warning that a mid-epoch resume's loader is not resumable is silenced (keepalive positions it)",
                 f"{L}: DriveCheckpoint._attach", has(epoch_loop, EPOCH_RESET), token="EPOCH_RESET"),
        Internal(f"_FitLoop.{LOAD_LOADER_STATES}", "replaced on the trainer's fit loop for one fit: called once "
                 "the training loaders are built, right before the loop calls iter() on them: keepalive's replay "
                 "is installed there", f"{L}: DriveCheckpoint._attach", has(fit_loop, LOAD_LOADER_STATES),
                 token="LOAD_LOADER_STATES"),
        Internal("_EvaluationLoop.run / batch_progress", "the fit's validation loop's run is wrapped for one fit: "
                 "a training batch's boundary is made before it draws its loader's seed; a save during it writes "
                 "its batch progress as an interrupted validation, which a resume runs again "
                 "(restarted_mid_evaluation)", f"{L}: DriveCheckpoint._attach, {S}: validation_again",
                 has(_cls("loops.evaluation_loop", "_EvaluationLoop"), "run", "restarted_mid_evaluation"),
                 token="val_loop"),
        Internal("_TrainingEpochLoop._batches_that_stepped", "part of the fingerprint a save during a "
                 "validation compares with the last boundary's", f"{L}: DriveCheckpoint._fingerprint",
                 uses(epoch_loop, "_batches_that_stepped"), token="_batches_that_stepped"),
        Internal("CombinedLoader.__iter__ / _flattened", "for one fit the fit loop's combined loader is a subclass "
                 "whose iter() hands Lightning's mode iterator keepalive's iterables in place of the loaders "
                 "(_flattened, read by __iter__)", f"{D}: install",
                 uses(_cls("utilities.combined_loader", "CombinedLoader"), "_flattened"), token="_flattened"),
        Internal("_ModeIterator.iterables", "iter() is called on each of them (the training loaders' epoch "
                 "iterators)", f"{D}: install", uses(_cls("utilities.combined_loader", "_ModeIterator"), "iterables"),
                 token="_Feed"),
        Internal(f"DDPStrategy.{DDP_START_METHOD}", "several processes: only those that run the script "
                 "themselves (\"popen\": torchrun, or Lightning's own launch) are checkpointed",
                 f"{L}: _check_strategy", uses(_cls("strategies.ddp", "DDPStrategy"), DDP_START_METHOD),
                 token="DDP_START_METHOD"),
        Internal("Precision._after_closure", "calls the callbacks' on_before_optimizer_step after the closure "
                 "(forward, backward) and before the optimizer's update, AMP's MixedPrecision.optimizer_step too; "
                 "Precision.optimizer_step passes its closure as optimizer.step(closure=...): a lazy snapshot's "
                 "background copy runs on until that hook, a step without a closure settles it at its start",
                 f"{L}: DriveCheckpoint.on_before_optimizer_step, _settle_at_plain_step", _closure_then_hook,
                 token="on_before_optimizer_step"),
        Internal("Trainer._checkpoint_connector", "Lightning's own checkpoint: dumped at a save, handed the "
                 "loaded one at a resume", f"{L}: DriveCheckpoint.capture, _resume",
                 uses(lambda: pl.Trainer, "_checkpoint_connector")),
        Internal("_CheckpointConnector.dump_checkpoint(weights_only=)", "what is saved",
                 f"{L}: DriveCheckpoint.capture", param(lambda: connector().dump_checkpoint, "weights_only"),
                 token="dump_checkpoint(weights_only="),
        Internal("_CheckpointConnector._loaded_checkpoint", "set at a resume: Lightning's restore reads it",
                 f"{L}: DriveCheckpoint._resume", uses(connector, "_loaded_checkpoint")),
        Internal("_TrainingEpochLoop._results", "the epoch's self.log accumulators (saved, restored)",
                 f"{L}: DriveCheckpoint.capture, _restore_pending", uses(epoch_loop, "_results")),
        Internal("_TrainingEpochLoop._should_accumulate", "whether gradients are being accumulated (no save then)",
                 f"{L}: DriveCheckpoint._step_boundary", has(epoch_loop, "_should_accumulate")),
        Internal("_TrainingEpochLoop.batch_progress", "the batch position (is_last_batch, current.completed)",
                 f"{L}: DriveCheckpoint._step_boundary", uses(epoch_loop, "batch_progress")),
        Internal("_BatchProgress.is_last_batch", "no save after an epoch's last batch (its end comes next)",
                 f"{L}: DriveCheckpoint._step_boundary",
                 has(_cls("loops.progress", "_BatchProgress"), "is_last_batch")),
        Internal("_TrainingEpochLoop.min_steps", "cleared at a deadline stop (a stop Lightning would refuse)",
                 f"{L}: DriveCheckpoint._stop", uses(epoch_loop, "min_steps"), token='"min_steps"'),
        Internal("_FitLoop.min_epochs", "cleared at a deadline stop (a stop Lightning would refuse)",
                 f"{L}: DriveCheckpoint._stop", uses(fit_loop, "min_epochs"), token='"min_epochs"'),
        Internal("_FitLoop.epoch_progress", "the epochs done (is this the last epoch)",
                 f"{L}: DriveCheckpoint._is_last_epoch", uses(fit_loop, "epoch_progress")),
        Internal("_FitLoop.max_epochs / max_steps", "the fit's length (is this the last epoch)",
                 f"{L}: DriveCheckpoint._is_last_epoch", uses(fit_loop, "max_epochs", "max_steps"),
                 token="fit_loop.max_steps"),
        Internal("_FitLoop._can_stop_early", "whether a stop request ends the fit now",
                 f"{L}: DriveCheckpoint._is_last_epoch", has(fit_loop, "_can_stop_early")),
        Internal("_FitLoop._combined_loader", "the training loaders (checked, iterated through keepalive)",
                 f"{L}: DriveCheckpoint._install", uses(fit_loop, "_combined_loader")),
        Internal("lightning.pytorch.utilities.exceptions.SIGTERMException", "raised by the loop on SIGTERM: "
                 "the boundary is saved before it propagates", f"{L}: _sigterm_exception",
                 module_has(f"{pl.__name__}.utilities.exceptions", "SIGTERMException"), token="SIGTERMException"),
        Internal("Trainer._logger_connector", "the trainer's metrics and the first-batch flag of self.log",
                 f"{S}: capture_trainer_metrics", uses(lambda: pl.Trainer, "_logger_connector")),
        Internal("_LoggerConnector._first_loop_iter", "set after a mid-epoch resume: self.log adds to the "
                 "restored accumulators", f"{L}: DriveCheckpoint._restore_pending", uses(logger, "_first_loop_iter")),
        Internal("_ResultCollection.log(...)", "recreates the accumulators with the metadata self.log gives "
                 f"them ({', '.join(_LOG_PARAMS)})", f"{S}: restore_results",
                 param(lambda: _cls(result, "_ResultCollection")().log, *_LOG_PARAMS), token="results.log("),
        Internal("_Metadata.sync", "an accumulator's sync settings (should, rank_zero_only)",
                 f"{S}: capture_results", lambda: has(meta, "sync")() and uses(sync, "should", "rank_zero_only")(),
                 token="meta.sync"),
    ]
    csv_logger = _fabric_cls("loggers.csv_logs", "CSVLogger")
    csv_writer = _fabric_cls("loggers.csv_logs", "_ExperimentWriter")
    rows += [
        Internal("CSVLogger._version / _experiment", "a resume points the logger back at the version the run "
                 "wrote and makes its writer again", f"{S}: restore_csv", uses(csv_logger, "_version", "_experiment"),
                 token="logger._experiment", package="lightning"),
        Internal("_ExperimentWriter.metrics / metrics_keys / metrics_file_path / _fs / save / NAME_METRICS_FILE",
                 "the CSV rows not flushed yet, the file's header keys, its path and filesystem (saved, restored); "
                 "save() flushes them (counted)", f"{S}: capture_csv, restore_csv, watch_csv",
                 lambda: uses(csv_writer, "metrics", "metrics_keys", "metrics_file_path", "_fs")()
                 and has(csv_writer, "save", "NAME_METRICS_FILE")(), token="writer.metrics_keys", package="lightning"),
    ]
    rows += [Internal(f"_LoggerConnector.{a}", "the trainer's last metrics (saved, restored)",
                      f"{S}: capture_trainer_metrics, restore_trainer_metrics", uses(logger, a))
             for a in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")]
    rows += [Internal(f"_ResultMetric.{a}", "an epoch accumulator's state (saved, restored)",
                      f"{S}: capture_results, restore_results", uses(metric, a), token=t)
             for a, t in (("meta", "rm.meta"), ("is_tensor", '"is_tensor"'), ("value", "rm.value"),
                          ("has_reset", "rm.has_reset"), ("cumulated_batch_size", "rm.cumulated_batch_size"),
                          ("_forward_cache", "rm._forward_cache"), ("_computed", "rm._computed"))]
    rows += [Internal(f"_Metadata.{f}", "an accumulator's metadata (saved, recreated)", f"{S}: capture_results",
                      field(meta, f), token=f"meta.{f}")
             for f in ("fx", "name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph",
                       "add_dataloader_idx", "metric_attribute")]
    rows += [Internal(f"torchmetrics.Metric.{a}", "a metric's non-persistent state (saved, restored)",
                      f"{S}: capture_metrics, restore_metrics", uses(_torchmetrics_metric, a), token=a,
                      package="torchmetrics")
             for a in ("_defaults", "_update_count", "_computed")]
    return rows


def _closure_then_hook() -> bool:
    """Lightning's precision plugins call on_before_optimizer_step after the closure (through
    ``_after_closure``), and hand ``optimizer.step`` the closure as a keyword."""
    precision = _cls("plugins.precision.precision", "Precision")()
    amp = _cls("plugins.precision.amp", "MixedPrecision")()
    return ("on_before_optimizer_step" in code_consts(precision._after_closure)
            and "_after_closure" in code_names(precision._wrap_closure)
            and "_after_closure" in code_names(amp.optimizer_step)
            and "closure" in code_consts(precision.optimizer_step))  # the keyword's name


def _fabric_cls(module: str, name: str) -> Callable[[], Any]:
    """A Lightning Fabric class (``lightning.fabric`` or ``lightning_fabric``, the namespace in use's)."""
    fabric = "lightning.fabric" if pl.__name__.startswith("lightning.") else "lightning_fabric"
    return lambda: getattr(importlib.import_module(f"{fabric}.{module}"), name)


def _torchmetrics_metric() -> Any:
    import torchmetrics

    return torchmetrics.Metric


COMPAT = Framework("lightning", [Package("lightning" if pl.__name__.startswith("lightning") else "pytorch-lightning",
                                         pl.__name__, ">=2.6,<2.7"),
                                 Package("torchmetrics", "torchmetrics", ">=1.0,<2", only_if_imported=True)],
                   _internals)

"""What a Lightning checkpoint leaves out but an exact mid-epoch resume needs, and the filter that
keeps a Lightning checkpoint storable without pickling.

Lightning's own checkpoint (``dump_checkpoint``) holds model, optimizers, schedulers, precision plugin,
loops, callbacks, datamodule. Inside an epoch three more things carry training state:

* the epoch's accumulators of ``self.log(..., on_epoch=True)`` values (``fit_loop.epoch_loop._results``):
  without them a resumed epoch's ``train_loss_epoch`` averages only the batches after the restart;
* the states of ``torchmetrics`` metrics of the module (not in its ``state_dict``: non-persistent);
* the trainer's last metrics (``callback_metrics`` / ``logged_metrics`` / ``progress_bar_metrics``),
  which callbacks read between validations (``ModelCheckpoint(monitor=..., every_n_train_steps=...)``).

Each is captured as plain values and tensors and put back before training continues.
"""
from __future__ import annotations

import csv
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from ..errors import UnsupportedStateError
from ..state import encode

_REDUCTIONS = ("mean", "sum", "max", "min")
#: entries of a Lightning checkpoint that describe, not train: dropped when they cannot be stored
_DESCRIPTIVE = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
                "datamodule_hparams_name", "datamodule_hparams_type")


# ------------------------------------------------------------------------------ storability
def storable_checkpoint(ckpt: Dict[str, Any], note: Callable[[str, str], None]) -> Dict[str, Any]:
    """The checkpoint without entries keepalive cannot store (it never pickles): hyper-parameters that
    hold objects (Lightning restores none of them in ``fit``) are left out with a note; anything else
    that cannot be stored raises :class:`~keepalive.errors.UnsupportedStateError` naming it."""
    out = dict(ckpt)
    for key in _DESCRIPTIVE:
        if key in out:
            try:
                encode(out[key])
            except UnsupportedStateError as exc:
                del out[key]
                note(f"'{key}' of the Lightning checkpoint is not stored ({exc}); fit() restores no "
                     "hyper-parameters, so the resume is unaffected.", f"lightning-drop:{key}")
    return out


# ------------------------------------------------------------------------- logged accumulators
def capture_results(results: Any) -> List[Dict[str, Any]]:
    """The running epoch's ``self.log`` accumulators (tensor values; Metric objects are restored
    through :func:`capture_metrics`)."""
    out: List[Dict[str, Any]] = []
    for key, rm in (results or {}).items():
        if not getattr(rm, "is_tensor", False):
            continue
        meta = rm.meta
        reduce = getattr(meta.reduce_fx, "__name__", "")
        if reduce not in _REDUCTIONS:
            continue
        entry: Dict[str, Any] = {
            "key": key, "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar, "logger": meta.logger,
            "on_step": meta.on_step, "on_epoch": meta.on_epoch, "reduce_fx": reduce,
            "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
            "metric_attribute": meta.metric_attribute, "sync_dist": bool(meta.sync.should),
            "rank_zero_only": bool(getattr(meta.sync, "rank_zero_only", False)),
            "has_reset": bool(rm.has_reset), "value": rm.value}
        if hasattr(rm, "cumulated_batch_size"):
            entry["cumulated_batch_size"] = rm.cumulated_batch_size
        if rm._forward_cache is not None:
            entry["forward_cache"] = rm._forward_cache
        out.append(entry)
    return out


def restore_results(results: Any, saved: List[Dict[str, Any]], reduce_fn: Any) -> None:
    """Recreate the accumulators in a fresh result collection (through its own ``log``, so their
    metadata equals what the module's next ``self.log`` brings), then put the saved values in."""
    for e in saved:
        if e["fx"] + "." + e["name"] != e["key"]:
            continue  # a dataloader-indexed key: not a training accumulator
        value = e["value"]
        results.log(e["fx"], e["name"], torch.zeros((), dtype=value.dtype, device=value.device),
                    prog_bar=e["prog_bar"], logger=e["logger"], on_step=e["on_step"], on_epoch=e["on_epoch"],
                    reduce_fx=e["reduce_fx"], enable_graph=e["enable_graph"],
                    add_dataloader_idx=e["add_dataloader_idx"], batch_size=1, sync_dist=e["sync_dist"],
                    sync_dist_fn=reduce_fn, metric_attribute=e["metric_attribute"],
                    rank_zero_only=e["rank_zero_only"])
        rm = results[e["key"]]
        rm.value = value.clone()
        if "cumulated_batch_size" in e:
            rm.cumulated_batch_size = e["cumulated_batch_size"].clone()
        fc = e.get("forward_cache")
        rm._forward_cache = fc.clone() if fc is not None else None
        rm._computed = None
        rm.has_reset = e["has_reset"]


# ------------------------------------------------------------------------------- torchmetrics
def capture_metrics(module: torch.nn.Module) -> Dict[str, Any]:
    """The states of the module's ``torchmetrics.Metric`` children (non-persistent: not in its
    ``state_dict``)."""
    tm = sys.modules.get("torchmetrics")
    if tm is None:
        return {}
    out: Dict[str, Any] = {}
    for name, m in module.named_modules():
        if isinstance(m, tm.Metric) and getattr(m, "_defaults", None) is not None:
            out[name] = {"states": {attr: getattr(m, attr) for attr in m._defaults},
                         "update_count": int(getattr(m, "_update_count", 0))}
    return out


def restore_metrics(module: torch.nn.Module, saved: Dict[str, Any]) -> None:
    if not saved:
        return
    mods = dict(module.named_modules())
    for name, s in saved.items():
        m = mods.get(name)
        if m is None:
            continue
        for attr, v in s["states"].items():
            if attr in getattr(m, "_defaults", {}):
                if isinstance(v, torch.Tensor):
                    v = v.clone()
                elif isinstance(v, list):
                    v = [t.clone() if isinstance(t, torch.Tensor) else t for t in v]
                setattr(m, attr, v)
        m._update_count = int(s.get("update_count", 0))
        m._computed = None


def copy_tensors(saved: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`capture_metrics`' result with its tensors copied (the metrics update them in place)."""
    return {name: {"states": {attr: v.clone() if isinstance(v, torch.Tensor) else
                              [t.clone() if isinstance(t, torch.Tensor) else t for t in v] if isinstance(v, list)
                              else v for attr, v in s["states"].items()},
                   "update_count": s["update_count"]} for name, s in saved.items()}


# ------------------------------------------------------------------- a validation run again
#: the fit loop's entry for the progress of the validation inside the epoch loop
VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"


def validation_again(ckpt: Dict[str, Any], at_start: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint with its validation's progress as Lightning writes it for a validation that was
    interrupted at its first batch (``at_start``: the progress when it started): a restart from it runs
    the validation again, whole (``_EvaluationLoop.restarted_mid_evaluation``), then the rest of the
    training batch's end. Other loop counters are those of the batch's end, before its validation."""
    fit_loop = (ckpt.get("loops") or {}).get("fit_loop")
    if not isinstance(fit_loop, dict) or VAL_PROGRESS not in fit_loop:
        return ckpt
    done = int(at_start["total"]["completed"])
    progress = dict(at_start, is_last_batch=False,
                    total=dict(at_start["total"], ready=done + 1, started=done + 1, processed=done, completed=done),
                    current=dict(at_start["current"], ready=1, started=1, processed=0, completed=0))
    out = dict(ckpt)
    out["loops"] = dict(ckpt["loops"], fit_loop=dict(fit_loop, **{VAL_PROGRESS: progress}))
    return out


# --------------------------------------------------------------------------- trainer metrics
def capture_trainer_metrics(trainer: Any) -> Dict[str, Any]:
    lc = trainer._logger_connector
    return {"callback": dict(lc._callback_metrics), "logged": dict(lc._logged_metrics),
            "pbar": {k: v for k, v in lc._progress_bar_metrics.items() if isinstance(v, (int, float))}}


def restore_trainer_metrics(trainer: Any, saved: Optional[Dict[str, Any]]) -> None:
    if not saved:
        return
    lc = trainer._logger_connector
    lc._callback_metrics.update({k: _owned(v) for k, v in saved.get("callback", {}).items()})
    lc._logged_metrics.update({k: _owned(v) for k, v in saved.get("logged", {}).items()})
    lc._progress_bar_metrics.update(saved.get("pbar", {}))


def _owned(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


# ------------------------------------------------------------------------------------ CSV logger
# A CSVLogger picks a new ``version_N`` folder on every fit, and its writer keeps rows in memory until a
# flush (every ``flush_logs_every_n_steps``): after a kill and a resume the rows would go to a new
# folder, the old one holding the rows of redone steps and missing the unflushed ones. A checkpoint
# keeps, per CSV logger, its version, the rows its file held, the header keys and the unflushed rows; a
# resume writes on the same version's file, cut back to those rows, with the unflushed ones pending.
_ROWS = "_keepalive_rows"  # an attribute of the writer: rows written to its file (counted by watch_csv)


def csv_loggers(trainer: Any) -> List[Any]:
    """The trainer's CSV loggers (Lightning's ``CSVLogger``, either namespace, or fabric's)."""
    return [lg for lg in getattr(trainer, "loggers", []) if any(
        c.__name__ == "CSVLogger" and c.__module__.endswith("csv_logs") for c in type(lg).__mro__)]


def watch_csv(writer: Any, rows: int) -> None:
    """Count the rows the writer's ``save()`` puts in its file from now on (``rows`` there already)."""
    setattr(writer, _ROWS, int(rows))
    if "save" in writer.__dict__:
        return  # counted already (a logger used by an earlier fit of this process)
    save = writer.save

    def counting_save() -> None:
        pending = len(writer.metrics)
        save()
        setattr(writer, _ROWS, getattr(writer, _ROWS, 0) + pending)

    writer.save = counting_save


def capture_csv(trainer: Any) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for logger in csv_loggers(trainer):
        writer = logger._experiment
        if writer is None or not hasattr(writer, _ROWS):
            out.append({})
            continue
        out.append({"version": logger.version, "rows": int(getattr(writer, _ROWS)),
                    "keys": list(writer.metrics_keys), "pending": [dict(r) for r in writer.metrics]})
    return out


def restore_csv(trainer: Any, saved: List[Dict[str, Any]], warn: Callable[[str, str], None]) -> None:
    """Point each CSV logger back at the version the checkpoint's run wrote, its file cut back to the
    rows it held at the checkpoint, the unflushed rows pending (see above). Before training starts (the
    writers were made when the fit set up: a new version's folder, still empty, is removed)."""
    if getattr(trainer, "global_rank", 0) != 0:
        return  # a CSV logger writes on rank 0 only (the other ranks' writer is a stand-in)
    for logger, entry in zip(csv_loggers(trainer), saved):
        if not entry:
            continue
        new = logger._experiment
        fs = new._fs
        logger._version = entry["version"]
        path = os.path.join(logger.log_dir, type(new).NAME_METRICS_FILE)
        kept: List[Dict[str, str]] = []
        if entry["rows"] and fs.isfile(path):
            with fs.open(path, "r", newline="") as f:
                kept = [row for _, row in zip(range(entry["rows"]), csv.DictReader(f))]
        if new.log_dir != logger.log_dir:
            if fs.isdir(new.log_dir) and not fs.ls(new.log_dir):
                fs.rmdir(new.log_dir)  # made for this fit a moment ago, nothing in it
            logger._experiment = None
        writer = logger.experiment  # the saved version's writer (it removes the file: written again below)
        if len(kept) < entry["rows"]:
            warn(f"the CSV log {path} holds {len(kept)} of the {entry['rows']} rows written before the checkpoint "
                 "(deleted or lost): the resumed run writes on from there, the missing rows stay missing", "csv-rows")
        if kept:
            with fs.open(path, "w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=list(entry["keys"]), extrasaction="ignore")
                out.writeheader()
                out.writerows(kept)
        writer.metrics_keys = list(entry["keys"])
        writer.metrics = [dict(r) for r in entry["pending"]]
        watch_csv(writer, len(kept))


def watch_new_csv(trainer: Any) -> None:
    """A fit that resumes nothing: count what its CSV writers put in their files (rows there already
    included: a logger an earlier fit of this process used)."""
    for logger in csv_loggers(trainer):
        writer = logger._experiment
        if writer is None or hasattr(writer, _ROWS):
            continue
        rows = 0
        if writer._fs.isfile(writer.metrics_file_path):
            with writer._fs.open(writer.metrics_file_path, "r", newline="") as f:
                rows = sum(1 for _ in csv.DictReader(f))
        watch_csv(writer, rows)


# ------------------------------------------------------------------------ put back at the resume
def module_settings(module: Any) -> Dict[str, Any]:
    """The module's hyper-parameters as the code set them (``self.save_hyperparameters()``: its plain
    values, ``hparams.lr``...), recorded with each checkpoint and compared with a finished unnamed run's
    (:mod:`keepalive.runidentity`): the same module with another ``lr`` is another training."""
    hparams = getattr(module, "hparams", None) or {}
    try:
        items = list(hparams.items())
    except AttributeError:
        return {}
    return {f"hparams.{k}": v for k, v in items
            if isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))}


def pending_state(own: Dict[str, Any]) -> Dict[str, Any]:
    """What of a rank's saved accumulators (``own``) waits for the moment training continues."""
    return {"results": own.get("results") or [], "metrics": own.get("metrics") or {},
            "trainer_metrics": own.get("trainer_metrics")}


def restore_pending(trainer: Any, pending: Dict[str, Any], mid_epoch: bool) -> None:
    """Right before training continues: the trainer's last metrics, torchmetrics states and, inside an
    epoch, the epoch's ``self.log`` accumulators."""
    restore_trainer_metrics(trainer, pending["trainer_metrics"])
    restore_metrics(trainer.lightning_module, pending["metrics"])
    if mid_epoch:
        restore_results(trainer.fit_loop.epoch_loop._results, pending["results"], trainer.strategy.reduce)
        # as in the run that saved: past the epoch's first batch, so the module's next self.log
        # adds to the accumulators instead of starting them over
        trainer._logger_connector._first_loop_iter = False

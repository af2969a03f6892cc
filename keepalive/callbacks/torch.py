"""``DriveCheckpoint`` for plain PyTorch training loops.

Wrap the epoch loop and the batch loop; re-running the same cell or script after a crash continues
where the newest valid checkpoint left off, bit for bit:

>>> import torch
>>> from torch.utils.data import DataLoader, TensorDataset
>>> from keepalive.callbacks.torch import DriveCheckpoint
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Linear(4, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True)
>>> ckpt = DriveCheckpoint("memory://doc/linear", model=model, optimizer=opt, quiet=True)
>>> for epoch in ckpt.epochs(3):
...     for x, y in ckpt.batches(loader):
...         opt.zero_grad()
...         torch.nn.functional.mse_loss(model(x), y).backward()
...         opt.step()
>>> ckpt.step, ckpt.finished
(12, True)

What is saved: every registered object's ``state_dict()`` (models, optimizers, LR schedulers,
``GradScaler``, and any extra object with ``state_dict`` / ``load_state_dict``), the epoch / step /
batch / sample counters, the RNG states (python, numpy, torch CPU and CUDA), the data order (the
sampler seed and position) and ``ckpt.extras`` (JSON-able values of yours, e.g. the best metric).

Mid-epoch resume: loaders passed through :meth:`DriveCheckpoint.batches` restart at the saved batch by
computing the epoch's permutation, without loading the skipped samples (see
:mod:`keepalive.callbacks._torch_data`). Code between ``for epoch`` and ``for batch`` runs again when
an epoch is resumed in its middle.

Interrupts: Ctrl-C / "Interrupt kernel" and SIGTERM inside the loop finish the current step, save, and
then raise ``KeyboardInterrupt`` / exit; a second one acts at once.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Union

import torch

from ..core import Checkpointer, CheckpointerViews, say
from ..errors import StateMismatchError
from ._torch_data import ResumableLoader

log = logging.getLogger("keepalive.torch")

__all__ = ["DriveCheckpoint"]


class DriveCheckpoint(CheckpointerViews):
    """Checkpoint a plain PyTorch loop to a local folder, a mounted Drive or any fsspec URL.

    Args:
        path: the run folder (``/content/drive/MyDrive/runs/x``, ``gs://b/runs/x``, ...). Default:
            ``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``, plus ``run``.
        model, optimizer, scheduler, scaler: objects (or lists / dicts of them) to save and restore.
        every: ``"epoch"`` (default), an int (optimizer steps, i.e. batches) or a duration (``"10min"``).
        keep: how many recent checkpoints stay (default 3); ``keep_every``: also keep every Nth.
        on_deadline: ``"save_and_stop"`` (default), ``"save"`` or ``"ignore"`` when the session's
            time limit approaches (see ``keepalive status``).
        takeover: take the run over from another live session that holds its writer lease.
        background: write checkpoints in a background thread (default); the loop waits only for the
            copy to host memory.
        spool: ``"auto"`` (default) commits remote / Drive checkpoints to a local spool first and
            uploads them in the background (and switches to it when a local destination fails);
            ``True`` / ``False`` force it. ``flush_timeout``: how long the end of training waits for
            uploads (default 120 s). ``drive_flush``: on Colab, ``drive.flush_and_unmount()`` at the end.
        **objects: more objects with ``state_dict()`` / ``load_state_dict()``, saved under their names.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, model: Any = None,
                 optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                 every: Union[str, int, None] = "epoch", keep: Optional[int] = 3,
                 keep_every: Optional[int] = None, on_deadline: str = "save_and_stop",
                 deadline_margin: Union[str, float, None] = None, run: Optional[str] = None,
                 takeover: bool = False, background: bool = True,
                 storage_options: Optional[dict] = None, quiet: bool = False,
                 spool: Union[str, bool] = "auto", flush_timeout: Optional[float] = None,
                 drive_flush: Optional[bool] = None, **objects: Any):
        self.core = Checkpointer(path, run=run, every=every, keep=keep, keep_every=keep_every,
                                 on_deadline=on_deadline, deadline_margin=deadline_margin,
                                 takeover=takeover, background=background,
                                 storage_options=storage_options, framework="torch", quiet=quiet,
                                 spool=spool, flush_timeout=flush_timeout, drive_flush=drive_flush)
        self.objects: Dict[str, Any] = {}
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("scaler", scaler), *objects.items()):
            if obj is not None:
                self.register(name, obj)
        self.data_seed: Optional[int] = None
        self._loaders: Dict[int, ResumableLoader] = {}
        self._resumed = False
        self._in_epochs = False

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (anything with ``state_dict`` / ``load_state_dict``) as ``name``."""
        if isinstance(obj, dict):
            for k, v in obj.items():
                self.register(f"{name}.{k}", v)
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self.register(f"{name}.{i}", v)
            return
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                            "put plain values in ckpt.extras instead")
        self.objects[name] = obj

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the newest valid checkpoint into the registered objects (once); True if one was.

        Called by :meth:`epochs` / :meth:`batches`; call it yourself to restore earlier.
        """
        if self._resumed:
            return self.core.resumed_from is not None
        self._resumed = True
        tree = self.core.load()
        if tree is None:
            self.data_seed = torch.initial_seed() & ((1 << 63) - 1)
            return False
        objects = tree.get("objects", {})
        self._check_fits(objects)
        for name, obj in self.objects.items():
            obj.load_state_dict(objects[name])
        self.data_seed = int(tree.get("data", {}).get("seed", torch.initial_seed()))
        self.core.restore_rng(tree)
        return True

    def _check_fits(self, saved: Dict[str, Any]) -> None:
        """Refuse, before anything is changed, a checkpoint that does not fit the live objects."""
        missing = [n for n in self.objects if n not in saved]
        if missing:
            raise StateMismatchError(
                f"checkpoint {self.core.resumed_from.url} has no state for {missing} (it holds "
                f"{sorted(saved)}); register the same objects as the run that wrote it, or start a new run")
        for name, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                _check_module(name, obj, saved[name])
            elif isinstance(obj, torch.optim.Optimizer):
                _check_optimizer(name, obj, saved[name])

    # ------------------------------------------------------------------------------------ loops
    def epochs(self, n: int) -> Iterator[int]:
        """``for epoch in ckpt.epochs(n)``: yields the epochs still to run, saving as configured."""
        self.resume()
        core = self.core
        core.total_epochs = n
        if core.counters["epoch"] >= n:
            say(f"run '{core.store.run}' already completed {core.counters['epoch']} epoch(s); nothing to do")
            core.finished = True
            return
        core.install_signal_handlers()
        self._in_epochs = True
        try:
            while core.counters["epoch"] < n:
                core.trigger.start_epoch()
                yield core.counters["epoch"]
                if core.stopped:
                    return
                core.counters["epoch"] += 1
                core.counters["batch"] = 0
                decision = core.epoch_boundary(self._capture, last=core.counters["epoch"] >= n)
                if decision.stop:
                    return
        finally:
            self._in_epochs = False
            core.uninstall_signal_handlers()
            core.flush()

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``for batch in ckpt.batches(loader)``: the loader's batches from the saved position."""
        self.resume()
        core = self.core
        rl = self._resumable(loader)
        core.trigger.mid_epoch = rl.mid_epoch
        start = core.counters["batch"] if rl.mid_epoch else 0
        if not self._in_epochs:
            core.install_signal_handlers()
        try:
            for b, batch, n in rl.iterate(core.counters["epoch"], start):
                yield batch
                core.counters["batch"] = b + 1
                core.counters["step"] += 1
                core.counters["samples"] += n
                decision = core.step_boundary(self._capture, can_save=rl.mid_epoch)
                if decision.stop:
                    return
        finally:
            if not self._in_epochs:
                core.uninstall_signal_handlers()

    def _resumable(self, loader) -> ResumableLoader:
        key = id(loader)
        if key not in self._loaders:
            if not isinstance(loader, torch.utils.data.DataLoader):
                raise TypeError("ckpt.batches() takes a torch.utils.data.DataLoader")
            self._loaders[key] = ResumableLoader(loader, self.data_seed or 0)
        return self._loaders[key]

    # ------------------------------------------------------------------------------- save/state
    def _capture(self) -> Dict[str, Any]:
        return {"objects": {name: obj.state_dict() for name, obj in self.objects.items()},
                "data": {"seed": self.data_seed}}

    def state_dict(self) -> Dict[str, Any]:
        """The whole training state as it would be saved now (tensors are live references)."""
        return self.core.build_tree(self._capture)

    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``), e.g. after validation."""
        self.resume()
        self.core.save(self._capture, sync=sync, reason="by hand")

    def flush(self, timeout: Optional[float] = None) -> None:
        self.core.flush(timeout)

    def close(self) -> None:
        self.core.close()

    def __enter__(self) -> "DriveCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shape(x: Any) -> Any:
    return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


def _check_module(name: str, module: torch.nn.Module, saved: Dict[str, Any]) -> None:
    live = module.state_dict()
    for key, value in live.items():
        if key not in saved:
            raise StateMismatchError(f"{name}: parameter '{key}' of the model is not in the checkpoint "
                                     f"(it has {len(saved)} entries); the model's architecture differs. "
                                     "Nothing was loaded.")
        if _shape(saved[key]) != _shape(value):
            raise StateMismatchError(f"{name}: parameter '{key}' has shape {_shape(saved[key])} in the "
                                     f"checkpoint but {_shape(value)} in the model. Nothing was loaded.")
    extra = [k for k in saved if k not in live]
    if extra:
        raise StateMismatchError(f"{name}: the checkpoint has parameter '{extra[0]}' that the model "
                                 f"lacks ({len(extra)} in all); the architecture differs. Nothing was loaded.")


def _check_optimizer(name: str, opt: torch.optim.Optimizer, saved: Dict[str, Any]) -> None:
    groups = saved.get("param_groups", [])
    if len(groups) != len(opt.param_groups):
        raise StateMismatchError(f"{name}: the checkpoint has {len(groups)} parameter group(s), the "
                                 f"optimizer {len(opt.param_groups)}. Nothing was loaded.")
    params = []
    for i, (g_saved, g_live) in enumerate(zip(groups, opt.param_groups)):
        if len(g_saved["params"]) != len(g_live["params"]):
            raise StateMismatchError(f"{name}: parameter group {i} has {len(g_saved['params'])} "
                                     f"parameters in the checkpoint, {len(g_live['params'])} in the "
                                     "optimizer. Nothing was loaded.")
        params.extend(zip(g_saved["params"], g_live["params"]))
    state = saved.get("state", {})
    for saved_id, p in params:
        for k, v in (state.get(saved_id) or {}).items():
            if hasattr(v, "shape") and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise StateMismatchError(f"{name}: state '{k}' of parameter {saved_id} has shape "
                                         f"{tuple(v.shape)} in the checkpoint, the parameter "
                                         f"{tuple(p.shape)}. Nothing was loaded.")

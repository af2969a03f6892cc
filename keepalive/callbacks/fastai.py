"""``DriveCheckpoint`` for fastai: a ``Callback`` that makes re-running the same cell enough.

>>> learn.fit_one_cycle(20, 1e-3, cbs=DriveCheckpoint("/content/drive/MyDrive/runs/pets"))  # doctest: +SKIP
>>> learn.fine_tune(6, cbs=DriveCheckpoint("gs://bucket/runs/pets", every="10min"))        # doctest: +SKIP
>>> learn = vision_learner(dls, resnet34, cbs=DriveCheckpoint(path))                      # doctest: +SKIP

After a crash, a disconnect or the end of a session, run the same code again: the newest valid
checkpoint is restored and training continues where it stopped, bit for bit as if it had never been
interrupted.

What is saved and restored: the model, the optimizer (always, with its hyper-parameters and its freeze
state), the position (which fit call of the run - ``fine_tune`` makes two -, the epoch, the batch, and
fastai's ``train_iter`` / ``pct_train``, so one-cycle, flat-cos and SGDR schedules continue at exactly
the right point), the ``random.Random`` of every fastai ``DataLoader`` (the shuffling order) and the
global RNGs (python, numpy, torch CPU and CUDA), the mixed-precision ``GradScaler``, the ``Recorder``
history (losses, learning rates, metric values, the smoothed loss) with the ``ParamScheduler``'s
record, and the state of tracker callbacks (``SaveModelCallback``, ``EarlyStoppingCallback``,
``ReduceLROnPlateau``: best value, patience counter, last saved path).

Fit calls: each ``fit`` (``fit_one_cycle``, ``fit_flat_cos``, ...) seen by one ``DriveCheckpoint`` is
numbered; ``fine_tune`` is two of them (frozen, then unfrozen). On a re-run, fit calls that had
completed before the restart are skipped whole - no event reaches any callback, the weights and RNGs
are not touched - and the one the checkpoint is in resumes at its epoch (and batch). When the checkpoint
is the end of a fit, that fit is skipped and its end state restored where it would have returned, so
what follows (``fine_tune``'s ``unfreeze()``, the second fit) runs as it did the first time. ``lr_find``
is not counted.

Saving: ``every="epoch"`` (default), an int (optimizer steps) or a duration (``"10min"``); the end of
every fit is always saved (after the other callbacks' ``after_fit``: ``SaveModelCallback`` loading the
best weights is part of it). Inside an epoch (steps / durations, Ctrl-C, SIGTERM, the session deadline)
a checkpoint is taken when the training ``DataLoader`` can be positioned exactly: a fastai
``DataLoader``/``TfmdDL`` over an indexed dataset with the default ``get_idxs`` / ``shuffle_fn`` /
``sample`` / ``create_batches``, and no ``persistent_workers``. Resuming there recomputes the epoch's
order from the saved ``DataLoader`` RNG and starts at the saved batch without loading the skipped
items. With worker processes (``num_workers > 0``, fastai's default), each batch's worker RNGs are
seeded from the iterator's seed and the batch index (instead of once per worker), so augmentation in
workers is the same whether or not the epoch was resumed in its middle. Other loaders (``WeightedDL``,
torch ``DataLoader`` s, custom samplers): checkpoints at epoch ends only, and a save that falls due
inside an epoch happens at its end. Not restored mid-epoch: the accumulators of ``train_metrics``
(logged values of that one epoch only) and gradients being accumulated by ``GradientAccumulation``
(no mid-epoch save is taken while a partial accumulation is pending).

Also for exactness: fastai's lazily found batch layout (``dls.n_inp``, which fetches one augmented
item when the dataset does not say) is resolved at the start of every fit, so its RNG draws happen at
the same point in a resumed run. With mixed precision (``to_fp16``) the ``GradScaler`` is saved; note
that fastai's ``MixedPrecision`` always uses ``autocast("cuda")`` / ``GradScaler("cuda")``, which disable
themselves on a CPU (training then runs in fp32). ``SaveModelCallback`` writes its file under
``learn.path``: keep that on persistent storage (Drive), else the file it loads at the end of the fit may
be gone after a reset (a warning says so on resume).

Before the session's time limit (see ``keepalive status``) the callback saves and stops the fit with
``CancelFitException`` (``on_deadline="save_and_stop"``); later fit calls of the same cell are then
skipped, and ``cb.stopped`` is True. Ctrl-C / "Interrupt kernel" and SIGTERM finish the current step,
save, then interrupt.

A checkpoint that does not fit the learner (another architecture, other parameter groups) raises
:class:`~keepalive.errors.StateMismatchError` naming the first difference, before anything is changed.

How it hooks in: fastai runs every stage of its loop through ``Learner._with_events``; while attached,
the callback puts a small wrapper in front of it on that one learner (removed when detached). This is
how whole fit calls and finished epochs are skipped without any callback seeing them, and how saves
happen after every other callback of the step / epoch / fit has run, whatever their ``order``.
"""
from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import LRFinder, ParamScheduler
from fastai.callback.tracker import TrackerCallback
from fastai.data.load import DataLoader as FastaiDataLoader
from fastai.data.load import _FakeLoader
from fastai.learner import Learner
from fastai.optimizer import Optimizer, OptimWrapper
from fastai.torch_core import find_bs
from fastcore.basics import noop
from fastcore.foundation import L

from ..core import Checkpointer, RunViews, say
from ..dataorder import mix
from ..errors import StateMismatchError
from ._torch_data import _seed_worker_rngs
from .torch import _check_module, _check_optimizer

log = logging.getLogger("keepalive.fastai")

__all__ = ["DriveCheckpoint"]

FORMAT = 1


# ------------------------------------------------------------------------------- data positioning
def positionable(dl: Any) -> Optional[str]:
    """None when a fastai DataLoader can start an epoch at any batch exactly, else why not."""
    if not isinstance(dl, FastaiDataLoader):
        return f"the training loader is a {type(dl).__name__}, not a fastai DataLoader"
    if not dl.indexed or dl.bs is None or dl.n is None:
        return "the training loader is not an indexed, batched dataset of known length"
    for name in ("get_idxs", "shuffle_fn", "sample", "create_batches", "chunkify", "randomize"):
        if name in dl.__dict__:
            return f"the training loader has a custom {name}()"
        if getattr(type(dl), name) is not getattr(FastaiDataLoader, name):
            return f"{type(dl).__name__} overrides {name}()"
    if type(dl.fake_l) not in (_FakeLoader, _PositionedLoader):
        return f"the loader's iterator source is a {type(dl.fake_l).__name__}"
    if dl.fake_l.num_workers > 0 and dl.fake_l.persistent_workers:
        return "persistent_workers=True keeps worker state across epochs"
    return None


def _indices(dl: FastaiDataLoader, start: int, seed_batches: bool):
    """What ``dl.sample()`` yields, from batch ``start`` on (fastai's default ``sample`` for start 0).

    The indices are those ``get_idxs()`` computed for this epoch in the main process (from the
    loader's own RNG, restored on resume), so no skipped item is loaded. Batches go to workers
    round-robin from ``start`` (fastai's split, shifted), which the main process collects in order.
    In a worker process with ``seed_batches`` the RNGs are seeded per batch from the iterator's base
    seed and the batch index, so a batch's augmentation does not depend on which worker made it.
    """
    idxs = dl._DataLoader__idxs
    bs = dl.bs
    nw, offs = dl.num_workers, dl.offs  # 1, 0 in the main process; fastai's _wif sets them in workers
    base = None
    if seed_batches:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            base = info.seed - info.id  # the iterator's base seed
    for i in range(start * bs, len(idxs)):
        k = i // bs
        if (k - start) % nw != offs:
            continue
        if base is not None and i % bs == 0:
            _seed_worker_rngs(mix(base, k))
        yield idxs[i]


class _PositionedLoader(_FakeLoader):
    """fastai's ``_FakeLoader`` (the iterable torch's DataLoader iterates) starting at a batch.

    Put in place (``__class__``) for the duration of a fit; ``_ka_start`` is the first batch of the
    next iteration, ``_ka_seed_batches`` turns per-batch worker seeding on.
    """

    _ka_start = 0
    _ka_seed_batches = False

    def __iter__(self):
        return iter(self.d.create_batches(_indices(self.d, self._ka_start, self._ka_seed_batches)))


# ---------------------------------------------------------------------------------- state helpers
def _own(x: Any) -> Any:
    """A deep copy whose tensors own their memory (loaded tensors are views on the file buffer)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        return {k: _own(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_own(v) for v in x)
    return x


def _plain(x: Any) -> Any:
    """fastcore ``L`` and ``Path`` values as lists and strings, recursively (for the state tree)."""
    if isinstance(x, L):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _float_array(values: Any) -> np.ndarray:
    try:
        return np.asarray([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        return np.asarray([], dtype=np.float64)


def _dl_rngs(learn: Learner) -> List[Any]:
    return [dl.rng.getstate() if isinstance(getattr(dl, "rng", None), random.Random) else None
            for dl in learn.dls.loaders]


def _set_dl_rngs(learn: Learner, states: List[Any]) -> None:
    for dl, state in zip(learn.dls.loaders, states or []):
        if state is not None and isinstance(getattr(dl, "rng", None), random.Random):
            dl.rng.setstate(_as_tuple(state))


def _trackers(learn: Learner) -> Dict[str, TrackerCallback]:
    out: Dict[str, TrackerCallback] = {}
    for cb in learn.cbs:
        if isinstance(cb, TrackerCallback):
            name = type(cb).__name__
            key, n = name, 1
            while key in out:
                key, n = f"{name}#{n}", n + 1
            out[key] = cb
    return out


_TRACKER_ATTRS = ("best", "wait", "new_best", "last_saved_path")


class _FitState:
    """What one counted fit call needs while it runs."""

    def __init__(self, index: int, phase: Optional[int] = None):
        self.index = index
        self.phase = phase             # 1 / 2: fine_tune's frozen / unfrozen fit; None: another fit
        self.begun = False
        self.n_iter = 0
        self.skip_until = 0            # epochs below this are skipped (finished before the restart)
        self.resume_mid: Optional[Dict[str, Any]] = None  # mid-epoch resume to apply at before_train
        self.iter_offset = 0
        self.dl: Any = None            # the training loader of this fit
        self.positioned = False        # its iterator source is a _PositionedLoader for this fit
        self.why_not: Optional[str] = None
        self.epoch_torch: Optional[torch.Tensor] = None   # global torch RNG when the epoch's data began
        self.epoch_dl_rngs: List[Any] = []
        self.stopped = False
        self.epoch_ended = False       # the running epoch's work is done (after_validate reached)
        self.epochs_done = 0
        self.private_generator = False
        self.completed = False


class _EventsHook:
    """Stands in for ``Learner._with_events`` on one learner while a DriveCheckpoint is attached."""

    def __init__(self, cb: "DriveCheckpoint", learn: Learner, previous: Any):
        self.cb, self.learn, self.previous = cb, learn, previous

    def call(self, f, event_type, ex, final=noop):
        if self.previous is not None:
            return self.previous(f, event_type, ex, final)
        return type(self.learn)._with_events(self.learn, f, event_type, ex, final)

    def __call__(self, f, event_type, ex, final=noop):
        return self.cb._events(self.learn, self.call, f, event_type, ex, final)


# --------------------------------------------------------------------------------------- callback
class DriveCheckpoint(RunViews, Callback):  # RunViews: no epoch / step (a fastai callback reads the learner's)
    """Checkpoint a fastai training to a local folder, a mounted Drive or any fsspec URL (see module).

    Args:
        path: the run folder (``/content/drive/MyDrive/runs/x``, ``gs://b/runs/x``, ...). Default:
            ``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``, plus ``run``.
        every: ``"epoch"`` (default), an int (optimizer steps) or a duration (``"10min"``).
        keep: how many recent checkpoints stay (default 3); ``keep_every``: also keep every Nth.
        on_deadline: ``"save_and_stop"`` (default), ``"save"`` or ``"ignore"`` when the session's time
            limit approaches.
        takeover: take the run over from another live session that holds its writer lease.
        background: write checkpoints in a background thread (default).
        spool: ``"auto"`` (default) commits remote / Drive checkpoints to a local spool first and
            uploads them in the background (and switches to it when a local destination fails);
            ``True`` / ``False`` force it. ``flush_timeout``: how long the end of training waits for
            uploads (default 120 s). ``drive_flush``: on Colab, ``drive.flush_and_unmount()`` at the end.
    """

    order = 95  # only before_train / before_batch work is done in callback events; saves run after all
    _stateattrs = ("_core", "_fit", "_tree")  # not pickled (learn.export()): rebuilt on demand

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, every: Union[str, int, None] = "epoch",
                 keep: Optional[int] = 3, keep_every: Optional[int] = None,
                 on_deadline: str = "save_and_stop", deadline_margin: Union[str, float, None] = None,
                 run: Optional[str] = None, takeover: bool = False, background: bool = True,
                 storage_options: Optional[dict] = None, quiet: bool = False,
                 spool: Union[str, bool] = "auto", flush_timeout: Optional[float] = None,
                 drive_flush: Optional[bool] = None):
        super().__init__()
        self._config = dict(path=path, run=run, every=every, keep=keep, keep_every=keep_every,
                            on_deadline=on_deadline, deadline_margin=deadline_margin, takeover=takeover,
                            background=background, storage_options=storage_options, quiet=quiet,
                            spool=spool, flush_timeout=flush_timeout, drive_flush=drive_flush)
        self._n_fits = 0
        self._loaded = False
        self._cell: Any = None       # the notebook cell (execution count) of the last counted fit
        self._cell_start = 1         # the number of that cell's first fit
        self._init_state()
        self.core  # create now: a bad path or every= fails here, not in the middle of fit()

    def _init_state(self) -> None:
        super()._init_state()
        self._core: Optional[Checkpointer] = None
        self._fit: Optional[_FitState] = None
        self._tree: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------------------ properties
    @property
    def core(self) -> Checkpointer:
        if self._core is None:
            self._core = Checkpointer(framework="fastai", **self._config)
        return self._core






    def __repr__(self) -> str:
        return f"DriveCheckpoint({self.core.url!r})"

    # ---------------------------------------------------------------------------- attach/detach
    @property
    def learn(self) -> Optional[Learner]:
        return self.__dict__.get("_learn")

    @learn.setter
    def learn(self, value: Optional[Learner]) -> None:
        old = self.__dict__.get("_learn")
        if old is value:
            return
        if old is not None:
            self._unhook(old)
        self.__dict__["_learn"] = value
        if value is not None:
            self._hook(value)

    def _hook(self, learn: Learner) -> None:
        if not callable(getattr(type(learn), "_with_events", None)):
            raise TypeError(f"keepalive's fastai DriveCheckpoint needs Learner._with_events (fastai 2.x); "
                            f"{type(learn).__name__} has none")
        learn.__dict__["_with_events"] = _EventsHook(self, learn, learn.__dict__.get("_with_events"))

    def _unhook(self, learn: Learner) -> None:
        hook = learn.__dict__.get("_with_events")
        if isinstance(hook, _EventsHook) and hook.cb is self:
            if hook.previous is None:
                del learn.__dict__["_with_events"]
            else:
                learn.__dict__["_with_events"] = hook.previous

    # ---------------------------------------------------------------------------- event routing
    def _events(self, learn: Learner, call: Callable, f, event_type: str, ex, final) -> Any:
        if event_type == "fit":
            return self._run_fit(learn, call, f, ex, final)
        st = self._fit
        if st is None:
            return call(f, event_type, ex, final)
        if event_type == "epoch":
            if learn.epoch < st.skip_until:
                return None  # finished before the restart: no event, nothing runs
            return call(f, "epoch", ex, lambda: (self._epoch_end(learn, st), final()))
        if event_type == "batch" and learn.training:
            return call(f, "batch", ex, lambda: (self._step_end(learn, st), final()))
        return call(f, event_type, ex, final)

    def _run_fit(self, learn: Learner, call: Callable, f, ex, final) -> Any:
        if self._fit is not None or any(isinstance(cb, LRFinder) for cb in learn.cbs):
            return call(f, "fit", ex, final)  # lr_find (restores the weights itself) or nested
        core = self.core
        if core.stopped:
            say("fit skipped: training stopped before the session's end. In a new session run the same "
                "code again to continue.")
            return None
        # fastai finds the batch layout lazily, fetching (and augmenting: RNG draws) one item the first
        # time it is asked; have that happen now, at the same point in every run, not after a restore.
        try:
            getattr(learn.dls, "n_inp", None)
        except Exception as exc:  # noqa: BLE001 - fastai asks again (and reports) at the first batch
            log.debug("dls.n_inp: %s", exc)
        tree = self._load(learn)
        self._n_fits += 1
        k = self._n_fits
        cell = _cell_id()
        if k == 1 or cell != self._cell:
            self._cell, self._cell_start = cell, k
        pos = (tree or {}).get("fastai", {}).get("position") if tree is not None else None
        if pos is not None and (pos["fit"] > k or (pos["fit"] == k and pos["done"])):
            if pos["fit"] == k:
                self._tree = None
                self._restore_fit_end(learn, tree)
                core.finished = pos.get("phase") != 1
                n = pos["n_epoch"]
                say(f"fit {k}{_phase_words(pos.get('phase'), f'{n} epochs')} had completed before the "
                    "restart: skipped, its end state restored. To train again from here, use another run "
                    "(path or run=).")
            else:
                say(f"fit {k}{_phase_words(_fine_tune_phase(learn))} had completed before the restart (the "
                    f"checkpoint is in fit {pos['fit']}): skipped")
            return None
        resume = None
        if pos is not None and pos["fit"] == k:
            resume, self._tree = tree, None
        st = _FitState(k, _fine_tune_phase(learn))
        self._fit = st

        def do_fit():  # runs after every callback's before_fit
            self._begin(learn, st, resume)
            f()

        try:
            return call(do_fit, "fit", ex, lambda: (self._fit_end(learn, st), final()))
        finally:
            self._fit = None
            self._teardown(learn, st)
            if not st.completed:
                # Interrupted (Ctrl-C, an error): running the cell again starts over from its first
                # fit, and resumes from the newest checkpoint as a new session would.
                self._n_fits, self._loaded, self._tree = self._cell_start - 1, False, None

    # ------------------------------------------------------------------------------------ resume
    def _load(self, learn: Learner) -> Optional[Dict[str, Any]]:
        if self._loaded:
            return self._tree
        tree = self.core.load(describe=_describe)
        if tree is not None:
            meta = tree.get("keepalive", {})
            if meta.get("framework") != "fastai":
                raise StateMismatchError(
                    f"checkpoint {self.core.resumed_from.url} was written by keepalive's "
                    f"{meta.get('framework')!r} adapter, not the fastai one; use another run (path or run=)")
            self._check_fits(learn, tree)
        self._tree = tree
        self._loaded = True
        return tree

    def _check_fits(self, learn: Learner, tree: Dict[str, Any]) -> None:
        """Refuse, before anything is changed, a checkpoint that does not fit the learner."""
        objects = tree.get("objects", {})
        where = self.core.resumed_from.url if self.core.resumed_from else self.core.url
        if "model" not in objects or "optimizer" not in objects:
            raise StateMismatchError(f"checkpoint {where} holds no model/optimizer state")
        _check_module("model", learn.model, objects["model"])
        opt, saved = learn.opt, objects["optimizer"]
        if isinstance(opt, Optimizer):
            _check_fastai_optimizer(opt, saved)
        elif isinstance(opt, OptimWrapper):
            _check_optimizer("optimizer", opt.opt, saved)

    def _load_objects(self, learn: Learner, tree: Dict[str, Any]) -> None:
        objects = tree["objects"]
        learn.model.load_state_dict(objects["model"])
        opt, saved = learn.opt, objects["optimizer"]
        if isinstance(opt, Optimizer):
            params = [p for p, *_ in opt.all_params()]
            state = [{k: (v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else _own(v))
                      for k, v in s.items()} for s, p in zip(saved["state"], params)]
            opt.load_state_dict({"state": state, "hypers": L([dict(h) for h in saved["hypers"]])})
        else:
            opt.load_state_dict(_own(saved))
        frozen = tree["fastai"].get("frozen_idx")
        if frozen is not None and getattr(opt, "frozen_idx", 0) != frozen and hasattr(opt, "freeze_to"):
            opt.freeze_to(frozen)
        scaler = getattr(learn, "scaler", None)
        if scaler is not None and objects.get("scaler"):
            scaler.load_state_dict(objects["scaler"])

    def _restore_callbacks(self, learn: Learner, fa: Dict[str, Any], in_fit: bool = True) -> None:
        rec, saved = getattr(learn, "recorder", None), fa.get("recorder")
        if rec is not None and saved:
            rec.lrs = list(saved["lrs"])
            rec.iters = [int(i) for i in saved["iters"]]
            rec.losses = list(_own(saved["losses"]).unbind(0)) if len(saved["losses"]) else []
            rec.values = [L(v) for v in saved["values"]]
            if saved.get("metric_names") is not None:
                rec.metric_names = L(saved["metric_names"])
            rec.smooth_loss.count = int(saved["smooth_count"])
            rec.smooth_loss.val = _own(saved["smooth_val"])
            if saved.get("smooth_loss") is not None:
                learn.smooth_loss = _own(saved["smooth_loss"])
            if saved.get("hps") is not None:
                rec.hps = {k: list(v) for k, v in saved["hps"].items()}
        live = _trackers(learn)
        for key, state in (fa.get("trackers") or {}).items():
            cb = live.get(key)
            if cb is None:
                continue
            for attr, value in state.items():
                cb.__dict__[attr] = Path(value) if attr == "last_saved_path" and value is not None else _own(value)
            saved_path = cb.__dict__.get("last_saved_path")
            if in_fit and saved_path is not None and not Path(saved_path).exists():
                say(f"warning: {type(cb).__name__}'s file {saved_path} did not survive the restart (keep "
                    "learn.path on persistent storage, e.g. Drive); its best value is restored, but the "
                    "file it loads at the end of the fit is rewritten only by a better epoch")
        hps = fa.get("scheduler_hps")
        if hps is not None:
            for cb in learn.cbs:
                if isinstance(cb, ParamScheduler) and getattr(cb, "hps", None) is not None \
                        and set(cb.hps) == set(hps):
                    cb.hps = {k: list(v) for k, v in hps.items()}

    def _restore_fit_end(self, learn: Learner, tree: Dict[str, Any]) -> None:
        """Restore a checkpoint taken at the end of a fit, in place of running that fit."""
        fa = tree["fastai"]
        self._load_objects(learn, tree)
        self._restore_callbacks(learn, fa, in_fit=False)
        _set_dl_rngs(learn, fa.get("dl_rngs"))
        self.core.restore_rng(tree)

    def _begin(self, learn: Learner, st: _FitState, resume: Optional[Dict[str, Any]]) -> None:
        """Start of a counted fit, after every callback's before_fit: position data, restore state."""
        core = self.core
        st.begun = True
        dl = st.dl = learn.dls.train
        st.n_iter = len(dl)
        st.why_not = positionable(dl)
        if st.why_not is None:
            fl = dl.fake_l
            fl.__class__ = _PositionedLoader
            fl._ka_start = 0
            fl._ka_seed_batches = fl.num_workers > 0
            st.positioned = True
        else:
            log.info("keepalive: %s: checkpoints at epoch ends only", st.why_not)
        core.trigger.mid_epoch = st.positioned
        if resume is not None:
            self._restore_in_fit(learn, st, resume)
            mbar = getattr(getattr(learn, "progress", None), "mbar", None)
            if st.skip_until and mbar is not None:
                try:  # fastprogress' bar must see 0 first; the skipped epochs never reach it
                    mbar.update(0)
                except Exception as exc:  # noqa: BLE001 - a display problem must not stop training
                    log.debug("progress bar: %s", exc)
        core.total_epochs = core.counters["epoch"] - st.skip_until + learn.n_epoch
        core.install_signal_handlers()

    def _restore_in_fit(self, learn: Learner, st: _FitState, tree: Dict[str, Any]) -> None:
        fa = tree["fastai"]
        pos = fa["position"]
        if pos["n_epoch"] != learn.n_epoch:
            say(f"warning: the checkpoint was written by a fit of {pos['n_epoch']} epochs, this one has "
                f"{learn.n_epoch}; its schedule continues at epoch {pos['epoch']} of {learn.n_epoch}")
        if pos["batch"] and pos["n_iter"] != st.n_iter:
            raise StateMismatchError(
                f"the checkpoint is inside an epoch of {pos['n_iter']} batches, the training data now has "
                f"{st.n_iter} per epoch: the data or the batch size changed. Nothing was loaded.")
        if pos["batch"] and not st.positioned:
            raise StateMismatchError(
                f"the checkpoint is inside an epoch, but this training loader cannot be positioned "
                f"({st.why_not}). Nothing was loaded.")
        self._load_objects(learn, tree)
        self._restore_callbacks(learn, fa)
        learn.train_iter = int(pos["train_iter"])
        st.skip_until = int(pos["epoch"])
        st.epochs_done = int(pos["epoch"])
        if pos["batch"]:
            st.resume_mid = {"epoch": int(pos["epoch"]), "batch": int(pos["batch"]),
                             "pct_train": float(pos["pct_train"]), "tree": tree}
        else:
            _set_dl_rngs(learn, fa.get("dl_rngs"))
            self.core.restore_rng(tree)
        where = f"epoch {pos['epoch']}/{learn.n_epoch}" + (f", batch {pos['batch']}/{pos['n_iter']}"
                                                          if pos["batch"] else "")
        say(f"fit {st.index}{_phase_words(st.phase)} continues at {where}")

    # ------------------------------------------------------------------------- callback events
    def before_epoch(self) -> None:
        st = self._fit
        if st is not None and st.begun:
            st.epoch_ended = False
            self.core.trigger.start_epoch()

    def before_train(self) -> None:
        st = self._fit
        if st is None or not st.begun:
            return
        learn = self.learn
        mid = st.resume_mid
        if mid is not None and learn.epoch == mid["epoch"]:
            st.resume_mid = None
            fa = mid["tree"]["fastai"]
            start = fa["epoch_start"]
            learn.pct_train = mid["pct_train"]
            _set_dl_rngs(learn, start["dl_rngs"])  # the epoch's order, recomputed by get_idxs()
            # The iterator draws its (worker) base seed from the global torch RNG as the epoch began;
            # give it a generator in that state, so the base seed is the same and the global RNGs
            # (restored to the saved step) are not consumed.
            g = torch.Generator()
            g.set_state(start["torch"].clone())
            st.dl.fake_l.generator = g
            st.private_generator = True
            st.dl.fake_l._ka_start = mid["batch"]
            st.iter_offset = mid["batch"]
            self.core.restore_rng(mid["tree"])
            st.epoch_torch = start["torch"].clone()
            st.epoch_dl_rngs = _as_tuple(start["dl_rngs"])
            return
        st.epoch_torch = torch.get_rng_state()
        st.epoch_dl_rngs = _dl_rngs(learn)

    def before_batch(self) -> None:
        st = self._fit
        if st is not None and st.iter_offset and self.learn.training:
            self.learn.iter += st.iter_offset

    def after_train(self) -> None:
        st = self._fit
        if st is None:
            return
        st.iter_offset = 0
        if st.positioned:
            st.dl.fake_l._ka_start = 0
        if st.private_generator:
            st.dl.fake_l.__dict__.pop("generator", None)
            st.private_generator = False

    def after_validate(self) -> None:
        st = self._fit
        if st is not None and st.begun and self.learn.epoch >= st.skip_until:
            st.epoch_ended = True

    # ------------------------------------------------------------------------------- boundaries
    def _step_end(self, learn: Learner, st: _FitState) -> None:
        core = self.core
        c = core.counters
        c["step"] += 1
        c["batch"] = learn.iter + 1
        c["samples"] += find_bs(learn.yb) if len(learn.yb) else find_bs(learn.xb)
        can_save = st.positioned
        ga = getattr(learn, "gradient_accumulation", None)
        if ga is not None and getattr(ga, "count", 0):
            can_save = False  # gradients of a partial accumulation are not part of the state
        decision = core.step_boundary(lambda: self._capture(learn, st, "step"), can_save=can_save)
        if decision.stop:
            st.stopped = True
            raise CancelFitException()

    def _epoch_end(self, learn: Learner, st: _FitState) -> None:
        core = self.core
        core.counters["epoch"] += 1
        core.counters["batch"] = 0
        st.epoch_ended = False
        st.epochs_done = learn.epoch + 1
        if learn.epoch + 1 >= learn.n_epoch:
            return  # the fit's end is saved in _fit_end, after the other callbacks' after_fit
        decision = core.epoch_boundary(lambda: self._capture(learn, st, "epoch"))
        if decision.stop:
            st.stopped = True
            raise CancelFitException()

    def _fit_end(self, learn: Learner, st: _FitState) -> None:
        st.completed = True  # the fit ended through fastai's own path (normally or cancelled)
        if not st.begun or st.stopped:
            return
        core = self.core
        if st.epoch_ended:  # an after_epoch callback (EarlyStopping) ended the fit before _epoch_end
            core.counters["epoch"] += 1
            core.counters["batch"] = 0
            st.epochs_done = learn.epoch + 1
        # A fit's end is the end of the training unless fine_tune's second fit follows.
        decision = core.end_of_stage(lambda: self._capture(learn, st, "fit"), finished=st.phase != 1,
                                     reason=f"end of fit {st.index}{_phase_words(st.phase)}")
        if decision.stop:
            st.stopped = True

    def _teardown(self, learn: Learner, st: _FitState) -> None:
        dl = st.dl
        if dl is None:
            dl = learn.dls.train
        if st.positioned and isinstance(dl.fake_l, _PositionedLoader):
            for name in ("_ka_start", "_ka_seed_batches"):
                dl.fake_l.__dict__.pop(name, None)
            dl.fake_l.__class__ = _FakeLoader
        if st.private_generator:
            dl.fake_l.__dict__.pop("generator", None)
        if self._core is not None:
            self._core.close()  # waits for the write in flight, releases the writer lease

    # ---------------------------------------------------------------------------------- capture
    def _capture(self, learn: Learner, st: _FitState, kind: str) -> Dict[str, Any]:
        opt = learn.opt
        if isinstance(opt, Optimizer):
            sd = opt.state_dict()
            opt_state = {"state": list(sd["state"]), "hypers": [dict(h) for h in sd["hypers"]]}
        else:
            opt_state = opt.state_dict()
        objects = {"model": learn.model.state_dict(), "optimizer": _plain(opt_state)}
        scaler = getattr(learn, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler.state_dict()
        if kind == "step":
            epoch, batch = learn.epoch, learn.iter + 1
        elif kind == "epoch":
            epoch, batch = learn.epoch + 1, 0
        else:
            epoch, batch = st.epochs_done, 0
        fa: Dict[str, Any] = {
            "format": FORMAT,
            "position": {"fit": st.index, "phase": st.phase, "done": kind == "fit", "epoch": epoch,
                         "batch": batch,
                         "n_epoch": int(learn.n_epoch), "n_iter": st.n_iter,
                         "train_iter": int(getattr(learn, "train_iter", 0)),
                         "pct_train": float(getattr(learn, "pct_train", 0.0))},
            "frozen_idx": getattr(opt, "frozen_idx", None),
            "dl_rngs": _dl_rngs(learn),
            "recorder": _capture_recorder(learn),
            "trackers": {key: {a: _plain(cb.__dict__[a]) for a in _TRACKER_ATTRS if a in cb.__dict__}
                         for key, cb in _trackers(learn).items()},
        }
        for cb in learn.cbs:
            if isinstance(cb, ParamScheduler) and getattr(cb, "hps", None) is not None:
                fa["scheduler_hps"] = {k: _float_array(v) for k, v in cb.hps.items()}
                break
        if kind == "step":
            fa["epoch_start"] = {"torch": st.epoch_torch, "dl_rngs": st.epoch_dl_rngs}
        return {"objects": objects, "fastai": fa}

    # ------------------------------------------------------------------------------- by hand
    def save(self, *, sync: bool = False) -> None:
        """Save now (only at an epoch boundary or inside a running fit's step boundary is it exact)."""
        st = self._fit
        if st is None or self.learn is None:
            raise RuntimeError("DriveCheckpoint.save() works while a fit runs (e.g. from a callback)")
        self.core.save(lambda: self._capture(self.learn, st, "epoch"), sync=sync, reason="by hand")

    def flush(self, timeout: Optional[float] = None) -> None:
        self.core.flush(timeout)

    def close(self) -> None:
        self.core.close()


def _capture_recorder(learn: Learner) -> Optional[Dict[str, Any]]:
    rec = getattr(learn, "recorder", None)
    if rec is None or not hasattr(rec, "lrs"):
        return None
    losses = [torch.as_tensor(v).detach().reshape(()).cpu() for v in rec.losses]
    out = {
        "lrs": _float_array(rec.lrs),
        "iters": [int(i) for i in rec.iters],
        "losses": torch.stack(losses) if losses else torch.zeros(0),
        "values": [_plain(list(v)) for v in rec.values],
        "metric_names": _plain(list(getattr(rec, "metric_names", []))) or None,
        "smooth_count": int(rec.smooth_loss.count),
        "smooth_val": torch.as_tensor(rec.smooth_loss.val).detach().clone(),
        "smooth_loss": (torch.as_tensor(learn.smooth_loss).detach().clone()
                        if getattr(learn, "smooth_loss", None) is not None else None),
    }
    hps = getattr(rec, "hps", None)
    if isinstance(hps, dict):
        out["hps"] = {k: _float_array(v) for k, v in hps.items()}
    return out


def _check_fastai_optimizer(opt: Optimizer, saved: Dict[str, Any]) -> None:
    groups, state = saved.get("hypers", []), saved.get("state", [])
    if len(groups) != len(opt.param_lists):
        raise StateMismatchError(f"optimizer: the checkpoint has {len(groups)} parameter group(s), the "
                                 f"learner {len(opt.param_lists)} (another splitter or model). Nothing "
                                 "was loaded.")
    params = [p for p, *_ in opt.all_params()]
    if len(state) != len(params):
        raise StateMismatchError(f"optimizer: the checkpoint has state for {len(state)} parameters, the "
                                 f"learner has {len(params)}. Nothing was loaded.")
    for i, (s, p) in enumerate(zip(state, params)):
        for k, v in (s or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise StateMismatchError(f"optimizer: state '{k}' of parameter {i} has shape "
                                         f"{tuple(v.shape)} in the checkpoint, the parameter "
                                         f"{tuple(p.shape)}. Nothing was loaded.")


def _cell_id() -> Any:
    """The running notebook cell (IPython's execution count), None outside IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001
        return None
    return getattr(shell, "execution_count", None) if shell is not None else None


def _fine_tune_phase(learn: Learner) -> Optional[int]:
    """1 or 2 when this fit is called by ``learn.fine_tune`` (frozen / unfrozen fit), else None."""
    code = getattr(getattr(Learner, "fine_tune", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code and frame.f_locals.get("self") is learn:
            return 1 if getattr(learn.opt, "frozen_idx", 0) > 0 else 2
        frame = frame.f_back
    return None


def _phase_words(phase: Optional[int], more: str = "") -> str:
    words = [w for w in ({1: "fine_tune's frozen fit", 2: "fine_tune's unfrozen fit"}.get(phase), more) if w]
    return f" ({', '.join(words)})" if words else ""


def _describe(tree: Dict[str, Any]) -> str:
    pos = (tree.get("fastai") or {}).get("position")
    if not pos:
        return ""
    if pos.get("done"):
        return f"end of fit {pos['fit']}{_phase_words(pos.get('phase'))}"
    where = f"fit {pos['fit']}{_phase_words(pos.get('phase'))}, epoch {pos['epoch']}/{pos['n_epoch']}"
    if pos.get("batch"):
        where += f", batch {pos['batch']}/{pos['n_iter']}"
    return where

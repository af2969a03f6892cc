"""The framework-neutral checkpointer every adapter is built on.

An adapter (torch loop, Keras callback, fastai callback) does three things only: it says where the
step and epoch boundaries are (:meth:`Checkpointer.advance`, :meth:`Checkpointer.end_epoch`,
:meth:`Checkpointer.end_stage`), it gives a ``capture()`` function returning its objects' state as a
tree, and it restores such a tree into its objects (:mod:`keepalive.adapter` has the base class that
gives every adapter the same ``save`` / ``flush`` / ``close`` / views). Everything else lives here:
the counters and their arithmetic, where checkpoints go,
when to save (:mod:`keepalive.trigger`), asynchronous writes (:mod:`keepalive.writer`), resuming from
the newest valid checkpoint with fallback (:mod:`keepalive.resume`), RNG capture
(:mod:`keepalive.rng`), deferred interrupts (Ctrl-C / "Interrupt kernel" and SIGTERM save at the next
step boundary, then take effect), and the one-line messages users see.

The tree a checkpoint holds::

    {"keepalive": {"format": 1, "framework": "torch"},
     "counters":  {"epoch": 3, "step": 1200, "batch": 0, "samples": 153600},
     "objects":   {"model": {...state_dict...}, "optimizer": {...}, ...},   # adapter's capture()
     "data":      {...sampler seed / position...},                          # adapter's capture()
     "rng":       {"python": ..., "numpy": ..., "torch_cpu": ..., ...},
     "extras":    {...user values...}}
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from . import distributed as _distributed
from . import notebook, report, rng
from . import progress as _progress
from . import session as _session
from . import spool as _spool
from .config import CheckpointConfig
from .runs import Run, record_run
from .store import CheckpointInfo, CheckpointStore
from .trigger import Decision, SaveTrigger
from .units import format_duration
from .writer import AsyncWriter

log = logging.getLogger("keepalive")

STATE_FORMAT = 1
Capture = Callable[[], Dict[str, Any]]

_ACTIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def default_dir() -> str:
    """``$KEEPALIVE_DIR``, else the mounted Drive, else ``./keepalive-checkpoints``."""
    return _session.default_checkpoint_dir()


#: unnamed checkpointers (no path, no run=) created so far per (cell execution or script, folder)
_UNNAMED: Dict[tuple, int] = {}


def resolve_run_url(path: Union[str, "os.PathLike[str]", None], run: Optional[str] = None) -> str:
    """The run folder: ``path`` itself, or ``<default dir>/<run or 'default'>`` without a path.

    Without a path and a name, the n-th checkpointer created by one notebook cell execution (or one
    script) gets ``default-<n>`` from the second on: a K-fold loop gets one run per fold, and running
    the same cell again after a reset finds each fold's own run in the same order.
    """
    if path is None:
        base = default_dir().rstrip("/")
        if run is None:
            key = (notebook.current_cell_key() or "script", base)
            n = _UNNAMED[key] = _UNNAMED.get(key, 0) + 1
            run = "default" if n == 1 else f"default-{n}"
            if n == 2:
                report.warn("a second DriveCheckpoint() without a path or run= in this cell: it writes "
                            "run 'default-2' (then default-3, ...), one per training, in creation order. "
                            "Name each one, e.g. run=f'fold{k}', to make that explicit.")
        return f"{base}/{run}"
    return os.fspath(path)


def active_checkpointers() -> List["Checkpointer"]:
    """The checkpointers alive in this process (the magics use it to find the run a cell trained)."""
    return list(_ACTIVE)


class Checkpointer:
    """Where, when and how a training run is checkpointed and resumed (see module docstring).

    ``Checkpointer(path, every=..., keep=..., ...)`` or ``Checkpointer(config=CheckpointConfig(...))``:
    the options are those of :class:`keepalive.config.CheckpointConfig`.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *,
                 config: Optional[CheckpointConfig] = None, framework: str = "generic",
                 **options: Any):
        cfg = CheckpointConfig.strict(path, config, options, "Checkpointer")
        self.config = cfg
        path, run, every, keep, keep_every = cfg.path, cfg.run, cfg.every, cfg.keep, cfg.keep_every
        on_deadline, deadline_margin, takeover = cfg.on_deadline, cfg.deadline_margin, cfg.takeover
        background, storage_options, quiet = cfg.background, cfg.storage_options, cfg.quiet
        remaining_fn, spool, flush_timeout = cfg.remaining_fn, cfg.spool, cfg.flush_timeout
        drive_flush = cfg.drive_flush
        self.url = resolve_run_url(path, run)
        self.store = CheckpointStore(self.url, keep=keep, keep_every=keep_every,
                                     storage_options=storage_options)
        self.trigger = SaveTrigger(every, on_deadline=on_deadline, margin=deadline_margin,
                                   remaining_fn=remaining_fn)
        #: what the writer commits through: the store itself, or a local spool whose checkpoints a
        #: background thread uploads (remote URLs, Drive, failing destinations: keepalive/spool.py)
        self.sink = _spool.SpooledStore(self.store, spool, storage_options=storage_options,
                                        flush_timeout=flush_timeout, drive_flush=drive_flush,
                                        quiet=quiet, remaining_fn=self.trigger.remaining,
                                        on_durable=self.trigger.record_save)
        self.writer = AsyncWriter(self.sink, background=background)
        self.writer.on_commit.append(self._committed)
        if not quiet:
            self.writer.progress_factory = _progress.upload_progress(self.url)
        self.framework = framework
        self.takeover = takeover
        self.quiet = quiet
        self.counters: Dict[str, int] = {"epoch": 0, "step": 0, "batch": 0, "samples": 0}
        self.extras: Dict[str, Any] = {}
        self.metadata: Dict[str, Any] = {"framework": framework}
        self.resumed_from: Optional[CheckpointInfo] = None
        self.finished = False
        self.stopped = False
        self.stop_reason: Optional[str] = None
        self._opened = False
        self._last_saved_step: Optional[int] = None
        self._pending_signal: Optional[int] = None
        self._deferred_save = False
        self._reserved = False
        self._deferred_stop: Optional[str] = None
        self._deferred_reason: Optional[str] = None
        self._pid = os.getpid()
        #: why the adapter's loop cannot be saved inside an epoch (said when an interrupt comes)
        self.mid_epoch_obstacle: Optional[str] = None
        self._old_handlers: Dict[int, Any] = {}
        self._in_loop = False
        #: the number of epochs, when the adapter knows it (for the ETA next to the session time)
        self.total_epochs: Optional[int] = None
        # DDP (issue 16): the torch.distributed process group (looked up at each use; one rank without)
        self.group = _distributed.GROUP
        #: FSDP2 (issue 16): the adapter's sharded objects (:class:`keepalive.dcp.ShardedObjects`, set
        #: by the torch adapter when a registered object holds DTensor state), saved through DCP
        self.sharded: Any = None
        self._sharded_thread: Optional[threading.Thread] = None  # its save in flight (the commit)
        self._sharded_error: Optional[BaseException] = None
        # only rank 0 shows progress bars (every rank runs the same loop)
        self.training_progress = (None if quiet or not self.group.is_main
                                  else _progress.TrainingProgress(self))
        self._capture_context()
        _ACTIVE.add(self)

    # -------------------------------------------------------------------------------- context
    def _capture_context(self) -> None:
        """Record what produced this run: the notebook cell, or the script."""
        ctx = notebook.capture_context() or notebook.script_context()
        if ctx:
            self.metadata["context"] = ctx

    def _refresh_context(self) -> None:
        """A save from a training loop: when the loop runs in another notebook cell than the one
        that created this checkpointer (``ckpt = DriveCheckpoint(...)`` in one cell, the loop in the
        next), record the loop's cell as the training cell (the creating one becomes a setup cell)."""
        try:
            key = notebook.current_cell_key()
            if key is not None and key != (self.metadata.get("context") or {}).get("cell_key"):
                ctx = notebook.capture_context()
                if ctx:
                    self.metadata["context"] = ctx
        except Exception as exc:  # noqa: BLE001 - context is informative, never fatal
            log.debug("could not refresh the notebook context: %s", exc)

    # ------------------------------------------------------------------------------- messages
    def say(self, message: str) -> None:
        """News for the user, silenced by ``quiet=True``; under DDP said by rank 0 only (issue 16)."""
        report.say(message, quiet=self.quiet or not self.group.is_main)

    def warn(self, message: str, key: Optional[str] = None) -> None:
        """A problem the user must see (not silenced by ``quiet``); once per ``key`` and run."""
        report.warn(message, key=None if key is None else f"{self.url}:{key}", quiet=self.quiet)

    # --------------------------------------------------------------------------------- resume
    def load(self, describe: Optional[Callable[[Dict[str, Any]], str]] = None,
             check: Optional[Callable[[Dict[str, Any]], None]] = None) -> Optional[Dict[str, Any]]:
        """The newest valid checkpoint's state tree (falling back past corrupt ones), or None.

        ``check(tree)`` runs first and may raise (e.g. ``StateMismatchError``): then nothing is changed
        here either, and calling ``load`` again after fixing the objects tries again. Otherwise sets the
        counters and extras from the tree and says in one line what is resumed; ``describe`` (optional)
        returns adapter-specific words for that line from the tree (e.g. what is restored).
        """
        # the run = its destination and this machine's spool of it: the newest valid checkpoint of both
        found = Run(self.store, spool=self.sink.local_spool()).load_newest(quiet=self.quiet)
        # Take the writer lease now, at the start of training: a second session on the same run
        # learns it at once instead of after its first epoch.
        self._open()
        found = self._localize(found)  # DDP (issue 16): every rank the same checkpoint, its own part
        if found is None:
            return None
        info, tree, previous = found
        if check is not None:
            self.resumed_from = info  # for the check's messages; reset if it refuses
            try:
                check(tree)
            except BaseException:
                self.resumed_from = None
                raise
        self.resumed_from = info
        counters = tree.get("counters", {})
        for k in self.counters:
            self.counters[k] = int(counters.get(k, 0))
        self.extras.update(tree.get("extras") or {})
        self._last_saved_step = self.counters["step"]
        self.trigger.saved()
        if not self.quiet:
            age = time.time() - (info.created or time.time())
            redone = ""
            if previous and previous.get("step") is not None and previous["step"] > self.counters["step"]:
                redone = f"; about {previous['step'] - self.counters['step']} step(s) will be redone"
            had_finished = (info.manifest or {}).get("metadata", {}).get("finished")
            finished = " (this run had finished)" if had_finished else ""
            detail = ""
            if describe is not None:
                try:
                    detail = describe(tree) or ""
                except Exception as exc:  # noqa: BLE001 - words only: never stop a resume for them
                    log.debug("describe() failed: %s", exc)
            self.say(f"resuming run '{self.store.run}' from {info.name}: epoch {self.counters['epoch']}, "
                f"step {self.counters['step']}, saved {format_duration(age)} ago{redone}{finished}"
                f"{'; ' + detail if detail else ''}")
        return tree

    def _localize(self, found: Any) -> Any:
        """DDP (issue 16): check that every rank found the same checkpoint, then give this rank its
        own random state and data position (:func:`keepalive.distributed.localize`); a changed world
        size is warned about. A single process loading a checkpoint of several ranks takes rank 0's part."""
        group = self.group
        if found is None and not group.active:
            return None
        if group.active:
            names = group.all_gather(found[0].name if found is not None else None)
            if len(set(names)) != 1:
                raise RuntimeError(f"the ranks found different newest checkpoints in {self.url} "
                                   f"({names}): every rank must see the same run folder (shared storage)")
            if found is None:
                return None
        info, tree, previous = found
        if tree.get(_distributed.RANKS_KEY) or group.world_size > 1:
            tree, changed = _distributed.localize(tree, group.rank, group.world_size)
            if changed and group.is_main:  # not bit-exact any more: a warning, not news
                self.warn(changed, key="world-size")
        return info, tree, previous

    def restore_rng(self, tree: Mapping[str, Any]) -> None:
        if tree.get("rng"):
            rng.restore(tree["rng"])

    # ----------------------------------------------------------------------------------- save
    def _open(self) -> None:
        if not self.group.is_main:
            return  # DDP (issue 16): rank 0 alone holds the writer lease and writes
        if not self._opened:
            # A notebook cell run again builds a new checkpointer for the same run while the old
            # one (same process, its loop over) still holds the writer lease: hand it over.
            for other in list(_ACTIVE):
                if (other is not self and other._opened and not other._in_loop
                        and other.store.url == self.store.url):
                    other.close()
            self.sink.open_for_writing(takeover=self.takeover)
            record_run(self.url, _session.platforms.run_index_dir)  # found after a reset (RUNS.json)
            self._opened = True

    def _committed(self, result) -> None:
        self.trigger.record_save(result.seconds)

    def check_storable(self, capture: Capture) -> None:
        """Raise now (at the start of training) if the state holds a value that cannot be stored,
        instead of at the first save an epoch later. Walks the tree; copies nothing."""
        from .state import encode  # layer 1; a cheap walk that only records tensor references

        encode(self.build_tree(capture))

    def build_tree(self, capture: Capture) -> Dict[str, Any]:
        tree = {"keepalive": {"format": STATE_FORMAT, "framework": self.framework},
                "counters": dict(self.counters), "extras": dict(self.extras)}
        tree.update(capture())
        tree["rng"] = rng.capture()
        return tree

    def save(self, capture: Capture, *, sync: bool = False, reason: str = "by hand",
             finished: bool = False) -> None:
        """Checkpoint now: the state is copied to host memory, the write goes on in the background."""
        self._open()
        if reason != "by hand":
            self._refresh_context()
        tree = self.build_tree(capture)
        if self.sharded:  # FSDP2 (issue 16): sharded state through DCP, same manifest-last commit
            self._save_sharded(tree, reason=reason, finished=finished, sync=sync)
            return
        if self.group.active:
            # DDP (issue 16): a collective; rank 0 writes one checkpoint holding every rank's part
            parts = self.group.gather(_distributed.rank_part(tree))
            if parts is None:  # not rank 0: its part is on its way into rank 0's checkpoint
                self._last_saved_step = self.counters["step"]
                self.trigger.saved()
                if sync:
                    self.group.barrier()  # no rank goes on (or exits) before the write is durable
                return
            tree = _distributed.combine(tree, parts)
        meta = dict(self.metadata, reason=reason, finished=finished, counters=dict(self.counters))
        if self.group.active:
            meta["world_size"] = self.group.world_size
        self.store.lease.progress = dict(self.counters)
        log.info("saving step %d (epoch %d): %s", self.counters["step"], self.counters["epoch"], reason)
        self.writer.submit(tree, step=self.counters["step"], epoch=self.counters["epoch"],
                           metadata=meta, sync=sync)
        if sync and self.group.active:
            self.group.barrier()  # DDP (issue 16): the other ranks wait in save() for this
        self._last_saved_step = self.counters["step"]
        self.trigger.saved()

    def _save_sharded(self, tree: Dict[str, Any], *, reason: str, finished: bool, sync: bool) -> None:
        """FSDP2 (issue 16): one global checkpoint whose sharded objects go through
        ``torch.distributed.checkpoint`` (:mod:`keepalive.dcp`). A collective, in two halves.

        The training waits only for the first: every rank copies its shards to host memory (into
        buffers kept from the previous save) and freezes its own RNG / data position (rank 0: the
        whole unsharded rest of the state). The second runs in a thread, over a process group of its
        own: rank 0 names the folder; every rank writes its shards into it (``dcp.save``, durable,
        checksummed while written); every rank's part and its manifest entries reach rank 0, which
        writes the rest of the state and the manifest, LAST. A rank whose write failed sends a line
        saying why instead: rank 0 then writes no manifest and says it, once for all ranks.
        The folder is in the run folder when checkpoints go to it directly (a local path), else in
        this machine's spool, whose uploader sends the committed checkpoint on (one machine).
        ``sync`` (or ``background=False``): returns after the commit."""
        from . import dcp as _dcp  # layer 2; imports torch, as the adapter that set self.sharded did
        from .state import frozen_copy

        group, sharded = self.group, self.sharded
        self._sharded_wait()  # one save in flight: the previous one is committed first
        self.writer.wait()  # and an earlier (unsharded) write
        step, epoch = self.counters["step"], self.counters["epoch"]
        tree[_dcp.DCP_KEY] = sharded.describe()
        own = frozen_copy(_distributed.rank_part(tree))
        rest = frozen_copy(tree) if group.is_main else None
        meta = dict(self.metadata, reason=reason, finished=finished, counters=dict(self.counters),
                    world_size=group.world_size, sharded="dcp")
        if group.is_main:
            self.store.lease.progress = dict(self.counters)
        log.info("saving step %d (epoch %d) with DCP shards: %s", step, epoch, reason)
        staged = sharded.stage()  # the stall: this rank's shards in host memory

        def commit() -> None:
            try:
                commit_there: Any = None
                folder: Dict[str, str] = {}
                failure: Optional[BaseException] = None
                if group.is_main:  # the run folder (local) or this machine's spool: every rank sees it
                    try:
                        target, commit_there = self.sink.sharded_target()
                        name = target.new_name(step)
                        folder = {"path": target.backend.join(target.path, name), "name": name}
                    except Exception as exc:  # noqa: BLE001 - the other ranks wait for the folder
                        folder = {"error": f"{type(exc).__name__}: {exc}"}
                        failure = exc
                folder = sharded.first_rank_value(folder)
                if "error" in folder:  # said by rank 0
                    if failure is not None:
                        raise failure
                    return
                try:
                    written: Any = sharded.write(staged, folder["path"])
                except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
                    written = _dcp.describe_failure(exc)  # a line for rank 0, which then commits nothing
                parts = sharded.gather((own, written))
                if parts is None:  # not rank 0: a failure is said there, once, for every rank
                    return
                failed = sorted({w for _, w in parts if isinstance(w, str)})
                if failed:
                    raise _dcp.ShardWriteError(f"{'; '.join(failed)}; no manifest written for step {step}")
                assert rest is not None  # rank 0 froze it
                full = _distributed.combine(rest, [p for p, _ in parts]) if group.active else rest
                files = self.writer.snapshot.take(full)
                result = commit_there(files, step=step, epoch=epoch, metadata=meta, name=folder["name"],
                                      written=[entry for _, w in parts for entry in w])
                self.writer.last_result = result
                for callback in self.writer.on_commit:
                    callback(result)
            except BaseException as exc:  # noqa: BLE001 - said by _sharded_wait
                self._sharded_error = exc

        if sync or not self.writer.background:
            commit()
            self._sharded_wait()
            group.barrier()  # no rank goes on (or exits) before the manifest is written
        else:
            self._sharded_thread = threading.Thread(target=commit, name="keepalive-dcp-commit")
            self._sharded_thread.start()
        self._last_saved_step = step
        self.trigger.saved()

    def _sharded_wait(self) -> None:
        """FSDP2 (issue 16): wait for the sharded save in flight (shards and manifest); say a failure."""
        thread, self._sharded_thread = self._sharded_thread, None
        if thread is not None:
            thread.join()
        error, self._sharded_error = self._sharded_error, None
        if error is not None:
            self.warn(f"sharded checkpoint write to {self.url} failed ({type(error).__name__}: {error}); "
                      "the previous checkpoint stays the newest, training goes on")

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the in-flight write (bounded by ``timeout`` seconds when given), then for the
        spooled checkpoints' uploads (bounded by ``timeout`` or ``flush_timeout``)."""
        if self.sharded:
            self._sharded_wait()  # FSDP2 (issue 16): the sharded save in flight
        self.writer.wait(timeout)
        self.sink.flush(timeout, end_of_run=self.finished or self.stopped)

    # ------------------------------------------------------------------------------ lifecycle
    # An adapter calls these at its framework's boundaries; they own the counter arithmetic, so
    # every adapter's counters mean the same thing: ``epoch`` = epochs completed, ``batch`` = batches
    # done in the running epoch, ``step`` = optimizer steps, ``samples`` = samples seen.
    def new_fit(self, keep_counters: bool = False) -> None:
        """A new training call with the same checkpointer (Keras' ``fit`` run again): counters and
        end states start over; the next :meth:`load` finds where the run stands. ``keep_counters``:
        a further stage of the same run (a second ``fit`` after the first completed): only the end
        states reset, the counters go on (checkpoints stay ordered by step)."""
        self.finished = self.stopped = False
        self.stop_reason = None
        self.trigger.deadline_hit = False
        if keep_counters:
            self.counters["batch"] = 0
            return
        for k in self.counters:
            self.counters[k] = 0

    def start_epoch(self) -> None:
        """An epoch begins (for the trigger's epoch timing and the deadline prediction)."""
        self.trigger.start_epoch()

    def advance(self, capture: Capture, *, steps: int = 1, batch: Optional[int] = None,
                samples: int = 0, can_save: bool = True, pending: bool = False,
                requested: bool = False) -> Decision:
        """After a batch in which ``steps`` optimizer steps ran: count them (``batch``: the batch
        index reached within the epoch, when the adapter knows it absolutely; else the batch counter
        moves by ``steps``), then act at this step boundary (see :meth:`step_boundary`).
        ``pending``: gradients are being accumulated (no save here; what comes due waits for the next
        boundary without them). ``requested``: the user asked for a save during this batch."""
        c = self.counters
        c["batch"] = c["batch"] + steps if batch is None else int(batch)
        c["step"] += steps
        c["samples"] += int(samples)
        if requested:
            self._deferred_save = True
            self._deferred_reason = "by hand"
        return self.step_boundary(capture, can_save=can_save, steps=steps, pending=pending)

    def end_epoch(self, capture: Capture, *, last: bool = False, epoch: Optional[int] = None,
                  requested: bool = False) -> Decision:
        """An epoch ended (``epoch``: the number of epochs now complete, when the framework says):
        count it, then save / stop as due (``last``: the training's end, always saved;
        ``requested``: the user asked for a save after this epoch's batches)."""
        self.counters["epoch"] = self.counters["epoch"] + 1 if epoch is None else int(epoch)
        self.counters["batch"] = 0
        if requested:
            self._deferred_save = True
            self._deferred_reason = "by hand"
        return self.epoch_boundary(capture, last=last)

    def count_epoch(self) -> None:
        """An epoch ended whose boundary is acted on later (fastai saves a fit's last epoch in
        :meth:`end_stage`, after the other callbacks' end of fit): count it now, nothing else."""
        self.counters["epoch"] += 1
        self.counters["batch"] = 0

    def already_complete(self, total: Optional[int] = None, detail: str = "",
                         message: Optional[str] = None) -> None:
        """The checkpoint is at (or past) the end of the training asked for: say so (even with
        ``quiet=True``: a training call that trains nothing must say why), mark finished."""
        of = f" of {total}" if total else ""
        report.say(message or f"run '{self.store.run}' already completed {self.counters['epoch']} "
                   f"epoch(s){of}; nothing to do{detail}")
        self.finished = True

    # ----------------------------------------------------------------------------- boundaries
    def step_boundary(self, capture: Capture, *, can_save: bool = True, steps: int = 1,
                      pending: bool = False) -> Decision:
        """Call after every optimizer step, with the counters already advanced.

        ``can_save=False`` where the adapter cannot resume inside an epoch: then no checkpoint is
        written here (a pending interrupt takes effect without saving; the last epoch-end checkpoint
        stays the newest). ``steps``: optimizer steps since the previous boundary, where one
        boundary covers several (Keras ``steps_per_execution``); ``every=N`` counts steps.
        """
        self.store.lease.progress = dict(self.counters)
        _session.note_activity()  # a running training is not idle
        self._reserve_snapshot(capture)
        decision = self.trigger.after_step(steps, consistent=can_save and not pending)
        if can_save and not pending and self.group.active:
            decision = self._agree(decision)  # DDP (issue 16): one small collective per boundary
        if not can_save or pending:
            # Nothing can be saved here (the loop cannot resume inside an epoch, or gradients are
            # being accumulated): what came due (a scheduled save, a deadline stop, an interrupt)
            # is done at the next boundary where it can be, instead of being lost.
            if decision.save and not self._deferred_save:
                self._deferred_save, self._deferred_reason = True, decision.reason
            if decision.stop:
                self._deferred_stop = decision.reason
            if not can_save and self._pending_signal is not None:
                signum, self._pending_signal = self._pending_signal, None
                self.uninstall_signal_handlers()
                self.warn(f"{signal.Signals(signum).name}: this loop cannot be saved inside an epoch "
                          f"({self.mid_epoch_obstacle or 'see the earlier warning'}); stopping without a "
                          f"new checkpoint: a restart continues from the last one (epoch "
                          f"{self.counters['epoch']} begins again)")
                self._raise_for(signum)
            return Decision()
        if self._deferred_save or self._deferred_stop:
            decision.save = True
            decision.reason = decision.reason or self._deferred_reason or "a save came due"
            if self._deferred_stop:
                decision.stop, decision.reason = True, self._deferred_stop
            self._deferred_save, self._deferred_stop, self._deferred_reason = False, None, None
        return self._act(decision, capture, at_epoch_end=False)

    def _agree(self, decision: Decision) -> Decision:
        """DDP (issue 16): every rank's save / stop / pending signal combined by one all_reduce, so
        all ranks save and stop at the same boundary (:meth:`keepalive.distributed.ProcessGroup.agree`)."""
        agreed = self.group.agree(decision.save or self._deferred_save,
                                  decision.stop or self._deferred_stop is not None, self._pending_signal)
        if agreed.save and not (decision.save or self._deferred_save):
            decision.save, decision.reason = True, decision.reason or "a save came due on another rank"
        if agreed.stop and not (decision.stop or self._deferred_stop):
            decision.stop, decision.reason = True, "another rank stops before the session ends"
        if agreed.signal is not None and self._pending_signal is None:
            self._pending_signal = agreed.signal  # a signal that reached another rank acts here too
        return decision

    @staticmethod
    def _raise_for(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _reserve_snapshot(self, capture: Capture) -> None:
        """At the first boundary: prepare the host buffer of the first save in the background."""
        if not self._reserved:
            self._reserved = True
            if not self.group.is_main:
                return  # DDP (issue 16): only rank 0 writes, only it needs the host buffer
            try:
                self.writer.snapshot.reserve(self.build_tree(capture))
            except Exception as exc:  # noqa: BLE001 - an optimisation only; the save will say more
                log.debug("could not reserve the snapshot buffer: %s", exc)

    def epoch_boundary(self, capture: Capture, *, last: bool = False) -> Decision:
        """Call after every epoch, with the counters already pointing at the next epoch."""
        self._reserve_snapshot(capture)
        decision = self.trigger.after_epoch()
        if not last and self.group.active:
            decision = self._agree(decision)  # DDP (issue 16)
        if self.training_progress is not None:
            self.training_progress.epoch_end(last)
        if self._deferred_save:  # a step/time save came due where none was possible: save here
            self._deferred_save = False
            decision.save = True
            decision.reason = (decision.reason or self._deferred_reason
                               or "save due during an epoch that cannot be resumed mid-way")
            self._deferred_reason = None
        if self._deferred_stop and not last:
            decision.save, decision.stop, decision.reason = True, True, self._deferred_stop
            self._deferred_stop = None
        if last:
            self.finished = True
            self._save_if_new(capture, "end of training", sync=True, finished=True)
            if self._pending_signal is not None:  # e.g. Ctrl-C during the last epoch's validation
                signum, self._pending_signal = self._pending_signal, None
                self.uninstall_signal_handlers()
                self.say(f"{signal.Signals(signum).name}: training had finished; saved epoch "
                         f"{self.counters['epoch']}, step {self.counters['step']} to {self.url}")
                self._raise_for(signum)
            return Decision()
        return self._act(decision, capture, at_epoch_end=True)

    def end_stage(self, capture: Capture, *, reason: str, epoch_end: bool = True,
                     finished: bool = False) -> Decision:
        """A boundary after which training may go on in another stage (fastai's ``fine_tune`` runs two
        fits, each ending in the framework's own end-of-fit code): save now and wait until the write
        is durable, even when this step was saved before (code that ran since may have changed the
        state). With ``epoch_end`` the boundary also counts as the stage's last epoch end for the
        trigger (timing, deadline: the next stage may not fit in the session) and the progress bar.
        Then acts on a deadline stop and on a pending interrupt as any boundary does. Unlike
        ``epoch_boundary(last=True)`` the run is marked finished only when ``finished`` is given.
        """
        decision = Decision()
        if epoch_end:
            decision = self.trigger.after_epoch()
            if self.training_progress is not None:
                self.training_progress.epoch_end(True)
        self._deferred_save = False
        self.save(capture, sync=True, reason=reason, finished=finished)
        if finished:
            self.finished = True
        return self._act(Decision(stop=decision.stop, reason=decision.reason), capture, at_epoch_end=True)

    def _act(self, decision: Decision, capture: Capture, at_epoch_end: bool) -> Decision:
        pending = self._pending_signal
        if pending is not None:
            name = signal.Signals(pending).name
            self._save_if_new(capture, f"{name} received", sync=True)
            self.say(f"{name}: saved epoch {self.counters['epoch']}, step {self.counters['step']} "
                     f"to {self.url}")
            self._pending_signal = None
            self.uninstall_signal_handlers()
            self._raise_for(pending)
        if decision.save:
            self._save_if_new(capture, decision.reason, sync=decision.stop)
        if decision.stop:
            self.stopped = True
            self.stop_reason = decision.reason
            self.say(f"stopping before the session ends: saved epoch {self.counters['epoch']}, step "
                f"{self.counters['step']} to {self.url}. In a new session run the same code again "
                "(or %resume_training) to continue from here.")
        return decision

    def _save_if_new(self, capture: Capture, reason: str, *, sync: bool, finished: bool = False) -> None:
        if self._last_saved_step == self.counters["step"] and not finished:
            if sync:
                self.flush()
            return
        self.save(capture, sync=sync, reason=reason, finished=finished)

    # -------------------------------------------------------------------------------- signals
    def install_signal_handlers(self) -> None:
        """Defer SIGINT and SIGTERM to the next step boundary, where the state is consistent."""
        if threading.current_thread() is not threading.main_thread() or self._old_handlers:
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - not allowed here
                pass
        self._in_loop = True

    def uninstall_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
        self._old_handlers = {}
        self._in_loop = False

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # a forked DataLoader worker inherited this handler: behave as it would without us
            # (torch's worker loop ends quietly on KeyboardInterrupt), and print nothing
            self._raise_for(signum)
        if self._pending_signal is not None:  # asked twice: the user insists, act now
            self._pending_signal = None  # nothing stale left for the next training in this kernel
            self.uninstall_signal_handlers()
            self._raise_for(signum)
        self._pending_signal = signum
        # shown even with quiet=True: the user pressed a key and must learn what happens now
        report.say(f"{signal.Signals(signum).name} received; saving at the end of this step "
                   "(send it again to stop at once)", stream="stderr")

    # ---------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish the in-flight write and release the writer lease."""
        try:
            self.flush()
        finally:
            self.uninstall_signal_handlers()
            if self.training_progress is not None:
                self.training_progress.close()
            self.sink.close()
            if self.sharded:
                self.sharded.close()  # FSDP2 (issue 16): its staging buffers
            self._opened = False


@atexit.register
def _flush_all_at_exit() -> None:
    for ckpt in list(_ACTIVE):
        try:
            ckpt.close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.error("could not finish the last checkpoint of %s: %s", ckpt.url, exc)


__all__ = ["Checkpointer", "active_checkpointers", "default_dir", "resolve_run_url"]

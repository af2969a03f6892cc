"""How a checkpoint leaves the process: one of three save paths, chosen once when the run opens.

* :class:`LocalSave` — one process: the state is copied to host memory and committed by the
  :class:`~keepalive.writer.AsyncWriter` in the background.
* :class:`GatheredSave` — DDP (replicated state on several ranks): every rank's own part (random
  state, data position) is gathered to rank 0, which writes one checkpoint through its writer; the
  other ranks only send.
* :class:`ShardedSave` — FSDP2 (sharded state): the shards go through ``torch.distributed.checkpoint``
  into the checkpoint's folder, the rest and the manifest (last) are written by rank 0
  (:mod:`keepalive.dcp` has the DCP side; JAX arrays spread over several ``jax.distributed`` processes
  go the same way through Orbax, whose side the JAX adapter holds: :func:`sharded_api`).

:func:`open_destination` builds what a run's checkpoints go through (its store, the spool, the writer),
once when a checkpointer is made and again if it moves to another run before its first save
(:mod:`keepalive.runidentity`).

Each offers the same small interface (:class:`SavePath`): ``agree`` (every rank's save / stop /
signal combined at a consistent boundary; None for one process), ``localize`` (this rank's own part
of a loaded checkpoint), ``reserve``, ``submit``, ``wait``, ``close``; the core never branches on the
distributed mode.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple, cast

from . import distributed as _distributed
from . import report
from .progress import upload_progress
from .spool import SpooledStore
from .state import HostSnapshot, frozen_copy
from .statetree import StateTree
from .store import CheckpointStore, WriteResult
from .writer import AsyncWriter

log = logging.getLogger("keepalive")

#: what a run's newest valid checkpoint is when found: its info, its tree, the previous one's summary
Found = Tuple[Any, StateTree, Optional[Dict[str, Any]]]


class SavePath(Protocol):
    """What the core asks of a save path."""

    #: whether this process writes checkpoints (holds the writer lease, shows progress)
    writes: bool

    def agree(self, save: bool, stop: bool, signal: Optional[int],
              position: Optional[_distributed.Position] = None) -> Optional[_distributed.Agreement]: ...

    def localize(self, found: Optional[Found], url: str, warn: Callable[[str], None]) -> Optional[Found]: ...

    def reserve(self, tree: StateTree) -> None: ...

    def submit(self, tree: StateTree, *, step: int, epoch: int, metadata: Mapping[str, Any],
               sync: bool, defer: Optional[Callable[[Any], bool]] = None) -> None:
        """Save ``tree``. ``defer``: tensors that may be copied after the call returns (a lazy
        snapshot, :class:`~keepalive.writer.AsyncWriter`); a save path that cannot may ignore it."""

    def wait(self, timeout: Optional[float] = None) -> None: ...

    def close(self) -> None: ...

    def move(self, where: "Destination") -> None:
        """Write to another run from now on (before the first save: :mod:`keepalive.runidentity`)."""


class LocalSave:
    """One process, one writer."""

    writes = True

    def __init__(self, writer: AsyncWriter, group: _distributed.ProcessGroup):
        self.writer, self.group = writer, group

    def agree(self, save: bool, stop: bool, signal: Optional[int],
              position: Optional[_distributed.Position] = None) -> Optional[_distributed.Agreement]:
        return None  # one process: nothing to agree on

    def localize(self, found: Optional[Found], url: str, warn: Callable[[str], None]) -> Optional[Found]:
        return localize(self.group, found, url, warn)

    def reserve(self, tree: StateTree) -> None:
        self.writer.reserve(tree)

    def submit(self, tree: StateTree, *, step: int, epoch: int, metadata: Mapping[str, Any],
               sync: bool, defer: Optional[Callable[[Any], bool]] = None) -> None:
        self.writer.submit(tree, step=step, epoch=epoch, metadata=metadata, sync=sync, defer=defer)

    def wait(self, timeout: Optional[float] = None) -> None:
        self.writer.wait(timeout)

    def close(self) -> None:
        pass

    def move(self, where: "Destination") -> None:
        self.writer = where.writer


class GatheredSave(LocalSave):
    """DDP: rank 0 writes one checkpoint holding every rank's own part; all ranks agree at each
    boundary (one small collective) so they save and stop together."""

    def __init__(self, writer: AsyncWriter, group: _distributed.ProcessGroup, folder: Any = None):
        super().__init__(writer, group)
        self.writes = group.is_main
        self.folder = folder

    def agree(self, save: bool, stop: bool, signal: Optional[int],
              position: Optional[_distributed.Position] = None) -> Optional[_distributed.Agreement]:
        return self.group.agree(save, stop, signal, position)  # one small collective per consistent boundary

    def move(self, where: "Destination") -> None:
        super().move(where)
        self.folder = where.store  # the run folder every rank must see

    def reserve(self, tree: StateTree) -> None:
        if self.writes:  # only rank 0 writes, only it needs the host buffer
            super().reserve(tree)

    def submit(self, tree: StateTree, *, step: int, epoch: int, metadata: Mapping[str, Any],
               sync: bool, defer: Optional[Callable[[Any], bool]] = None) -> None:
        # (no lazy copy: rank 0 writes what the ranks gathered, copies made by the collective)
        meet_before_saving(self.group, self)
        parts = self.group.gather(_distributed.rank_part(dict(tree)))  # a collective
        if parts is not None:  # rank 0
            meta = dict(metadata, world_size=self.group.world_size)
            self.writer.submit(_distributed.combine(dict(tree), parts), step=step, epoch=epoch, metadata=meta,
                               sync=sync)
        if sync:
            self.group.barrier()  # no rank goes on (or exits) before the write is durable


#: what a rank that reached a save alone is told to do
SAVE_ON_EVERY_RANK = ("Call it on every rank, not inside `if rank == 0:`: keepalive gathers every rank's part of "
                      "the state (its random state, its data position) and rank 0 alone writes the checkpoint")


def meet_before_saving(group: _distributed.ProcessGroup, path: Any) -> None:
    """Before the collective a save is: every rank must have reached this save (a save asked for on one
    rank only is said in one line, instead of a gloo error or a hang); at the first save, every rank
    must see the run folder rank 0 writes to (a folder on each node's own disk is refused now, not at
    the first restart after a whole session of checkpoints nobody else can read)."""
    if not group.active:
        return
    group.check_in("save()", SAVE_ON_EVERY_RANK)
    store = getattr(path, "folder", None)
    if store is not None and not getattr(path, "folder_checked", False):
        path.folder_checked = True
        backend, root = store.backend, store.path

        def write(name: str, data: bytes) -> None:
            backend.makedirs(root)
            backend.write_bytes(backend.join(root, name), data)

        def read(name: str) -> bytes:
            path = backend.join(root, name)
            backend.exists(path)  # a bucket's file system caches listings: look again, as the store does
            return backend.read_bytes(path)

        group.same_folder(store.url, write, read, lambda name: backend.remove_file(backend.join(root, name)))


def localize(group: _distributed.ProcessGroup, found: Optional[Found], url: str,
             warn: Callable[[str], None]) -> Optional[Found]:
    """This rank's view of the checkpoint found: under a process group, every rank must have found
    the same one; each takes its own random state and data position (a checkpoint of several ranks
    loaded by one process takes rank 0's); a changed world size is warned about, by rank 0."""
    if group.active:
        names = group.all_gather(found[0].name if found is not None else None)
        if len(set(names)) != 1:
            raise RuntimeError(f"the ranks found different newest checkpoints in {url} ({names}): every rank "
                               "must see the same run folder (shared storage)")
    if found is None:
        return None
    info, tree, previous = found
    if tree.get(_distributed.RANKS_KEY) or group.world_size > 1:
        local, changed = _distributed.localize(dict(tree), group.rank, group.world_size)
        tree = cast(StateTree, local)
        if changed and group.is_main:  # not bit-exact any more: a warning, not news
            warn(changed)
    return info, tree, previous


class ShardedSave:
    """FSDP2: one global checkpoint whose sharded objects go through ``torch.distributed.checkpoint``.
    A collective, in two halves.

    The training waits only for the first: every rank copies its shards to host memory (into buffers
    kept from the previous save) and freezes its own random state / data position (rank 0: the whole
    unsharded rest of the state). The second runs in a thread, over a process group of its own: rank
    0 names the folder; every rank writes its shards into it (``dcp.save``, durable, checksummed while
    written); every rank's part and its manifest entries reach rank 0, which writes the rest of the
    state and the manifest, LAST. A rank whose write failed sends a line saying why instead: rank 0
    then writes no manifest and says it, once for all ranks. The folder is in the run folder when
    checkpoints go to it directly (a local path), else in this machine's spool, whose uploader sends
    the committed checkpoint on (one machine).
    """

    def __init__(self, sharded: Any, group: _distributed.ProcessGroup, spooled: Any,
                 on_commit: List[Callable[[WriteResult], None]], background: bool, url: str):
        self.sharded, self.group, self.spooled = sharded, group, spooled
        self.on_commit, self.background, self.url = on_commit, background, url
        self.writes = group.is_main
        self.snapshot = HostSnapshot()
        #: the run folder every rank resumes from: every rank must see it (:func:`meet_before_saving`)
        self.folder = getattr(spooled, "dest", None)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def agree(self, save: bool, stop: bool, signal: Optional[int],
              position: Optional[_distributed.Position] = None) -> Optional[_distributed.Agreement]:
        return self.group.agree(save, stop, signal, position) if self.group.active else None

    def localize(self, found: Optional[Found], url: str, warn: Callable[[str], None]) -> Optional[Found]:
        return localize(self.group, found, url, warn)

    def reserve(self, tree: StateTree) -> None:
        pass  # DCP's stager keeps its own buffers

    def submit(self, tree: StateTree, *, step: int, epoch: int, metadata: Mapping[str, Any],
               sync: bool, defer: Optional[Callable[[Any], bool]] = None) -> None:
        # (no lazy copy here: DCP stages each rank's shards itself)
        group, sharded = self.group, self.sharded
        key = sharded_api(sharded)[0]
        self.wait()  # one save in flight: the previous one is committed first
        meet_before_saving(group, self)
        whole = dict(tree, **{key: sharded.describe()})
        own = frozen_copy(_distributed.rank_part(whole))
        rest = frozen_copy(whole) if group.is_main else None
        meta = dict(metadata, world_size=group.world_size, sharded=key)
        staged = sharded.stage()  # the stall: this rank's shards in host memory

        def commit() -> None:
            try:
                self._commit(staged, own, rest, step=step, epoch=epoch, metadata=meta)
            except BaseException as exc:  # noqa: BLE001 - said by wait()
                self._error = exc

        if sync or not self.background:
            commit()
            self.wait()
            group.barrier()  # no rank goes on (or exits) before the manifest is written
        else:
            self._thread = threading.Thread(target=commit, name="keepalive-dcp-commit")
            self._thread.start()

    def _commit(self, staged: Any, own: Any, rest: Any, *, step: int, epoch: int, metadata: Dict[str, Any]) -> None:
        sharded = self.sharded
        _, describe_failure, write_error = sharded_api(sharded)
        commit_there: Any = None
        folder: Dict[str, str] = {}
        failure: Optional[BaseException] = None
        if self.group.is_main:  # the run folder (local) or this machine's spool: every rank sees it
            try:
                target, commit_there = self.spooled.sharded_target()
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
            written = describe_failure(exc)  # a line for rank 0, which then commits nothing
        parts = sharded.gather((own, written))
        if parts is None:  # not rank 0: a failure is said there, once, for every rank
            return
        failed = sorted({w for _, w in parts if isinstance(w, str)})
        if failed:
            raise write_error(f"{'; '.join(failed)}; no manifest written for step {step}")
        full = _distributed.combine(rest, [p for p, _ in parts]) if self.group.active else rest
        result = commit_there(self.snapshot.take(full), step=step, epoch=epoch, metadata=metadata,
                              name=folder["name"], written=[entry for _, w in parts for entry in w])
        for callback in self.on_commit:
            callback(result)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the sharded save in flight (shards and manifest); say a failure."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            report.warn(f"sharded checkpoint write to {self.url} failed ({type(error).__name__}: {error}); "
                        "the previous checkpoint stays the newest, training goes on")

    def close(self) -> None:
        self.sharded.close()  # its staging buffers and side process group
        if self._thread is None:
            self.snapshot.release()  # the host copy of the unsharded rest

    def move(self, where: "Destination") -> None:
        self.spooled, self.url, self.folder = where.spooled, where.store.url, where.store


def sharded_api(sharded: Any) -> Tuple[str, Callable[[BaseException], str], type]:
    """What a sharded save names for ``sharded``: the key of its part of the state tree, the line a
    failed shard write is said in, the error a failed save raises. The objects' own when they offer
    them (``tree_key``, ``describe_failure``, ``write_error``: Orbax's, for JAX), else DCP's (importing
    torch, as the adapter that holds DTensors did)."""
    if hasattr(sharded, "tree_key"):
        return sharded.tree_key, sharded.describe_failure, sharded.write_error
    from . import dcp as _dcp

    return _dcp.DCP_KEY, _dcp.describe_failure, _dcp.ShardWriteError


@dataclass
class Destination:
    """Where a run's checkpoints go: its run folder's store, what the writer commits through (the store
    itself, or a local spool whose checkpoints a background thread uploads: remote URLs, Drive,
    failing destinations; :mod:`keepalive.spool`), and the writer."""

    store: CheckpointStore
    spooled: SpooledStore
    writer: AsyncWriter


def open_destination(url: str, cfg: Any, *, remaining_fn: Callable[[], Optional[float]],
                     on_durable: Callable[[float], None],
                     on_commit: Optional[List[Callable[[WriteResult], None]]] = None) -> Destination:
    """The store, spool and writer of the run folder ``url`` with the options of ``cfg`` (a
    :class:`~keepalive.config.CheckpointConfig`); nothing is opened or written yet. ``on_commit``: the
    callbacks a committed checkpoint is handed to (kept when a checkpointer moves to another run)."""
    store = CheckpointStore(url, keep=cfg.keep, keep_every=cfg.keep_every, storage_options=cfg.storage_options)
    spooled = SpooledStore(store, cfg.spool, storage_options=cfg.storage_options, flush_timeout=cfg.flush_timeout,
                           drive_flush=cfg.drive_flush, quiet=cfg.quiet, remaining_fn=remaining_fn,
                           on_durable=on_durable)
    writer = AsyncWriter(spooled, background=cfg.background, memory_budget=cfg.memory_budget)
    if on_commit is not None:
        writer.on_commit = on_commit
    if not cfg.quiet:
        writer.progress_factory = upload_progress(url)
    return Destination(store, spooled, writer)


def choose(writer: AsyncWriter, group: _distributed.ProcessGroup, sharded: Any, spooled: Any,
           on_commit: List[Callable[[WriteResult], None]], url: str) -> SavePath:
    """The save path of a run: sharded when objects hold sharded state, gathered under a process
    group, else local."""
    if sharded:
        return ShardedSave(sharded, group, spooled, on_commit, writer.background, url)
    if group.active:
        return GatheredSave(writer, group, getattr(spooled, "dest", None))
    return LocalSave(writer, group)


__all__ = ["Destination", "GatheredSave", "LocalSave", "SavePath", "ShardedSave", "choose", "localize",
           "open_destination", "sharded_api"]

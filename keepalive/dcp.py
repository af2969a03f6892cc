"""FSDP2 / DTensor state through ``torch.distributed.checkpoint`` (DCP), inside keepalive's checkpoints.

A model sharded with ``torch.distributed.fsdp.fully_shard`` (and its optimizer) holds ``DTensor``
state: no rank has all of it, so it cannot go into rank 0's ``tensors.safetensors`` as DDP's replicated
state does. It is written by torch's own Distributed Checkpoint instead, into keepalive's checkpoint
folder, and committed by keepalive's manifest, so a sharded checkpoint is valid only when complete::

    ckpt-0000000012-3f9a1c2e/
        __0_0.distcp  __1_0.distcp   <- each rank's shards (dcp.save, every rank writes its own)
        .metadata                    <- DCP's plan (rank 0, the DCP coordinator)
        state.json  tensors.safetensors   <- everything else (counters, every rank's RNG and data
                                             position, unsharded objects), rank 0
        MANIFEST.json                <- LAST, by rank 0, naming every file above with size and xxh3

How one save goes (:meth:`keepalive.savepath.ShardedSave.submit` drives it). The training waits
for :meth:`ShardedObjects.stage` only: ``get_state_dict`` and a copy of this rank's shards into host
buffers kept from the previous save. The rest runs in a thread over a gloo group of its own: rank 0
names the folder; ``dcp.save`` with :class:`KeepaliveWriter` (torch's ``FileSystemWriter`` whose
streams are hashed while written, files fsync'ed) writes the shards; every rank sends the names, sizes
and checksums of the files *it* wrote to rank 0 with the same ``gather_object`` that carries its RNG and
data position; rank 0 writes the rest and the manifest. ``dcp.save`` returns on a rank only after its
files are durable and the coordinator wrote ``.metadata``, and rank 0 gets a rank's list only after
that rank's ``dcp.save`` returned, so the manifest is written after every shard is durable: a SIGKILL
of any rank at any moment leaves either a complete checkpoint or a folder without manifest (skipped by
readers, removed by the writer), and ``keepalive verify`` re-reads every shard file against the
manifest.

Resume: :meth:`ShardedObjects.load` builds the live sharded state dict (``get_state_dict``), fills it
with ``dcp.load`` from the checkpoint folder (``FileSystemReader``; ``FsspecReader`` for one in a
bucket) and puts it back with
``set_state_dict``. DCP reshards on load, so another world size loads too (the rest of the state is
then carried over as :func:`keepalive.distributed.localize` says).

Where: into the run folder when checkpoints go to it directly (a local path); else (gs://, s3://, a
Drive mount the spools) into this machine's spool, whose uploader sends the committed checkpoint
on, manifest last, as any other (so one machine: ranks elsewhere do not see this spool). One sharded
model (any number of optimizers over it).
Saves run in the background (the training waits for the copy to host memory); ``background=False``
or a final / signal save waits for the commit.

This module imports torch: only :mod:`keepalive.callbacks.torch` imports it, when a registered object
holds DTensor state.
"""
from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Generator, List, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .backends import local_path
from .store import new_hasher

#: the key of a checkpoint's state tree that says its sharded objects are in DCP files
DCP_KEY = "dcp"


def holds_dtensors(obj: Any) -> bool:
    """Whether ``obj`` (a module or an optimizer) has parameters that are DTensors (FSDP2, TP)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor
        return False
    if isinstance(obj, torch.nn.Module):
        return any(isinstance(p, DTensor) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"])
    return False


class _HashingStream(io.RawIOBase):
    """A write stream that hashes (xxh3) and counts what passes through it; the rest is the file's."""

    def __init__(self, raw: Any, algorithm: str):
        self.raw = raw
        self.hasher = new_hasher(algorithm)
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        self.hasher.update(view[:n] if n is not None else view)
        self.size += n if n is not None else len(view)
        return n if n is not None else len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # the file itself is closed by the context manager
        self.raw.flush()


class _HashingFileSystem(FileSystem):
    """torch's local ``FileSystem``, recording name, size and checksum of every file written here."""

    def __init__(self, algorithm: str = "xxh3_64"):
        super().__init__()
        self.algorithm = algorithm
        self.written: Dict[str, Dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, self.algorithm)
            yield stream  # type: ignore[misc]
        name = Path(path).name
        self.written[name] = {"name": name, "size": stream.size, "checksum": stream.hasher.hexdigest()}

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        entry = self.written.pop(Path(path).name, None)
        if entry is not None:  # DCP writes .metadata.tmp, then renames it
            entry["name"] = Path(new_path).name
            self.written[entry["name"]] = entry


class KeepaliveWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` into a keepalive checkpoint folder: every file fsync'ed (DCP's
    ``sync_files``) and its manifest entry (:attr:`written`) recorded while it is written, so no
    shard is read back to be checksummed."""

    def __init__(self, folder: str, algorithm: str = "xxh3_64", **kwargs: Any):
        super().__init__(folder, sync_files=True, **kwargs)
        self.hashing = _HashingFileSystem(algorithm)
        self.fs = self.hashing

    @property
    def written(self) -> List[Dict[str, Any]]:
        """Manifest entries (name, size, checksum) of the files this rank wrote."""
        return sorted(self.hashing.written.values(), key=lambda e: e["name"])


class ShardedObjects:
    """The registered objects whose state is sharded (an FSDP2 model and its optimizers), saved and
    loaded together through DCP (``get_state_dict`` needs the model with its optimizers)."""

    def __init__(self) -> None:
        self.models: Dict[str, torch.nn.Module] = {}
        self.optimizers: Dict[str, torch.optim.Optimizer] = {}
        self._side: Any = None
        self._stager: Any = None

    def __bool__(self) -> bool:
        return bool(self.models or self.optimizers)

    def add(self, name: str, obj: Any) -> None:
        if isinstance(obj, torch.nn.Module):
            if self.models:
                raise ValueError(f"{name}: one sharded (FSDP2 / DTensor) model per DriveCheckpoint is "
                                 f"supported; {sorted(self.models)} is registered already")
            self.models[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizers[name] = obj
        else:
            raise TypeError(f"{name}: a {type(obj).__name__} with DTensor state is not supported")

    @property
    def names(self) -> List[str]:
        return sorted(self.models) + sorted(self.optimizers)

    def _model(self) -> torch.nn.Module:
        if not self.models:
            raise ValueError(f"sharded optimizers {sorted(self.optimizers)} need their FSDP2 model "
                             "registered too (model=...)")
        return next(iter(self.models.values()))

    def state_dict(self) -> Dict[str, Any]:
        """``{"model": ..., "optim": ...}`` as ``get_state_dict`` gives it (sharded, keyed by FQN)."""
        model = self._model()
        msd, osd = get_state_dict(model, list(self.optimizers.values()))
        return {"model": msd, "optim": osd}

    def stage(self) -> Dict[str, Any]:
        """This rank's sharded state copied to host memory: the part of a save the training waits for.

        The copy goes into buffers kept from the previous save (DCP's ``DefaultStager``, kept for the
        life of the checkpointer; pinned when CUDA is there), so only the first save allocates and
        faults in memory; ``dcp.async_save``'s default stager allocates afresh every time (3x slower
        here, ``benchmarks/fsdp_save.py``). One save is in flight at a time (the core waits for the
        previous one first), so the buffers are never copied into while they are written out. Also
        creates :meth:`side_group` at the first save (a collective every rank enters here)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.side_group()
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        return self._stager.stage(self.state_dict())  # type: ignore[return-value]

    def write(self, staged: Dict[str, Any], folder: str) -> List[Dict[str, Any]]:
        """``dcp.save`` of a :meth:`stage`'d state into ``folder`` over :meth:`side_group` (run in the
        background: its collectives never interleave with the training's, FSDP's or keepalive's); a
        collective. Returns the manifest entries of the files this rank wrote, all durable, once DCP's
        ``.metadata`` is written too."""
        writer = KeepaliveWriter(folder)
        dcp.save(staged, storage_writer=writer, process_group=self.side_group())
        return writer.written

    def side_group(self) -> Any:
        """A gloo process group of every rank for the background writes (created at the first save:
        a collective every rank enters at the same boundary)."""
        if self._side is None:
            self._side = torch.distributed.new_group(backend="gloo")
        return self._side

    def first_rank_value(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank, over :meth:`side_group` (the folder name of a save)."""
        box = [value]
        torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(self.side_group(), 0),
                                                group=self.side_group())
        return box[0]

    def gather(self, value: Any) -> Optional[List[Any]]:
        """Every rank's ``value`` on rank 0 (None elsewhere), over :meth:`side_group`."""
        side = self.side_group()
        world = torch.distributed.get_world_size(side)
        rank = torch.distributed.get_rank(side)
        out: Optional[List[Any]] = [None] * world if rank == 0 else None
        torch.distributed.gather_object(value, out, dst=torch.distributed.get_global_rank(side, 0), group=side)
        return out

    def close(self) -> None:
        """Free the staging buffers and the side group (after the last save; a later save makes both
        again).

        The side group is destroyed here, not left to ``destroy_process_group()``: that call shuts a
        gloo group down but its worker threads live as long as a Python reference to the group does
        (this object's), possibly into interpreter finalization, where a gloo thread that touches a
        Python-owned buffer aborts the process ("terminate called without an active exception",
        SIGABRT after the training finished: seen in CI, pytorch/pytorch#190489). Dropping the last
        reference joins them now."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        side, self._side = self._side, None
        if side is not None and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group(side)
            except (ValueError, RuntimeError):  # already destroyed with every group by the user
                pass

    def load(self, folder: str, process_group: Any = None, storage_options: Optional[dict] = None) -> None:
        """Fill the live sharded objects from the DCP files in ``folder`` (a local path, or an fsspec
        URL where the spool uploaded them) and reshard them when the world size changed; a collective."""
        model = self._model()
        optimizers = list(self.optimizers.values())
        state = self.state_dict()
        path = local_path(folder)
        if path is not None:
            reader: Any = FileSystemReader(path)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(folder, **(storage_options or {}))
        dcp.load(state, storage_reader=reader, process_group=process_group)
        set_state_dict(model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def describe(self) -> Dict[str, Any]:
        """What a checkpoint's tree says about its DCP part (:data:`DCP_KEY`)."""
        return {"objects": self.names, "classes": {n: type(o).__name__ for n, o in
                                                   {**self.models, **self.optimizers}.items()}}


class ShardWriteError(RuntimeError):
    """A rank could not write its shards: that save has no manifest (the previous one stays newest)."""


def describe_failure(exc: BaseException) -> str:
    """One line for a failed shard write; DCP's ``CheckpointException`` carries every failed rank's
    exception (its ``str`` is their tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(failures.items()))
    return f"{type(exc).__name__}: {exc}"


def check_saved(tree: Mapping[str, Any], sharded: ShardedObjects, where: str) -> None:
    """Refuse a checkpoint without the DCP part the live sharded objects need (e.g. written by a run
    without FSDP2), before anything is changed."""
    from .errors import StateMismatchError

    part = tree.get(DCP_KEY) or {}
    missing = [n for n in sharded.names if n not in (part.get("objects") or [])]
    if missing:
        raise StateMismatchError(
            f"checkpoint {where} has no sharded (DCP) state for {missing}: it was written by a run "
            "whose objects were not sharded (FSDP2). Register the same objects as the run that wrote "
            "it, or start a new run")


__all__ = ["DCP_KEY", "KeepaliveWriter", "ShardWriteError", "ShardedObjects", "check_saved", "describe_failure",
            "holds_dtensors"]

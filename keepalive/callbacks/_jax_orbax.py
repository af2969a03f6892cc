"""Arrays spread over several ``jax.distributed`` processes, through Orbax inside keepalive's checkpoints.

Under ``jax.distributed`` an array sharded over the global mesh is not fully addressable: no process
holds all of it, so it cannot go into process 0's ``tensors.safetensors``. Those leaves of the
registered objects go through Orbax instead (every process writes its own shards), into the
checkpoint's folder, committed by keepalive's manifest, as torch's FSDP2 state goes through DCP
(:mod:`keepalive.dcp`; the same :class:`keepalive.savepath.ShardedSave` drives both)::

    ckpt-0000000012-3f9a1c2e/
        orbax/...                     <- Orbax's checkpoint of the sharded leaves (every process its shards)
        state.json  tensors.safetensors   <- everything else (counters, every process's RNG and data
                                             position, the leaves every process holds whole), process 0
        MANIFEST.json                 <- LAST, by process 0, naming every file above with size and xxh3

One save: :meth:`OrbaxArrays.stage` (the training waits for it) takes a copy of the sharded leaves on
their devices (a step may donate the live buffers while the write runs); in the background every
process calls Orbax's synchronous save of them (its barriers go through JAX's coordination service);
when it returns on process 0 every process's files are written, and process 0 reads each back,
``fsync``'ed, into its manifest entry (a folder on one machine's disk, or storage every process mounts).
Then :class:`~keepalive.savepath.ShardedSave` gathers every process's part and process 0 writes the
rest and the manifest, last: a SIGKILL of any process at any moment leaves a complete checkpoint or a
folder without manifest.

Resume: the sharded leaves are restored with Orbax from abstract arrays of the live leaves' shapes,
dtypes and shardings (Orbax reshards when the mesh differs), the rest from keepalive's files.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from ..backends import local_path
from ..store import new_hasher
from ._jax_arrays import flatten, from_host

__all__ = ["ORBAX_FOLDER", "OrbaxArrays", "OrbaxWriteError", "attach", "is_spread"]

#: the sub-folder of a checkpoint that holds Orbax's files
ORBAX_FOLDER = "orbax"


class OrbaxWriteError(RuntimeError):
    """A process could not write its Orbax shards: that save has no manifest (the previous one stays)."""


def is_spread(leaf: Any) -> bool:
    """A JAX array no process holds whole (sharded over several processes' devices)."""
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def _indexed(leaves: Dict[str, Any]) -> Dict[str, Any]:
    """``{"0": ..., "1": ...}``: the leaves in the order of their sorted paths."""
    return {str(i): leaves[path] for i, path in enumerate(sorted(leaves))}


def attach(core: Any, objects: Any) -> None:
    """Under ``jax.distributed`` with several processes, send the registered objects' spread leaves
    through Orbax (``core.dcp_objects``, the sharded part :class:`~keepalive.savepath.ShardedSave`
    writes); one process keeps keepalive's own format."""
    from ..distributed import GROUP

    processes = GROUP.jax
    if processes is None or core.dcp_objects is not None:
        return
    arrays = OrbaxArrays(objects.live, objects.names, processes)
    if arrays:
        core.dcp_objects = arrays


def _replicated(spread: Dict[str, Dict[str, Any]]) -> Any:
    """A sharding that replicates a leaf over the mesh of the spread leaves (every device of every
    process without one): what a jitted step makes of a process's own scalar (a step count), so a
    restored one meets the others in the next step as in an uninterrupted run."""
    from jax.sharding import NamedSharding, PartitionSpec

    for leaves in spread.values():
        for leaf in leaves.values():
            mesh = getattr(leaf.sharding, "mesh", None)
            if mesh is not None:
                return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(jax.make_mesh((jax.device_count(),), ("devices",)), PartitionSpec())


def ocp_args() -> Any:
    """``orbax.checkpoint.args`` (imported at the first multi-process save or resume)."""
    import orbax.checkpoint as ocp

    return ocp.args


def _checkpointer() -> Any:
    """Orbax's synchronous checkpointer, its barriers through the coordination service: naming every
    process as active makes Orbax meet at the distributed client's barriers instead of
    ``sync_global_devices`` (a device collective, which from a save's background thread would
    interleave with the training step's own collectives and hang both processes)."""
    import orbax.checkpoint as ocp

    every = ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count())),
                                               barrier_sync_key_prefix="keepalive")
    return ocp.Checkpointer(ocp.StandardCheckpointHandler(), multiprocessing_options=every)


def _manifest_entries(root: str, algorithm: str = "xxh3_64") -> List[Dict[str, Any]]:
    """Name (relative to the checkpoint folder), size and checksum of every file below ``root``, each
    read back and ``fsync``'ed (Orbax's writes are not)."""
    out = []
    base = os.path.dirname(root)
    for here, _, files in os.walk(root):
        for name in files:
            path = os.path.join(here, name)
            hasher, size = new_hasher(algorithm), 0
            with open(path, "rb") as f:
                for piece in iter(lambda: f.read(1 << 20), b""):
                    hasher.update(piece)
                    size += len(piece)
                os.fsync(f.fileno())
            out.append({"name": os.path.relpath(path, base), "size": size, "checksum": hasher.hexdigest()})
    return sorted(out, key=lambda e: e["name"])


class OrbaxArrays:
    """The spread leaves of the registered objects, saved and restored through Orbax (the ``sharded``
    objects of :class:`keepalive.savepath.ShardedSave`)."""

    tree_key = ORBAX_FOLDER
    write_error = OrbaxWriteError

    def __init__(self, live: Callable[[str], Any], names: Callable[[], List[str]], processes: Any):
        self.live, self.names, self.processes = live, names, processes
        self._restored: Optional[Dict[str, Dict[str, Any]]] = None

    def spread(self) -> Dict[str, Dict[str, Any]]:
        """``{name: {path: leaf}}`` of the live objects' spread leaves."""
        out = {}
        for name in self.names():
            leaves = {path: leaf for path, leaf in flatten(self.live(name))[0] if is_spread(leaf)}
            if leaves:
                out[name] = leaves
        return out

    def __bool__(self) -> bool:
        return bool(self.spread())

    @staticmethod
    def host_part(tree: Any) -> Dict[str, Any]:
        """The leaves of ``tree`` that keepalive's own files hold (flat by path)."""
        return {path: leaf for path, leaf in flatten(tree)[0] if not is_spread(leaf)}

    @staticmethod
    def describe_failure(exc: BaseException) -> str:
        return f"process {jax.process_index()}: {type(exc).__name__}: {exc}"

    def describe(self) -> Dict[str, Any]:
        """What a checkpoint's tree says about its Orbax part: each spread leaf's shape and dtype."""
        return {"specs": {name: {path: [list(leaf.shape), str(leaf.dtype)] for path, leaf in leaves.items()}
                          for name, leaves in self.spread().items()}}

    # ------------------------------------------------------------------------------------ save
    def stage(self) -> Dict[str, Dict[str, Any]]:
        """A copy of the spread leaves on their devices (what the training waits for), keyed by their
        paths' order (Orbax names a leaf by its keys: a path's ``/`` stays out of them)."""
        return {name: _indexed({path: leaf.copy() for path, leaf in leaves.items()})
                for name, leaves in self.spread().items()}

    def write(self, staged: Dict[str, Dict[str, Any]], folder: str) -> List[Dict[str, Any]]:
        """Orbax's save of ``staged`` into ``folder``/orbax, on every process (a collective); process 0
        returns the manifest entries of every file written there, the others none."""
        root = os.path.join(folder, ORBAX_FOLDER)
        with _checkpointer() as checkpointer:
            checkpointer.save(root, args=ocp_args().StandardSave(staged))
        return _manifest_entries(root) if jax.process_index() == 0 else []

    def first_rank_value(self, value: Any) -> Any:
        return self.processes.first_value(value, name="orbax-folder")

    def gather(self, value: Any) -> Optional[List[Any]]:
        return self.processes.gather(value, name="orbax-parts")

    def close(self) -> None:
        pass

    # ---------------------------------------------------------------------------------- resume
    def with_specs(self, name: str, saved: Dict[str, Any], tree: Any) -> Dict[str, Any]:
        """``saved`` (the host leaves of ``name``) with a stand-in of each spread leaf's saved shape and
        dtype, for the check against the live object (nothing allocated)."""
        specs = ((tree.get(ORBAX_FOLDER) or {}).get("specs") or {}).get(name, {})
        out = dict(saved)
        for path, (shape, dtype) in specs.items():
            out[path] = np.broadcast_to(np.empty((), np.dtype(dtype)), tuple(shape))
        return out

    def load(self, url: str, tree: Any) -> None:
        """Restore every leaf the checkpoint ``tree`` holds in Orbax's files, from the checkpoint at
        ``url``, with the live leaves' shardings (a collective); :meth:`rebuild` then puts them in.

        The saved leaves, not the live spread ones, say what to read: a leaf may be spread at a save and
        not yet in the objects a fresh process built (an optimizer's step count, a process's own array
        before the first jitted step made it global); it is read onto the live leaf's devices."""
        specs = (tree.get(ORBAX_FOLDER) or {}).get("specs") or {}
        live = {name: dict(flatten(self.live(name))[0]) for name in specs}
        whole = _replicated(self.spread())
        target = {name: _indexed({path: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=leaf.sharding if is_spread(leaf) else whole)
            for path in paths for leaf in [live[name][path]]}) for name, paths in specs.items()}
        root = os.path.join(local_path(url) or url, ORBAX_FOLDER)
        with _checkpointer() as checkpointer:
            restored = checkpointer.restore(root, args=ocp_args().StandardRestore(target))
        self._restored = {name: dict(zip(sorted(paths), (restored[name][str(i)] for i in range(len(paths)))))
                          for name, paths in specs.items()}

    def rebuild(self, name: str, template: Any, saved: Dict[str, Any]) -> Any:
        """A tree of ``template``'s structure: its host leaves from ``saved``, its spread leaves from
        :meth:`load`."""
        restored = (self._restored or {}).get(name, {})
        pairs, treedef = flatten(template)
        host = from_host({path: leaf for path, leaf in pairs if path not in restored}, saved)
        return jax.tree_util.tree_unflatten(treedef, [restored[p] if p in restored else host[p] for p, _ in pairs])

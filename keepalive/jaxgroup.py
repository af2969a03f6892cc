"""The collectives keepalive needs across the processes of a ``jax.distributed`` run, through JAX's own
distributed runtime: the coordination service's key-value store.

``jax.distributed.initialize()`` connects every process to a coordinator (process 0) that keeps a
key-value store and barriers; Orbax synchronises its multi-host saves through the same service.
keepalive's few collectives (:class:`keepalive.distributed.ProcessGroup`: the agreement at each
boundary, the gather of every process's random state and data position, a barrier; the folder and the
file lists of a sharded save) go through it too, never a home-made protocol and never a device
collective: they are called from a save's background thread as well as from the loop, where an XLA
collective would interleave with the training's own (on the CPU backend, gloo's).

Each collective is named and numbered: process ``r`` writes ``keepalive/<name>/<n>/<r>`` and reads the
others' keys (a blocking get, with a timeout: a process that died is said instead of a hang); every
process calls each named collective as often as the others, in the same order (as with torch's
collectives). Keys of a finished collective are deleted by process 0 once everybody has read them.

This module imports JAX only when the program has: :func:`processes` looks for an initialised
``jax.distributed`` without starting a backend (in ``jax._src.distributed.global_state``, where
``jax.distributed.initialize`` keeps its client; Orbax reads it there too).
"""
from __future__ import annotations

import pickle
import sys
import threading
from typing import Any, Dict, List, Optional

#: how long a process waits for the others at one collective (ms) before it says which did not come
TIMEOUT_MS = 300_000
#: the prefix of keepalive's keys in the coordination service
PREFIX = "keepalive"


def _client() -> Any:
    """The distributed runtime client of an initialised ``jax.distributed`` of several processes, else
    None (nothing imported or started here)."""
    state_module = sys.modules.get("jax._src.distributed")
    state = getattr(state_module, "global_state", None)
    client = getattr(state, "client", None)
    if client is None or int(getattr(state, "num_processes", 1) or 1) < 2:
        return None
    return client


class JaxProcesses:
    """This process's place among the ``jax.distributed`` processes and keepalive's collectives over
    the coordination service (any thread may call them)."""

    def __init__(self, client: Any, rank: int, world_size: int):
        self.client, self.rank, self.world_size = client, rank, world_size
        self._counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def _key(self, name: str) -> str:
        with self._lock:
            self._counts[name] = number = self._counts.get(name, 0) + 1
        return f"{PREFIX}/{name}/{number}"

    def _get(self, key: str) -> Any:
        try:
            return pickle.loads(self.client.blocking_key_value_get_bytes(key, TIMEOUT_MS))
        except Exception as exc:  # noqa: BLE001 - jaxlib raises its own error types
            raise RuntimeError(f"keepalive: process {key.rsplit('/', 1)[-1]} did not reach {key.rsplit('/', 1)[0]} "
                               f"({type(exc).__name__}: {exc})") from exc

    def all_gather(self, value: Any, name: str = "all_gather") -> List[Any]:
        """Every process's ``value`` on every process (values are pickled: live processes only)."""
        key = self._key(name)
        self.client.key_value_set_bytes(f"{key}/{self.rank}", pickle.dumps(value))
        out = [value if r == self.rank else self._get(f"{key}/{r}") for r in range(self.world_size)]
        self._done(key)
        return out

    def gather(self, value: Any, name: str = "gather") -> Optional[List[Any]]:
        """Every process's ``value`` on process 0 (None on the others)."""
        key = self._key(name)
        if self.rank != 0:
            self.client.key_value_set_bytes(f"{key}/{self.rank}", pickle.dumps(value))
            return None
        out = [value] + [self._get(f"{key}/{r}") for r in range(1, self.world_size)]
        for r in range(1, self.world_size):
            self.client.key_value_delete(f"{key}/{r}")
        return out

    def first_value(self, value: Any, name: str = "broadcast") -> Any:
        """Process 0's ``value`` on every process."""
        key = self._key(name)
        if self.rank == 0:
            self.client.key_value_set_bytes(f"{key}/0", pickle.dumps(value))
            out = value
        else:
            out = self._get(f"{key}/0")
        self._done(key)
        return out

    def max(self, values: List[int], name: str = "agree") -> List[int]:
        """The element-wise largest of every process's integers (the agreement at a boundary)."""
        every = self.all_gather([int(v) for v in values], name)
        return [max(column) for column in zip(*every)]

    def store(self) -> KeyValueStore:
        """The coordination service's key-value store, as torch's ``Store`` is called."""
        return KeyValueStore(self.client)

    def barrier(self, name: str = "barrier") -> None:
        """Wait until every process is here."""
        self.client.wait_at_barrier(self._key(name), TIMEOUT_MS)

    def _done(self, key: str) -> None:
        """Every process has read the keys of ``key``: process 0 deletes them after one more meeting
        (so none is deleted while another process still reads it)."""
        self.client.wait_at_barrier(f"{key}/read", TIMEOUT_MS)
        if self.rank == 0:
            self.client.key_value_delete(key)


class KeyValueStore:
    """The coordination service's key-value store with the few calls of torch's ``Store`` that
    :meth:`keepalive.distributed.ProcessGroup.check_in` and ``same_folder`` make (``set``, ``add``,
    ``check``, ``wait``, ``get``), so they work the same under ``jax.distributed``."""

    def __init__(self, client: Any):
        self.client = client

    def set(self, key: str, value: Any) -> None:
        data = value if isinstance(value, bytes) else str(value).encode()
        self.client.key_value_set_bytes(key, data, allow_overwrite=True)

    def add(self, key: str, amount: int) -> int:
        return int(self.client.key_value_increment(key, int(amount)))

    def check(self, keys: List[str]) -> bool:
        for key in keys:
            try:
                self.client.key_value_try_get_bytes(key)
            except Exception:  # noqa: BLE001 - jaxlib's "not found"
                return False
        return True

    def wait(self, keys: List[str], timeout: Any) -> None:
        for key in keys:
            self.client.blocking_key_value_get_bytes(key, int(timeout.total_seconds() * 1000))

    def get(self, key: str) -> bytes:
        return bytes(self.client.blocking_key_value_get_bytes(key, TIMEOUT_MS))


_CACHE: Dict[int, JaxProcesses] = {}


def processes() -> Optional[JaxProcesses]:
    """This process's :class:`JaxProcesses` under an initialised ``jax.distributed`` of several
    processes, else None."""
    client = _client()
    if client is None:
        return None
    found = _CACHE.get(id(client))
    if found is None or found.client is not client:
        state = sys.modules["jax._src.distributed"].global_state
        _CACHE.clear()
        found = _CACHE[id(client)] = JaxProcesses(client, int(state.process_id), int(state.num_processes))
    return found


__all__ = ["JaxProcesses", "KeyValueStore", "PREFIX", "TIMEOUT_MS", "processes"]

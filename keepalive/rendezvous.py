"""A restart-safe ``env://`` rendezvous for workers of torchrun's elastic agent, whatever creates the group.

Seen in torch 2.13: torchrun's c10d rendezvous keeps ONE bootstrap ``TCPStore`` server for the whole job
(``DynamicRendezvousHandler.next_rendezvous`` builds its address once, then workers get
``TORCHELASTIC_USE_AGENT_STORE=True``), while the ``env://`` handler connects every attempt's workers to
it without a prefix ("we create a new TCPStore for every retry"). A restarted attempt's gloo
``connectFullMesh`` can then read the peer addresses the previous attempt left there: "Connection
refused", then a hang until the group's timeout. Accelerate's ``Accelerator()``, the HF Trainer and
Lightning all create the group through ``env://``, so the fix must sit there, not in a keepalive call.

The guard (:func:`install`, run by ``import keepalive``) wraps torch's ``env`` (and ``tcp``) rendezvous
handlers. In a
worker of an agent store it keys the attempt's store by a generation every rank of this attempt agrees
on (:func:`attempt_store`), learnt through the store itself: ``TORCHELASTIC_RESTART_COUNT`` cannot be the
key, because on several nodes the agent whose worker did not fail restarts without incrementing it.

The handshake rests on one fact of the agent: when any worker of attempt k+1 starts, every worker of the
earlier attempts is dead (each agent stops its workers before the next rendezvous round completes). So
what the live ranks write can be told from what dead ones left by asking for an answer only a live
process can give:

* rank 0 takes a fresh generation (``add`` on a counter: larger than any earlier attempt's);
* every other rank ``r`` writes a fresh random nonce to ``hello/r`` and waits for ``welcome/<nonce>``:
  only the live rank 0 can write that key, after reading the nonce, and it holds the generation;
* rank 0 answers whatever ``hello/r`` holds (it may be a dead rank's: it keeps re-reading) until
  ``ack/<nonce>/<generation>`` appears, which only the live rank ``r`` can write.

Then every rank uses ``PrefixStore("keepalive/attempt-<generation>", store)``. A rank that died before
the handshake (in this attempt or an earlier one) leaves only keys nobody live will accept.

Importing this module imports no framework: torch's module is patched when the program imports it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import secrets
import sys
import time
from datetime import timedelta
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

#: the torch module whose handler table is patched
TORCH_RENDEZVOUS = "torch.distributed.rendezvous"
#: the rendezvous schemes that, in an agent worker, connect to the agent's shared store: ``env://`` (what
#: frameworks use) and ``tcp://`` (``init_method="tcp://$MASTER_ADDR:$MASTER_PORT"``); both go through
#: torch's ``_create_c10d_store``, which then makes a client of the agent's server
SCHEMES = ("env", "tcp")
#: every key of the handshake lives below this one, in the agent's (unprefixed) store
BASE = "keepalive/rdzv"
#: the generation counter: one ``add`` per attempt, by that attempt's rank 0
GENERATION_KEY = f"{BASE}/generation"
#: how long rank 0 waits between two looks at a rank's hello / ack (doubling up to the longest)
POLL_FIRST, POLL_LONGEST = 0.005, 0.2

#: the generation this process's group was created with by the guard (None: the guard did not make it)
guarded_generation: Optional[int] = None
_warned_unguarded = False


def agent_store() -> bool:
    """This process is a worker of torchrun's elastic agent that shares its store across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


class RendezvousTimeout(RuntimeError):
    """A peer did not take part in the handshake in time (it died, or never started)."""


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _wait(store: Any, key: str, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        store.wait([key], timedelta(seconds=remaining))
    except (RuntimeError, TimeoutError):
        raise RendezvousTimeout(what) from None


def handshake(store: Any, rank: int, world_size: int, timeout: Any) -> int:
    """The generation every rank of this attempt agrees on (see the module's docstring).

    ``store`` is the agent's shared store, unprefixed; ``timeout`` (seconds or a ``timedelta``) bounds
    the whole handshake: past it, one :class:`RendezvousTimeout` naming the rank that did not answer.
    """
    limit = _seconds(timeout)
    deadline = time.monotonic() + limit
    if rank != 0:
        nonce = secrets.token_hex(16)
        store.set(f"{BASE}/hello/{rank}", nonce)
        _wait(store, f"{BASE}/welcome/{nonce}", deadline,
              f"keepalive: rank {rank} got no answer from rank 0 in {limit:.0f} s in the restart-safe "
              f"rendezvous (rank 0 died or did not start)")
        generation = int(store.get(f"{BASE}/welcome/{nonce}"))
        store.set(f"{BASE}/ack/{nonce}/{generation}", "1")
        return generation
    generation = int(store.add(GENERATION_KEY, 1))
    for peer in range(1, world_size):
        hello_key = f"{BASE}/hello/{peer}"
        _wait(store, hello_key, deadline,
              f"keepalive: rank {peer} did not reach the restart-safe rendezvous in {limit:.0f} s "
              f"(it died or did not start)")
        answered: Optional[str] = None
        poll = POLL_FIRST
        while True:
            # the hello may be a dead rank's (an earlier attempt's): answer it, look again until the
            # live rank acknowledges this generation
            hello = store.get(hello_key).decode()
            if hello != answered:
                store.set(f"{BASE}/welcome/{hello}", str(generation))
                answered, poll = hello, POLL_FIRST
            # check() is a look without a server-side wait: a short store.wait() that times out makes
            # the C++ client log two warning lines per look
            if store.check([f"{BASE}/ack/{hello}/{generation}"]):
                break
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"keepalive: rank {peer} did not answer rank 0 in {limit:.0f} s in the restart-safe "
                    f"rendezvous (it died, or a process of an earlier attempt is still alive)")
            time.sleep(poll)
            poll = min(poll * 2, POLL_LONGEST)
    return generation


def attempt_store(store: Any, rank: int, world_size: int, timeout: Any) -> Any:
    """``store`` seen through this attempt's prefix: keys of earlier attempts are out of sight."""
    global guarded_generation
    import torch.distributed as dist

    generation = handshake(store, rank, world_size, timeout)
    guarded_generation = generation
    return dist.PrefixStore(f"keepalive/attempt-{generation}", store)


Handler = Callable[..., Iterator[Tuple[Any, int, int]]]


def guarded(handler: Handler) -> Handler:
    """torch's rendezvous ``handler`` with each attempt's keys apart in an agent worker."""
    if getattr(handler, "keepalive_guard", False):
        return handler

    def agent_safe_handler(url: str, timeout: Any = timedelta(minutes=30),
                           **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
        rendezvous = handler(url, timeout=timeout, **kwargs)
        store, rank, world_size = next(rendezvous)
        if agent_store():
            store = attempt_store(store, rank, world_size, timeout)
        yield store, rank, world_size
        yield from rendezvous  # torch's: "Unable to perform re-rendezvous using env:// method"

    agent_safe_handler.keepalive_guard = True  # type: ignore[attr-defined]
    agent_safe_handler.__wrapped__ = handler  # type: ignore[attr-defined]
    return agent_safe_handler


def patch(module: ModuleType) -> None:
    """Wrap the ``env`` and ``tcp`` handlers in torch's rendezvous module (once each)."""
    handlers = getattr(module, "_rendezvous_handlers", None)
    for scheme in SCHEMES:
        if isinstance(handlers, dict) and scheme in handlers:
            handlers[scheme] = guarded(handlers[scheme])


def unpatch(module: ModuleType) -> None:
    """Torch's own handlers again (tests' negative controls)."""
    handlers = getattr(module, "_rendezvous_handlers", None)
    for scheme in SCHEMES:
        if isinstance(handlers, dict) and scheme in handlers:
            handlers[scheme] = getattr(handlers[scheme], "__wrapped__", handlers[scheme])


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches torch's rendezvous module right after it is executed, then steps out of the import
    machinery (a one-shot post-import hook: importing keepalive must not import torch)."""

    def __init__(self) -> None:
        self._loader: Any = None

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname != TORCH_RENDEZVOUS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module's own loader again (inspect, importlib.resources ask it), then the patch
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        patch(module)
        _remove_hook()


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]


def install() -> None:
    """Wrap torch's ``env`` / ``tcp`` rendezvous handlers now if torch is imported, else when it is
    (idempotent)."""
    module = sys.modules.get(TORCH_RENDEZVOUS)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def unguarded_group_problem() -> Optional[str]:
    """The sentence to say (once) when this process's group was created by ``env://`` in a worker of an
    agent store without the guard (keepalive was imported after the group was made): a restart of this
    job may then hang; None when there is nothing to say, or it was returned once already."""
    global _warned_unguarded
    if _warned_unguarded or guarded_generation is not None or not agent_store():
        return None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        method = getattr(sys.modules.get("torch.distributed.distributed_c10d"), "_default_pg_init_method", None)
    except Exception:  # noqa: BLE001 - a half-imported torch: nothing to say
        return None
    if not (isinstance(method, str) and method.startswith(tuple(f"{s}://" for s in SCHEMES))):
        return None  # an explicit store / file://: that rendezvous is the program's own
    _warned_unguarded = True
    return ("the process group was created before keepalive was imported: a restart by torchrun "
            "(--max-restarts) may hang in gloo/NCCL connect, reading the previous attempt's addresses "
            "from torchrun's shared store. Import keepalive before creating the group (before "
            "Accelerator(), the HF Trainer or dist.init_process_group)")


__all__ = ["RendezvousTimeout", "agent_store", "attempt_store", "guarded", "handshake", "install", "patch",
           "unguarded_group_problem", "unpatch"]

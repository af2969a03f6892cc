"""The restart-safe rendezvous (keepalive/rendezvous.py) on a real TCPStore, one thread per rank.

* every rank of an attempt agrees on one generation, newer than any earlier attempt's, with the keys
  of a "previous attempt" (its ranks' hellos, welcomes, acks and generation) still in the store;
* a rank that died before the handshake (its hello left behind) and the live rank that comes later;
* a peer that never comes: one clear error line within the timeout, no hang;
* torch's ``env`` and ``tcp`` handlers wrapped, acting only in an agent-store worker; ``import keepalive`` patches torch
  whether torch was imported before or after it, and imports no torch itself;
* negative control: torch's own handler hands the new attempt the previous attempt's keys.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Dict, List

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from keepalive import rendezvous as kr  # noqa: E402
from servers import free_port  # noqa: E402  (tests/servers.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_RDZV = sys.modules["torch.distributed.rendezvous"]


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    yield store


def client(server) -> "dist.TCPStore":
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def run_ranks(server, world: int, ranks: List[int], timeout: float = 20.0,
              before: Dict[int, threading.Event] = None) -> Dict[int, object]:
    """The handshake of ``ranks`` in threads (rank r waits for ``before[r]`` first); rank -> result."""
    results: Dict[int, object] = {}

    def one(rank: int) -> None:
        if before and rank in before:
            before[rank].wait(30)
        try:
            results[rank] = kr.handshake(client(server), rank, world, timeout)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a handshake hung"
    return results


def previous_attempt(server, world: int, generation: int) -> None:
    """What a finished attempt leaves: every rank's hello, welcome, ack; the counter at ``generation``."""
    server.add(kr.GENERATION_KEY, generation)
    for rank in range(1, world):
        nonce = f"dead-{rank}"
        server.set(f"{kr.BASE}/hello/{rank}", nonce)
        server.set(f"{kr.BASE}/welcome/{nonce}", str(generation))
        server.set(f"{kr.BASE}/ack/{nonce}/{generation}", "1")


def test_every_rank_agrees_on_a_fresh_generation_despite_a_previous_attempts_keys(server):
    previous_attempt(server, 3, generation=4)
    first = run_ranks(server, 3, [0, 1, 2])
    assert set(first.values()) == {5}, first
    again = run_ranks(server, 3, [2, 1, 0])  # the next attempt, ranks started in another order
    assert set(again.values()) == {6}, again


def test_a_rank_that_died_before_the_handshake_and_its_late_successor(server):
    """Rank 2's hello is a dead process's; rank 0 answers it first; the live rank 2 starts only after
    that answer and is still welcomed with the same generation."""
    previous_attempt(server, 3, generation=1)
    server.set(f"{kr.BASE}/hello/2", "died-before-handshake")
    answered_the_dead = threading.Event()

    def watch() -> None:
        client(server).wait([f"{kr.BASE}/welcome/died-before-handshake"], timedelta(seconds=30))
        answered_the_dead.set()

    threading.Thread(target=watch, daemon=True).start()
    results = run_ranks(server, 3, [0, 1, 2], before={2: answered_the_dead})
    assert answered_the_dead.is_set()
    assert set(results.values()) == {2}, results


def test_a_peer_that_never_comes_is_one_clear_error_not_a_hang(server):
    results = run_ranks(server, 2, [0], timeout=1.0)
    assert isinstance(results[0], kr.RendezvousTimeout)
    assert str(results[0]) == ("keepalive: rank 1 did not reach the restart-safe rendezvous in 1 s "
                               "(it died or did not start)")
    # a stale hello of rank 1 (an earlier attempt's): rank 0 answers it, nobody acknowledges
    server.set(f"{kr.BASE}/hello/1", "dead")
    results = run_ranks(server, 2, [0], timeout=1.0)
    assert "rank 1 did not answer rank 0 in 1 s" in str(results[0]), results
    results = run_ranks(server, 2, [1], timeout=1.0)  # no rank 0
    assert str(results[1]) == ("keepalive: rank 1 got no answer from rank 0 in 1 s in the restart-safe "
                               "rendezvous (rank 0 died or did not start)")


def agent_env(monkeypatch, server, rank: int, world: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def test_the_handlers_keep_attempts_apart_and_torchs_own_do_not(server, monkeypatch):
    """An attempt writes a peer address into the store it got from the ``env://`` handler; the next
    attempt's store must not show it. Negative control: torch's own handler shows it."""
    agent_env(monkeypatch, server, rank=0, world=1)
    own = getattr(TORCH_RDZV._rendezvous_handlers["env"], "__wrapped__", TORCH_RDZV._rendezvous_handlers["env"])
    guarded = kr.guarded(own)
    assert kr.guarded(guarded) is guarded  # wrapping twice is wrapping once

    def attempt(handler) -> "dist.Store":
        store, rank, world = next(handler("env://", timeout=timedelta(seconds=10)))
        assert (rank, world) == (0, 1)
        return store

    attempt(guarded).set("default_pg/0//cpu//0/rank_1", "address of a dead process")
    assert not attempt(guarded).check(["default_pg/0//cpu//0/rank_1"])
    attempt(own).set("default_pg/0//cpu//0/rank_1", "address of a dead process")
    assert attempt(own).check(["default_pg/0//cpu//0/rank_1"])  # the control: torch reads it

    # init_method="tcp://MASTER_ADDR:MASTER_PORT" reaches the same shared store in an agent worker
    tcp = kr.guarded(getattr(TORCH_RDZV._rendezvous_handlers["tcp"], "__wrapped__",
                             TORCH_RDZV._rendezvous_handlers["tcp"]))
    url = f"tcp://127.0.0.1:{server.port}?rank=0&world_size=1"
    store, _, _ = next(tcp(url, timeout=timedelta(seconds=10)))
    assert not store.check(["default_pg/0//cpu//0/rank_1"])

    # not an agent worker: torch's store as is (rank 0 hosts it)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store = attempt(guarded)
    assert isinstance(store, dist.TCPStore)


def test_import_keepalive_patches_torch_before_or_after_and_imports_no_torch():
    code = ("import sys\n{first}\nassert ('torch' in sys.modules) == {torch_first}\n{second}\n"
            "for s in ('env', 'tcp', 'file'):\n"
            "    h = sys.modules['torch.distributed.rendezvous']._rendezvous_handlers[s]\n"
            "    print(getattr(h, 'keepalive_guard', False), getattr(h, '__wrapped__', h).__name__)\n")
    for first, second, torch_first in (("import keepalive", "import torch", False),
                                       ("import torch", "import keepalive", True)):
        out = subprocess.run([sys.executable, "-c", code.format(first=first, second=second,
                                                                torch_first=torch_first)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "_env_rendezvous_handler", "True", "_tcp_rendezvous_handler",
                                      "False", "_file_rendezvous_handler"], (first, out.stdout)


def test_a_group_made_without_the_guard_is_told_once(monkeypatch):
    """``unguarded_group_problem`` (what the core says at the first boundary) under an agent store."""
    import keepalive.distributed as kd

    monkeypatch.setattr(kr, "_warned_unguarded", False)
    monkeypatch.setattr(kr, "guarded_generation", None)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert kr.unguarded_group_problem() is None  # no group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    monkeypatch.setattr(c10d, "_default_pg_init_method", "file:///tmp/rdzv", raising=False)
    assert kr.unguarded_group_problem() is None  # the program's own rendezvous
    monkeypatch.setattr(c10d, "_default_pg_init_method", "env://", raising=False)
    text = kr.unguarded_group_problem()
    assert text is not None and text.startswith("the process group was created before keepalive was imported")
    assert "Import keepalive before creating the group" in text
    assert kr.unguarded_group_problem() is None  # once
    monkeypatch.setattr(kr, "_warned_unguarded", False)
    monkeypatch.setattr(kr, "guarded_generation", 3)
    assert kr.unguarded_group_problem() is None  # the guard made it
    assert kd.init_process_group.__doc__ and "restart-safe" in kd.init_process_group.__doc__

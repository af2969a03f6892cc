"""The process group a checkpointer runs in: rank, world size, and the few collectives keepalive needs.

Under ``torch.distributed`` (DDP on ``torchrun``, or processes started from a notebook) every rank runs
the same training code and the same :class:`keepalive.core.Checkpointer`. What must then be true:

* **All ranks agree on when to save and stop.** Each rank's trigger (steps, time, deadline) and its
  pending signal (SIGTERM / Ctrl-C reaching *that* rank) are combined at every boundary where a save is
  possible by one ``all_reduce`` (MAX) of a 12-integer tensor (:meth:`ProcessGroup.agree`): one small
  collective per boundary, entered by every rank, so no rank ever waits in a collective that the
  others skip. A save or stop due on any rank is done by all of them. The same tensor carries each
  rank's position (boundary kind, counters, batches in the epoch) as largest and smallest value: ranks
  that run different numbers of batches are told at the first boundary, on every rank.
* **Every rank saves.** Before the gather of a save, every rank checks in through the group's store
  (:meth:`ProcessGroup.check_in`): a save called on some ranks only is said in one line. At the first
  save, every rank reads back a token rank 0 wrote into the run folder
  (:meth:`ProcessGroup.same_folder`): a folder not shared between nodes is refused then.
* **One checkpoint, one commit.** Replicated state (model, optimizer) is taken from rank 0; every
  rank's own random state and data position are sent to rank 0 with ``gather_object`` at save time
  (:meth:`ProcessGroup.gather`) and written in the *same* checkpoint, whose manifest rank 0 writes
  last. A kill of any rank at any moment therefore leaves a complete checkpoint or none: there is no
  checkpoint with a rank's part missing.
* **Resume:** every rank reads the newest valid checkpoint, checks that all ranks picked the same one,
  and takes its own rank's part (:func:`localize`). On another world size the replicated state loads,
  the data position is carried over by *global sample*, and the message says that the run is then not
  bit-identical to an uninterrupted one.

No home-made protocol: everything goes through ``torch.distributed``, or, in a ``jax.distributed`` run
of several processes (torch.distributed not initialised), through JAX's coordination service
(:mod:`keepalive.jaxgroup`: the agreement, the gathers, the barrier, and the key-value store that
:meth:`ProcessGroup.check_in` and :meth:`ProcessGroup.same_folder` meet in). This module
imports torch only when the user's program has imported ``torch.distributed`` and initialised a process
group already, JAX's side only when the program initialised ``jax.distributed``: importing keepalive
imports no framework.
"""
from __future__ import annotations

import atexit
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import rendezvous as _rendezvous
from . import report
from .errors import KeepaliveError
from .interrupts import noted_signal, raise_for, signal_name

#: the key under which a distributed checkpoint keeps every rank's own part of the state
RANKS_KEY = "ranks"
#: what each rank contributes to a checkpoint (everything else is rank 0's, i.e. replicated)
PER_RANK = ("rng", "data")
#: how long a rank that reached a save waits for the others to reach it too before it says which
#: rank(s) never came (a save called inside ``if rank == 0:``): longer than any honest skew between
#: ranks at a save (they agreed on it one step before), far shorter than the group's timeout
CHECK_IN_SECONDS = 60.0
#: how long a rank waiting in that check-in goes on waiting after a SIGTERM / Ctrl-C was noted
#: (:meth:`ProcessGroup.check_in`): the others of a live group are a few milliseconds away, a dead
#: peer never comes
SIGNAL_GRACE_SECONDS = 2.0
#: the keys keepalive keeps in the process group's own store (per attempt: torch prefixes it)
STORE_PREFIX = "keepalive/group"
#: the kinds of boundary the ranks agree at (:meth:`ProcessGroup.agree`)
BATCH_END, EPOCH_END = 1, 2


class DistributedMisuseError(KeepaliveError, RuntimeError):
    """The ranks of a process group do not run the same checkpointing code (a save on one rank only,
    different numbers of batches, run folders that are not shared); raised on the ranks that found it,
    with one line saying which rank and what to change."""


def _torch_distributed() -> Any:
    """``torch.distributed`` when the program imported it and initialised a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001 - a half-imported torch: behave as one process
        return None
    return None


@dataclass
class Agreement:
    """What all ranks decided together at one boundary."""

    save: bool = False
    stop: bool = False
    #: a signal number (SIGINT / SIGTERM) that reached at least one rank, else None
    signal: Optional[int] = None
    #: whether the save / stop came from another rank's trigger, not this one's
    from_other_rank: bool = False


@dataclass(frozen=True)
class Position:
    """Where a rank is when it agrees: the boundary's kind (:data:`BATCH_END` / :data:`EPOCH_END`),
    the counters, and the number of batches of the running pass when the framework knows it (0: not
    known). Every rank of a correct program agrees at the same position."""

    kind: int
    epoch: int
    batch: int
    length: int = 0

    def words(self) -> str:
        where = (f"ended epoch {self.epoch}" if self.kind == EPOCH_END
                 else f"finished batch {self.batch} of epoch {self.epoch + 1}")
        return where + (f" (an epoch of {self.length} batches)" if self.length else "")


class ProcessGroup:
    """This process's place in the ``torch.distributed`` process group (or a group of one).

    Looked up at each use, not cached: a notebook may create the checkpointer before it calls
    ``init_process_group``.
    """

    def __init__(self) -> None:
        #: per collective checked in (:meth:`check_in`), how many times this process reached it
        self._arrivals: Dict[str, int] = {}
        self._group_store: Any = None
        self._store_of: Any = None  # the default group that store belongs to

    @property
    def dist(self) -> Any:
        return _torch_distributed()

    @property
    def jax(self) -> Any:
        """The ``jax.distributed`` processes (:mod:`keepalive.jaxgroup`) when torch.distributed is not
        initialised and JAX's is, with several processes; else None."""
        return _jax_processes() if self.dist is None else None

    @property
    def active(self) -> bool:
        """A process group of more than one rank is initialised."""
        dist = self.dist
        return dist.get_world_size() > 1 if dist is not None else self.jax is not None

    @property
    def rank(self) -> int:
        dist = self.dist
        return dist.get_rank() if dist is not None else getattr(self.jax, "rank", 0)

    @property
    def world_size(self) -> int:
        dist = self.dist
        return dist.get_world_size() if dist is not None else getattr(self.jax, "world_size", 1)

    @property
    def is_main(self) -> bool:
        """Rank 0 (or no process group): the rank that writes checkpoints and speaks."""
        return self.rank == 0

    def _device(self) -> Any:
        torch = sys.modules["torch"]
        if self.dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, save: bool, stop: bool, signal: Optional[int],
              position: Optional[Position] = None) -> Agreement:
        """Combine every rank's trigger decision and pending signal; the same answer on every rank.

        One ``all_reduce(MAX)`` of a few integers. Every rank must call it at the same boundaries;
        ``position`` (each value and its negation, so MAX gives both the largest and the smallest)
        tells when they do not: ranks with different numbers of batches per epoch are found at the
        first boundary, before a rank with more batches enters a collective (DDP's gradient
        all-reduce) that a rank out of batches never enters. Then every rank raises the same
        :class:`DistributedMisuseError` here, at the same collective: none is left waiting.
        """
        if not self.active:
            return Agreement(save, stop, signal)
        where = position or Position(0, 0, 0, 0)
        places = [where.kind, where.epoch, where.batch, where.length]
        local = [int(save), int(stop), int(signal or 0), int(where.length == 0)] + places + [-v for v in places]
        values = self._max(local)
        s, t, sig, some_unknown = values[:4]
        highest, lowest = values[4:8], [-v for v in values[8:12]]
        if position is not None and (highest[:3] != lowest[:3]
                                     or (not some_unknown and highest[3] != lowest[3])):
            self._uneven(where)
        return Agreement(save=bool(s), stop=bool(t), signal=sig or None,
                         from_other_rank=bool(s or t) and not (save or stop))

    def _max(self, local: List[int]) -> List[int]:
        """The element-wise largest of every rank's integers: one ``all_reduce(MAX)`` (torch), or one
        exchange through JAX's coordination service."""
        processes = self.jax
        if processes is not None:
            return [int(v) for v in processes.max(local)]
        torch = sys.modules["torch"]
        flags = torch.tensor(local, dtype=torch.int64, device=self._device())
        self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX)
        return [int(v) for v in flags.tolist()]

    def _uneven(self, position: Position) -> None:
        """The ranks agreed at different places: every rank learns every rank's (one more collective,
        entered by all of them, as they all found it in the same one) and raises the same line."""
        positions: List[Position] = self.all_gather(position)
        if len({(p.kind, p.epoch, p.batch) for p in positions}) == 1:  # the same batch, other lengths
            lengths: Dict[int, List[int]] = {}
            for rank, where in enumerate(positions):
                lengths.setdefault(where.length, []).append(rank)
            found = "the ranks have different numbers of batches per epoch (" + "; ".join(
                f"{_ranks(ranks)}: {length}" for length, ranks in lengths.items()) + ")"
        else:
            places: Dict[Position, List[int]] = {}
            for rank, where in enumerate(positions):
                places.setdefault(where, []).append(rank)
            found = "the ranks reached different boundaries (" + "; ".join(
                f"{_ranks(ranks)} {where.words()}" for where, ranks in places.items()) + ")"
        raise DistributedMisuseError(
            f"{found}: a rank with more batches would wait forever in a collective (DDP's gradient "
            "all-reduce) that the others never enter. Give the loader a DistributedSampler "
            "(torch.utils.data.distributed.DistributedSampler(dataset): every rank gets as many samples; "
            "drop_last=True drops the uneven tail instead of repeating samples) rather than splitting the data "
            "by rank yourself, or cut every rank's shard to the same number of batches; stopping every rank here")

    def gather(self, part: Any) -> Optional[List[Any]]:
        """Every rank's ``part`` as a list on rank 0 (None on the others); a collective."""
        if not self.active:
            return [part]
        if self.jax is not None:
            return self.jax.gather(part)  # type: ignore[no-any-return]
        out: Optional[List[Any]] = [None] * self.world_size if self.is_main else None
        self.dist.gather_object(part, out, dst=0)
        return out

    def all_gather(self, value: Any) -> List[Any]:
        """Every rank's ``value``, on every rank; a collective."""
        if not self.active:
            return [value]
        if self.jax is not None:
            return self.jax.all_gather(value)  # type: ignore[no-any-return]
        out: List[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, value)
        return out

    def check_in(self, what: str, how_to: str, timeout: Optional[float] = None) -> None:
        """Before a collective that a program might call on some ranks only (a save inside
        ``if rank == 0:``): wait until every rank has reached it, through the group's store (no
        collective); raise :class:`DistributedMisuseError` naming the ranks that did not, as soon as
        one of them ended (its process exited) or after ``timeout`` (:data:`CHECK_IN_SECONDS`)
        seconds, instead of a gloo "Connection closed by peer" or a silent hang. A SIGTERM or Ctrl-C
        noted while it waits ends the wait soon after (:meth:`_stop_waiting`)."""
        store = self._store()
        if store is None:
            return  # no store to meet in (a group torch made without one): the collective as before
        self._arrivals[what] = number = self._arrivals.get(what, 0) + 1
        key = f"{STORE_PREFIX}/{what}/{number}"
        store.set(f"{key}/{self.rank}", "1")
        arrived = store.add(key, 1)
        seconds = CHECK_IN_SECONDS if timeout is None else timeout
        limit = time.monotonic() + seconds
        pause = 0.001
        signalled: List[float] = []
        while arrived < self.world_size:
            self._stop_waiting(what, key, store, signalled)
            ended = int(store.add(f"{STORE_PREFIX}/ended", 0))
            if ended or time.monotonic() > limit:
                missing = [r for r in range(self.world_size) if not store.check([f"{key}/{r}"])]
                if missing:
                    gone = [r for r in missing if store.check([f"{STORE_PREFIX}/ended/{r}"])]
                    if gone or time.monotonic() > limit:
                        present = [r for r in range(self.world_size) if r not in missing]
                        why = (f"{_ranks(gone)} ended without calling it" if gone else
                               f"{_ranks(missing)} did not call it within {seconds:g} s")
                        raise DistributedMisuseError(f"{what} was called on {_ranks(present)} only: {why}. {how_to}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            arrived = int(store.add(key, 0))

    def _stop_waiting(self, what: str, key: str, store: Any, since: List[float]) -> None:
        """A signal noted while this rank waits for the others at ``what``: after
        :data:`SIGNAL_GRACE_SECONDS` more (the others of a live group come within milliseconds: they
        agreed on this save one step before), acted on without the save. A killed peer leaves no note
        that it ended, and torchrun's agent SIGTERMs the survivors and SIGKILLs them 30 s later: the
        wait must not hold the restart up. ``since``: when the signal was first seen here."""
        signum = noted_signal()
        if signum is None:
            return
        if not since:
            since.append(time.monotonic())
        if time.monotonic() - since[0] < SIGNAL_GRACE_SECONDS:
            return
        missing = [r for r in range(self.world_size) if not store.check([f"{key}/{r}"])]
        if not missing:  # every rank came meanwhile: the save goes on, the signal acts after it
            return
        report.warn(f"rank {self.rank}: {signal_name(signum)} while waiting at {what} for {_ranks(missing)}: "
                    "stopping without a new checkpoint; a restart continues from the last one")
        raise_for(signum)

    def _store(self) -> Any:
        """The store the default process group was made with (torch keeps one per restart attempt);
        None when torch offers none. Looked up again for a new group (a process that destroyed its
        group and made another: the counts of :meth:`check_in` start over with it). Each group's first
        use also notes, when this process exits, that its rank ended, so that a rank waiting in
        :meth:`check_in` for it learns at once."""
        if self.jax is not None:  # jax.distributed: its coordination service's key-value store
            if self._group_store is None or self._store_of is not self.jax:
                self._group_store, self._store_of, self._arrivals = self.jax.store(), self.jax, {}
            return self._group_store
        if _rendezvous.agent_store() and _rendezvous.guarded_generation is None:
            # a group made before keepalive was imported, in a torchrun worker: its store is the agent's,
            # shared by every restart attempt and unprefixed, so keys of a dead attempt (its check-in
            # counts, its "ended" notes, its token) would be read as this attempt's: no store checks
            return None
        try:
            world = self.dist.group.WORLD
            if self._group_store is None or self._store_of is not world:
                store = self.dist.distributed_c10d._get_default_store()
                self._group_store, self._store_of, self._arrivals = store, world, {}
                atexit.register(_note_ended, store, self.rank)
        except Exception:  # noqa: BLE001 - a private torch function: without it, no check-in
            return None
        return self._group_store

    def same_folder(self, url: str, write: Callable[[str, bytes], None], read: Callable[[str], bytes],
                    remove: Callable[[str], None]) -> None:
        """Whether every rank sees the run folder rank 0 writes to (every rank's ``url``, each
        through its own path: a folder on each node's local disk is another folder): rank 0 writes a
        token file there (``write(name, token)``), every rank reads it back (``read(name)``); if some
        cannot, every rank raises the same :class:`DistributedMisuseError`. Rank 0's token reaches the
        others through the group's store, the answers come back through one ``all_gather``. When rank
        0 cannot write the token, nothing is checked (the save that follows says why)."""
        store = self._store()
        if store is None:
            return
        # numbered: a second checkpointer of this group (another run, the next stage) must not read
        # the first one's token, whose file rank 0 has removed
        self._arrivals["shared-folder"] = number = self._arrivals.get("shared-folder", 0) + 1
        key = f"{STORE_PREFIX}/shared-folder/{number}"
        name, token = f".keepalive-shared-check-{secrets.token_hex(6)}", secrets.token_bytes(16)
        if self.is_main:
            try:
                write(name, token)
                store.set(key, name.encode() + b"\n" + token)
            except Exception:  # noqa: BLE001 - the save says it; the other ranks must not wait
                store.set(key, b"")
                name = ""
        else:
            store.wait([key], timedelta(seconds=CHECK_IN_SECONDS))
            value = bytes(store.get(key))
            name, token = (value.split(b"\n", 1)[0].decode(), value.split(b"\n", 1)[1]) if value else ("", b"")
        seen = ""  # empty: seen; else what this rank found instead
        if name and not self.is_main:
            try:
                seen = "" if read(name) == token else "another file of that name"
            except Exception as exc:  # noqa: BLE001 - not found, or no such folder here: not the same folder
                seen = type(exc).__name__
        answers = self.all_gather((seen, url))
        if self.is_main and name:
            try:
                remove(name)
            except Exception:  # noqa: BLE001 - a stray token file harms nothing
                pass
        blind = [r for r, (found, _) in enumerate(answers) if found]
        if blind:
            theirs = ", ".join(f"rank {r}'s is {u}: {found}" for r, (found, u) in enumerate(answers) if r in blind)
            raise DistributedMisuseError(
                f"the run folder is not shared between the ranks: rank 0 writes checkpoints to {answers[0][1]}, "
                f"which {_ranks(blind)} cannot read through its own run folder ({theirs}); a restart there would "
                "find no checkpoint or another one. Give every rank the same run folder on storage every node "
                "mounts (a network file system, a bucket URL), not a node's local disk")

    def barrier(self) -> None:
        """Wait until every rank is here (after a final save: no rank exits before it is durable)."""
        if self.jax is not None:
            self.jax.barrier()
        elif self.active:
            if self.dist.get_backend() == "nccl":
                self.dist.barrier(device_ids=[self._device().index])
            else:
                self.dist.barrier()


def _jax_processes() -> Any:
    """keepalive's collectives over ``jax.distributed`` when the program initialised it with several
    processes (looked up without importing JAX: a program that never did finds nothing)."""
    if "jax._src.distributed" not in sys.modules:
        return None
    from .jaxgroup import processes

    return processes()


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _note_ended(store: Any, rank: int) -> None:
    """At exit: tell a rank waiting in :meth:`ProcessGroup.check_in` that this one will never come."""
    try:
        store.set(f"{STORE_PREFIX}/ended/{rank}", "1")
        store.add(f"{STORE_PREFIX}/ended", 1)
    except Exception:  # noqa: BLE001 - the store is gone (its host exited): nobody is waiting
        pass


def combine(tree: Dict[str, Any], parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Rank 0's tree with every rank's own part (``rng``, ``data``) under :data:`RANKS_KEY`."""
    out = dict(tree)
    out[RANKS_KEY] = parts
    return out


def rank_part(tree: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a rank's tree that differs between ranks (sent to rank 0 at save time)."""
    return {k: tree.get(k) for k in PER_RANK}


def localize(tree: Dict[str, Any], rank: int, world_size: int) -> Tuple[Dict[str, Any], Optional[str]]:
    """The tree as rank ``rank`` resumes it, and a sentence when the world size changed (else None).

    Same world size: the rank's own random state and data position replace rank 0's. Another world
    size: rank ``r`` takes part ``r`` where it exists (else part 0); the data position inside the
    epoch is carried over by global sample (``position * old_world / new_world`` samples of this
    rank's share), so no sample is skipped and none is seen twice when the sizes divide evenly; the
    random streams differ from an uninterrupted run.
    """
    parts = tree.get(RANKS_KEY)
    if not parts:
        if world_size > 1:
            return tree, (f"this checkpoint was written by one process; resuming on {world_size}: "
                          "every rank starts from its random state and data position, so the data "
                          "order continues by global sample and the run is not bit-identical to an "
                          "uninterrupted one")
        return tree, None
    saved_world = len(parts)
    out = {k: v for k, v in tree.items() if k != RANKS_KEY}
    own = parts[rank] if rank < saved_world else parts[0]
    out.update({k: own.get(k) for k in PER_RANK})
    if saved_world == world_size:
        return out, None
    data = dict(out.get("data") or {})
    if data.get("position") is not None:
        global_sample = int(data["position"]) * saved_world
        data["position"] = global_sample // world_size
        data["resharded"] = {"from": saved_world, "to": world_size, "global_sample": global_sample}
        out["data"] = data
    return out, (f"this checkpoint was written by {saved_world} process(es), this run has {world_size}: "
                 f"the model and optimizer (replicated) are loaded; the data order continues by global "
                 f"sample and each rank's random state is taken from a saved rank, so the run is not "
                 f"bit-identical to an uninterrupted one")


#: the process group of this process (stateless: looks torch.distributed up at each use)
GROUP = ProcessGroup()


def init_process_group(backend: Optional[str] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, with keepalive's restart-safe
    rendezvous guard in place (:mod:`keepalive.rendezvous`).

    ``import keepalive`` installs that guard already, so torch's own call (or Accelerate's, Lightning's,
    the HF Trainer's) is just as safe when keepalive was imported first; this name stays for programs
    that call it. In a worker of torchrun's elastic agent, each restart attempt's keys are kept apart in
    the agent's shared store, under a generation every rank of the attempt agrees on (the nodes of a
    multi-node job included). Elsewhere, or with an explicit ``store`` / ``init_method`` other than
    ``env://``, this is torch's own call unchanged.
    """
    import torch.distributed as dist

    from .rendezvous import install

    install()
    dist.init_process_group(backend, **kwargs)


__all__ = ["BATCH_END", "CHECK_IN_SECONDS", "EPOCH_END", "GROUP", "Agreement", "DistributedMisuseError",
           "Position", "ProcessGroup", "RANKS_KEY", "combine", "init_process_group", "localize",
           "rank_part"]

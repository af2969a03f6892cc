"""The process group a checkpointer runs in: rank, world size, and the few collectives keepalive needs.

Under ``torch.distributed`` (DDP on ``torchrun``, or processes started from a notebook) every rank runs
the same training code and the same :class:`keepalive.core.Checkpointer`. What must then be true:

* **All ranks agree on when to save and stop.** Each rank's trigger (steps, time, deadline) and its
  pending signal (SIGTERM / Ctrl-C reaching *that* rank) are combined at every boundary where a save is
  possible by one ``all_reduce`` (MAX) of a 3-integer tensor (:meth:`ProcessGroup.agree`): one small
  collective per boundary, entered by every rank, so no rank ever waits in a collective that the
  others skip. A save or stop due on any rank is done by all of them.
* **One checkpoint, one commit.** Replicated state (model, optimizer) is taken from rank 0; every
  rank's own random state and data position are sent to rank 0 with ``gather_object`` at save time
  (:meth:`ProcessGroup.gather`) and written in the *same* checkpoint, whose manifest rank 0 writes
  last. A kill of any rank at any moment therefore leaves a complete checkpoint or none: there is no
  checkpoint with a rank's part missing.
* **Resume:** every rank reads the newest valid checkpoint, checks that all ranks picked the same one,
  and takes its own rank's part (:func:`localize`). On another world size the replicated state loads,
  the data position is carried over by *global sample*, and the message says that the run is then not
  bit-identical to an uninterrupted one.

No home-made protocol: everything goes through ``torch.distributed``. This module imports torch only
when the user's program has imported ``torch.distributed`` and initialised a process group already:
importing keepalive imports no framework.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

#: the key under which a distributed checkpoint keeps every rank's own part of the state
RANKS_KEY = "ranks"
#: what each rank contributes to a checkpoint (everything else is rank 0's, i.e. replicated)
PER_RANK = ("rng", "data")


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


class ProcessGroup:
    """This process's place in the ``torch.distributed`` process group (or a group of one).

    Looked up at each use, not cached: a notebook may create the checkpointer before it calls
    ``init_process_group``.
    """

    @property
    def dist(self) -> Any:
        return _torch_distributed()

    @property
    def active(self) -> bool:
        """A process group of more than one rank is initialised."""
        dist = self.dist
        return dist is not None and dist.get_world_size() > 1

    @property
    def rank(self) -> int:
        dist = self.dist
        return dist.get_rank() if dist is not None else 0

    @property
    def world_size(self) -> int:
        dist = self.dist
        return dist.get_world_size() if dist is not None else 1

    @property
    def is_main(self) -> bool:
        """Rank 0 (or no process group): the rank that writes checkpoints and speaks."""
        return self.rank == 0

    def _device(self) -> Any:
        torch = sys.modules["torch"]
        if self.dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, save: bool, stop: bool, signal: Optional[int]) -> Agreement:
        """Combine every rank's trigger decision and pending signal; the same answer on every rank.

        One ``all_reduce(MAX)`` of three integers. Every rank must call it at the same boundaries.
        """
        if not self.active:
            return Agreement(save, stop, signal)
        torch = sys.modules["torch"]
        local = [int(save), int(stop), int(signal or 0)]
        flags = torch.tensor(local, dtype=torch.int64, device=self._device())
        self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX)
        s, t, sig = (int(v) for v in flags.tolist())
        return Agreement(save=bool(s), stop=bool(t), signal=sig or None,
                         from_other_rank=bool(s or t) and not (save or stop))

    def gather(self, part: Any) -> Optional[List[Any]]:
        """Every rank's ``part`` as a list on rank 0 (None on the others); a collective."""
        if not self.active:
            return [part]
        out: Optional[List[Any]] = [None] * self.world_size if self.is_main else None
        self.dist.gather_object(part, out, dst=0)
        return out

    def all_gather(self, value: Any) -> List[Any]:
        """Every rank's ``value``, on every rank; a collective."""
        if not self.active:
            return [value]
        out: List[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        """Wait until every rank is here (after a final save: no rank exits before it is durable)."""
        if self.active:
            if self.dist.get_backend() == "nccl":
                self.dist.barrier(device_ids=[self._device().index])
            else:
                self.dist.barrier()


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


__all__ = ["GROUP", "Agreement", "ProcessGroup", "RANKS_KEY", "combine", "init_process_group", "localize",
           "rank_part"]

"""The shape of a checkpoint's state tree, typed: one set of key names for the core and every adapter.

A tree is a plain dict (it goes to ``state.json`` + ``tensors.safetensors`` through
:mod:`keepalive.state`); these ``TypedDict`` s only name its keys, so a misspelled key is a type error
(``mypy keepalive``) instead of a silent ``None`` at resume time.

>>> from keepalive.statetree import StateTree
>>> tree: StateTree = {"counters": {"epoch": 1, "step": 10, "batch": 0, "samples": 640}, "objects": {}}
>>> sorted(tree)
['counters', 'objects']
"""
from __future__ import annotations

from typing import Any, Dict, List, TypedDict

__all__ = ["Captured", "CountersTree", "Header", "StateTree"]


class _HeaderBase(TypedDict):
    format: int
    framework: str


class Header(_HeaderBase, total=False):
    """What wrote the tree: the format version and the framework of the adapter; ``epoch_batches``:
    the length of an epoch in batches, when the core has seen one end (it tells the training's last
    batch after a resume inside the last epoch)."""

    epoch_batches: int


class CountersTree(TypedDict):
    """Epochs completed, optimizer steps, batches done in the running epoch, samples seen."""

    epoch: int
    step: int
    batch: int
    samples: int


class Captured(TypedDict, total=False):
    """What an adapter's ``capture()`` returns: its objects, its data position, and its framework's
    own section (one of ``torch``, ``keras``, ``fastai``, ``hf``, ``lightning``, ``jax``), and the loop's variables."""

    objects: Dict[str, Any]
    data: Dict[str, Any]
    torch: Dict[str, Any]
    keras: Dict[str, Any]
    fastai: Dict[str, Any]
    hf: Dict[str, Any]
    lightning: Dict[str, Any]
    #: JAX: the PRNG settings, device count and meshes (:mod:`keepalive.callbacks._jax_objects`)
    jax: Dict[str, Any]
    #: the loop's own variables (plain values it assigns), put back on resume: :mod:`keepalive.loopstate`
    loop: Dict[str, Any]


class StateTree(Captured, total=False):
    """A whole checkpoint's state: the adapter's :class:`Captured` part plus what the core adds."""

    keepalive: Header
    counters: CountersTree
    extras: Dict[str, Any]
    rng: Dict[str, Any]
    #: under several processes: every rank's own ``rng`` and ``data`` (:mod:`keepalive.distributed`)
    ranks: List[Dict[str, Any]]
    #: FSDP2: what DCP saved in the checkpoint's folder (:mod:`keepalive.dcp`)
    dcp: Dict[str, Any]
    #: what the training code asked for (epochs, a scheduler's settings...): :mod:`keepalive.plan`
    plan: Dict[str, Any]

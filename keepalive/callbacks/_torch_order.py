"""What the order of one ``DataLoader``'s iterations is drawn from, so that a resumed iteration draws it again.

:class:`OrderSources` finds, for one loader: its samplers (samplers inside samplers too), every private
generator they and the loader hold (``generator=``, ``RandomSampler(generator=g)``, a custom sampler's
``self.rng``), the integer attributes that changed since the code built them (an epoch count:
``set_epoch``, Accelerate's and Fabric's iteration counts), and the ``state_dict()`` of a sampler that
has one. :meth:`OrderSources.record` takes them with the global random states as an iteration starts
(saved with a mid-epoch checkpoint), :meth:`OrderSources.load` puts them back before the resumed
iteration is created; :meth:`OrderSources.generators_now` is what an epoch-end checkpoint keeps.

:func:`probe` checks once that a sampler keepalive does not know replays: two deep copies generate
their first batches from the same states.
"""
from __future__ import annotations

import copy
import itertools
import random
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from .. import rng
from ._torch_positioned import Positioned
from .torchstate import RandomState

__all__ = ["OrderSources", "probe"]

_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_KNOWN_SAMPLERS = frozenset({
    "torch.utils.data.sampler.SequentialSampler", "torch.utils.data.sampler.RandomSampler",
    "torch.utils.data.sampler.SubsetRandomSampler", "torch.utils.data.sampler.WeightedRandomSampler",
    "torch.utils.data.sampler.BatchSampler", "torch.utils.data.distributed.DistributedSampler",
})
_PROBE_BATCHES = 3


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class OrderSources:
    """The samplers, private generators, counters and sampler states one loader's order is drawn from
    (see the module docstring)."""

    def __init__(self, loader: Any):
        self.loader = loader
        #: integer attributes as the code built them: those that change later are counters (an epoch)
        self._initial_ints = self._ints()

    def samplers(self) -> List[Tuple[str, Any]]:
        """The sampler objects an iteration uses, by path (samplers inside samplers too: a batch
        sampler's sampler, Accelerate's shard around the user's batch sampler)."""
        found: List[Tuple[str, Any]] = []
        seen = {id(self.loader.dataset)}
        todo: List[Tuple[str, Any, int]] = [("batch_sampler", self.loader.batch_sampler, 0),
                                            ("sampler", self.loader.sampler, 0)]
        while todo:
            path, obj, depth = todo.pop(0)
            if obj is None or id(obj) in seen or isinstance(obj, (Positioned, torch.Tensor, list, tuple)):
                continue
            seen.add(id(obj))
            found.append((path, obj))
            if depth < 3:
                todo += [(f"{path}.{a}", getattr(obj, a, None), depth + 1) for a in ("batch_sampler", "sampler")]
        return found

    def counters(self) -> Dict[str, Dict[str, int]]:
        """The integer attributes of the loader and its samplers that changed since the code built
        them (an epoch count, such as ``set_epoch`` or Accelerate's sampler keep): the order may
        depend on them."""
        now = self._ints()
        return {p: {k: v for k, v in attrs.items() if self._initial_ints.get(p, {}).get(k) != v}
                for p, attrs in now.items() if attrs != self._initial_ints.get(p)}

    def _ints(self) -> Dict[str, Dict[str, int]]:
        objects = [("loader", self.loader), *self.samplers()]
        return {p: {k: v for k, v in _plain_attrs(o).items() if type(v) is int} for p, o in objects}

    def _load_counters(self, saved: Dict[str, Dict[str, int]]) -> None:
        objects = dict(self.samplers())
        objects["loader"] = self.loader
        for path, attrs in saved.items():
            obj = objects.get(path)
            if obj is not None:
                for k, v in attrs.items():
                    object.__setattr__(obj, k, int(v))

    def generators(self) -> Dict[str, Any]:
        """Every private generator the iteration may draw from, by path (each object once)."""
        gens: Dict[str, Any] = {}
        seen = set()
        if self.loader.generator is not None:
            gens["generator"] = self.loader.generator
            seen.add(id(self.loader.generator))
        for path, obj in self.samplers():
            for attr, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
                if isinstance(value, _GENERATOR_TYPES) and id(value) not in seen:
                    seen.add(id(value))
                    gens[f"{path}.{attr}"] = value
        return gens

    # --------------------------------------------------------------------------------- states
    def record(self) -> Dict[str, Any]:
        """The states an iteration starts from (saved with a mid-epoch checkpoint)."""
        state: Dict[str, Any] = {"rng": rng.capture(),
                                 "generators": {p: RandomState(g).state_dict()
                                                for p, g in self.generators().items()},
                                 "counters": self.counters()}
        samplers = {p: s.state_dict() for p, s in self.samplers() if callable(getattr(s, "state_dict", None))
                    and callable(getattr(s, "load_state_dict", None))}
        if samplers:
            state["samplers"] = samplers
        return state

    def load(self, at: Dict[str, Any]) -> None:
        """Put back :meth:`record` (the global random states too)."""
        if at.get("rng") is not None:
            rng.restore(at["rng"])
        self._load_generators(at.get("generators") or {})
        self._load_counters(at.get("counters") or {})
        samplers = dict(self.samplers())
        for path, sd in (at.get("samplers") or {}).items():
            if path in samplers:
                samplers[path].load_state_dict(sd)

    def generators_now(self) -> Dict[str, Any]:
        """The private generators' states and the samplers' counters now (an epoch-end checkpoint:
        where the next epoch starts)."""
        return {"generators": {p: RandomState(g).state_dict() for p, g in self.generators().items()},
                "counters": self.counters()}

    def load_generators(self, states: Dict[str, Any]) -> None:
        """Put back :meth:`generators_now`."""
        self._load_generators(states.get("generators") or {})
        self._load_counters(states.get("counters") or {})

    def _load_generators(self, states: Dict[str, Any]) -> None:
        gens = self.generators()
        for path, sd in states.items():
            if path in gens:
                RandomState(gens[path]).load_state_dict(sd)


def probe(loader: Any, index_sampler: Any, samplers: List[Tuple[str, Any]]) -> str:
    """'' when the order of ``loader`` (its ``samplers``, by path) replays from the recorded states,
    else why not. Known samplers pass; another one generates its first batches twice, on deep copies
    of ``index_sampler`` (the dataset shared, not copied), from the same states."""
    if all(_qualname(s) in _KNOWN_SAMPLERS for _, s in samplers):
        return ""
    name = type(next(s for _, s in samplers if _qualname(s) not in _KNOWN_SAMPLERS)).__name__
    saved = rng.capture()
    memo_base = {id(loader.dataset): loader.dataset}
    firsts, mutated = [], False
    try:
        for _ in range(2):
            rng.restore(saved)
            twin = copy.deepcopy(index_sampler, dict(memo_base))
            before = _chain_attrs(twin, ints=False)
            firsts.append([_as_list(b) for b in itertools.islice(iter(twin), _PROBE_BATCHES)])
            mutated = mutated or _chain_attrs(twin, ints=False) != before
    except Exception as e:  # a sampler that cannot be copied: cannot be checked either
        return (f"sampler {name} cannot be copied to check that its order replays ({type(e).__name__}: "
                f"{e}); checkpoints at epoch ends only")
    finally:
        rng.restore(saved)
    if firsts[0] != firsts[1]:
        return (f"sampler {name} gives another order from the same random state (it draws from a "
                "source keepalive cannot save: a time, os.urandom, an unregistered generator); a "
                "resumed epoch would see other batches: checkpoints at epoch ends only")
    if mutated and not callable(getattr(index_sampler, "state_dict", None)):
        return (f"sampler {name} changes its own attributes when iterated, which keepalive cannot "
                "restore: give it state_dict()/load_state_dict(); until then checkpoints at epoch "
                "ends only")
    return ""


def _chain_attrs(sampler: Any, ints: bool = True) -> List[Dict[str, Any]]:
    """The plain attributes of a sampler and of the samplers inside it (``ints=False``: without its
    integers, which keepalive saves and restores when they change: an epoch counter)."""
    out = []
    for _ in range(4):
        if sampler is None:
            break
        out.append({k: v for k, v in _plain_attrs(sampler).items() if ints or type(v) is not int})
        sampler = getattr(sampler, "sampler", None) or getattr(sampler, "batch_sampler", None)
    return out


def _plain_attrs(obj: Any) -> Dict[str, Any]:
    if not hasattr(obj, "__dict__"):
        return {}
    return {k: v for k, v in vars(obj).items() if isinstance(v, (int, float, str, bool, tuple, type(None)))}


def _as_list(b: Any) -> Any:
    if isinstance(b, torch.Tensor):
        return b.tolist()
    if isinstance(b, (list, tuple)):
        return [_as_list(v) for v in b]
    return b

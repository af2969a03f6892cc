"""The objects a JAX ``DriveCheckpoint`` saves, and a loaded checkpoint put back into them.

Two kinds, by what the training code does with them:

* **NNX objects** (``nnx.Module``, ``nnx.Optimizer``, ``nnx.MultiMetric``, ``nnx.Rngs``: anything
  ``nnx.state`` reads) change in place: saved through ``nnx.state(obj)`` (as a pure dict, its
  ``nnx.Rngs`` keys and counts included) and restored into the live object with
  ``nnx.replace_by_pure_dict`` + ``nnx.update``.
* **functional states** (a Linen ``TrainState``, any pytree of arrays the loop rebinds:
  ``state = train_step(state, batch)``) are handed over by the loop (``ckpt.update(state)``): the latest
  one is saved, and a resume hands the restored one back (``ckpt.state``), built on the registered
  template (its structure, dtypes and shardings; its functions such as ``apply_fn`` and ``tx``).

Beside them the ``jax`` section records what a bit-exact resume needs the same: the PRNG
implementation and ``jax_threefry_partitionable`` (checked: another value refuses the checkpoint with
one line), the device and process counts, and the saved arrays' mesh (another one is said).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import jax
import numpy as np
from flax import nnx

from ..config import CheckpointConfig
from ..core import Checkpointer
from ..errors import StateMismatchError, UnsupportedStateError
from ..statetree import StateTree
from ._jax_arrays import check_tree, flatten, from_host, to_host

__all__ = ["JaxObjects", "is_nnx", "prng_settings"]

#: the JAX settings a run's random numbers depend on: (config name, what the fix sets)
PRNG_SETTINGS = ("jax_default_prng_impl", "jax_threefry_partitionable")


def is_nnx(obj: Any) -> bool:
    """An NNX object (a module, an optimizer, metrics, ``nnx.Rngs``): its state changes in place."""
    return isinstance(obj, nnx.Pytree)


def prng_settings() -> Dict[str, Any]:
    """The JAX settings of this process that the random numbers depend on."""
    return {name: getattr(jax.config, name) for name in PRNG_SETTINGS}


def _mesh_of(tree: Any) -> Optional[Dict[str, int]]:
    """The mesh axes of the first leaf sharded over a named mesh (None: none is)."""
    for _, leaf in flatten(tree)[0]:
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "shape", None):
            return {str(k): int(v) for k, v in dict(mesh.shape).items()}
    return None


class JaxObjects:
    """The registered NNX objects (``nnx``) and functional states (``trees``) of one ``DriveCheckpoint``."""

    def __init__(self, core: Checkpointer):
        self.core = core
        self.nnx: Dict[str, Any] = {}
        #: each functional state as the loop last handed it over (the restored one after a resume)
        self.trees: Dict[str, Any] = {}
        self.after_resume = False
        #: functional states restored by a resume and not yet taken by the loop (``ckpt.state``)
        self.untaken: Dict[str, Any] = {}

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """See :meth:`keepalive.callbacks.jax.DriveCheckpoint.register`."""
        if is_nnx(obj):
            self.nnx[name] = obj
            return
        leaves = flatten(obj)[0]
        if not any(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for _, leaf in leaves):
            if CheckpointConfig.closest(name) is not None:  # a misspelled option, not a state
                raise CheckpointConfig.unexpected("DriveCheckpoint", name)
            raise TypeError(f"{name}: a {type(obj).__name__} with no array in it is neither an NNX object nor a "
                            "train state; pass an nnx.Module / nnx.Optimizer / nnx.MultiMetric, or a pytree of "
                            "arrays (a TrainState; a Linen module holds no weights: pass its TrainState or "
                            "variables), or keep plain values in ckpt.extras")
        self.trees[name] = obj

    def hand_over(self, name: str, tree: Any) -> None:
        """The loop's new functional state ``name`` (after a training step)."""
        if name not in self.trees:
            known = ", ".join(sorted(self.trees)) or "none"
            raise KeyError(f"ckpt.update({name}=...): no functional state is registered as '{name}' (registered: "
                           f"{known}); pass it to DriveCheckpoint({name}=...) or ckpt.register('{name}', ...)")
        if name in self.untaken:
            self._tell_untaken(name)
        self.trees[name] = tree

    def take(self, name: str) -> Any:
        """The functional state ``name`` for the loop (the restored one after a resume)."""
        self.untaken.pop(name, None)
        return self.trees[name]

    def _tell_untaken(self, name: str) -> None:
        """A state handed over after a resume although the loop never took the restored one: it trains
        on from the state its code built, under the checkpoint's counters. Said once."""
        del self.untaken[name]
        getter = "ckpt.state" if name == "state" else f"ckpt.get('{name}')"
        self.core.warn(
            f"ckpt.update({name}=...) after a resume, but the loop never took the restored {name} ({getter}): "
            f"it trains on from the {name} your code built, not the checkpoint's, while the counters say "
            f"epoch {self.core.counters['epoch']}. Write `{name} = {getter}` after creating the DriveCheckpoint, "
            "before the loop.", key=f"jax-untaken:{name}")

    def owns(self, value: Any) -> bool:
        """``value`` is one of the registered objects or states (a loop variable keepalive saves itself)."""
        return any(value is v for v in (*self.nnx.values(), *self.trees.values()))

    def _live(self, name: str) -> Any:
        return nnx.to_pure_dict(nnx.state(self.nnx[name])) if name in self.nnx else self.trees[name]

    live = _live  # the object's state as a pytree (what ``_jax_orbax`` reads the spread leaves from)

    # ---------------------------------------------------------------------------- the checkpoint
    def states(self, preview: bool = False) -> Dict[str, Any]:
        """The ``objects`` part of a checkpoint: each object's state as host arrays, flat by path
        (``preview``: empty arrays of their dtypes, nothing copied)."""
        out = {}
        for name in (*self.nnx, *self.trees):
            live = self._live(name)
            self._check_alive(name, live)
            spread = self.core.dcp_objects  # several processes: their spread leaves go through Orbax
            out[name] = to_host(live if spread is None else spread.host_part(live), preview=preview)
        return out

    def _check_alive(self, name: str, tree: Any) -> None:
        """Raise (one line) when an array of ``tree`` was donated to a jitted step: the state handed
        over is not the newest (``ckpt.update()`` was not called with the state the step returned)."""
        dead = [path for path, leaf in flatten(tree)[0] if isinstance(leaf, jax.Array) and leaf.is_deleted()]
        if dead:
            raise UnsupportedStateError(
                f"{name}: '{dead[0]}' ({len(dead)} array(s) in all) was donated to a jitted step (donate_argnums) "
                f"before this save, so the {name} keepalive holds is not the newest: hand it over with "
                f"ckpt.update({name}=...) right after each step that returns it")

    def section(self) -> Dict[str, Any]:
        """The ``jax`` part: the PRNG settings, the devices, each object's kind and mesh."""
        meshes = {n: m for n in (*self.nnx, *self.trees) if (m := _mesh_of(self._live(n))) is not None}
        return {**prng_settings(), "devices": jax.device_count(), "processes": jax.process_count(),
                "kinds": {**{n: "nnx" for n in self.nnx}, **{n: "state" for n in self.trees}},
                "meshes": meshes}

    # --------------------------------------------------------------------------------- resume
    def check_fits(self, tree: StateTree) -> None:
        """Raise (one line) if the loaded ``tree`` does not fit: other PRNG settings, a registered name
        it lacks, other paths, shapes or dtypes. Nothing is loaded before this passes."""
        where = self.core.loaded_url
        saved_jax = tree.get("jax") or {}
        for setting, value in prng_settings().items():
            if setting in saved_jax and saved_jax[setting] != value:
                raise StateMismatchError(
                    f"the checkpoint {where} was trained with {setting}={saved_jax[setting]!r} and this process "
                    f"has {value!r}: its random numbers would differ. Set "
                    f"jax.config.update('{setting}', {saved_jax[setting]!r}) before building the model (or "
                    "start a new run). Nothing was loaded.")
        objects = tree.get("objects") or {}
        for name in (*self.nnx, *self.trees):
            if name not in objects:
                raise StateMismatchError(
                    f"{name} is not in the checkpoint {where} (it holds {sorted(objects)}); register the "
                    "objects it was saved with, or start a new run. Nothing was loaded.")
            spread = self.core.dcp_objects
            saved = objects[name] if spread is None else spread.with_specs(name, objects[name], tree)
            check_tree(name, self._live(name), saved, where)

    def restore(self, tree: StateTree) -> None:
        """Put a checked tree's states into the NNX objects (in place) and the functional states."""
        objects = tree.get("objects") or {}
        spread, where = self.core.dcp_objects, self.core.resumed_from
        if spread is not None and where is not None:  # several processes: a collective, Orbax reshards
            spread.load(where.url, tree)
        rebuild = (lambda t, s, n: from_host(t, s)) if spread is None else (lambda t, s, n: spread.rebuild(n, t, s))
        for name, obj in self.nnx.items():
            state = nnx.state(obj)
            nnx.replace_by_pure_dict(state, rebuild(nnx.to_pure_dict(state), objects[name], name))
            nnx.update(obj, state)
        for name, template in list(self.trees.items()):
            self.trees[name] = self.untaken[name] = rebuild(template, objects[name], name)
        self._tell_layout(tree.get("jax") or {})

    def _tell_layout(self, saved: Dict[str, Any]) -> None:
        """Another device count or mesh than the checkpoint's: the arrays take the live layout (said)."""
        now = jax.device_count()
        before = saved.get("devices")
        if before is not None and int(before) != now:
            self.core.warn(f"the checkpoint was saved on {before} JAX device(s), this process has {now}: the arrays "
                           "are put back with the live objects' sharding; a loop whose batches depend on the "
                           "device count (a per-device batch size) differs from an uninterrupted run.",
                           key="jax-devices")
        for name, mesh in (saved.get("meshes") or {}).items():
            live = _mesh_of(self._live(name)) if name in self.nnx or name in self.trees else None
            if live is not None and live != mesh:
                self.core.warn(f"{name}: saved on the mesh {mesh}, resumed on {live}: its arrays take the live "
                               "sharding (resharded).", key=f"jax-mesh:{name}")

    def names(self) -> List[str]:
        return [*self.nnx, *self.trees]

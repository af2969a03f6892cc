"""JAX pytrees as keepalive stores them: flat, on the host, and put back with the live template's layout.

A registered pytree (an NNX object's ``nnx.state(...)`` as a pure dict, a Linen ``TrainState``, any
pytree of arrays) is saved as one flat dict ``{"path/to/leaf": value}``: ``jax.Array`` leaves as they
are (the store holds them by reference, starts their transfer to the host and copies them after the
save returned, gathered from every device of a sharded array; they are read back as numpy arrays),
typed PRNG keys as their key data and the name of their implementation (``jax.random.key_data`` /
``key_impl``: reading a key draws nothing), numpy arrays copied, Python scalars as they are.

On resume the saved leaves are checked against the live template (the same paths, shapes, dtypes and
key implementations: :func:`check_tree` raises :class:`~keepalive.errors.StateMismatchError` before
anything changes), then rebuilt with the template's dtype and sharding (``jax.device_put`` with the
live leaf's sharding: a data-parallel mesh resumes on the same mesh) and its tree structure.

>>> import jax.numpy as jnp
>>> tree = {"w": jnp.ones((2, 3)), "step": 4}
>>> flat = to_host(tree)
>>> sorted(flat), flat["w"].shape
(['step', 'w'], (2, 3))
>>> back = from_host(tree, flat)
>>> bool((back["w"] == tree["w"]).all()), back["step"]
(True, 4)
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import jax
import numpy as np

from ..errors import StateMismatchError

__all__ = ["KEY_DATA", "KEY_IMPL", "check_tree", "flatten", "from_host", "is_key", "key_impl", "to_host"]

#: the two entries a PRNG key leaf is saved as
KEY_DATA, KEY_IMPL = "key_data", "impl"


def _entry(k: Any) -> str:
    """One step of a pytree path as text: a dict key, a sequence index or an attribute's name."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree: Any) -> Tuple[List[Tuple[str, Any]], Any]:
    """``[(path, leaf)]`` in the tree's order, and its structure (``jax.tree_util``'s)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_entry(k) for k in path) or "(root)", leaf) for path, leaf in pairs], treedef


def is_key(x: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``, what ``nnx.Rngs`` holds)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_impl(x: Any) -> str:
    """The name of a typed key's implementation (``threefry2x32``, ``rbg``...)."""
    return str(jax.random.key_impl(x))


def _host(leaf: Any) -> Any:
    if is_key(leaf):
        return {KEY_DATA: jax.random.key_data(leaf), KEY_IMPL: key_impl(leaf)}
    if isinstance(leaf, jax.Array):
        # the array itself: it never changes in place, and the store copies it to the host after the
        # save returned (a lazy snapshot, settled before the loop's next step may donate it)
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.array(leaf)  # a copy: the loop may change a numpy array in place
    return leaf


def _empty(leaf: Any) -> Any:
    """A leaf's stand-in of its stored dtype and no element (what a check of the state's dtypes reads)."""
    if is_key(leaf):
        return {KEY_DATA: np.empty((0,), np.uint32), KEY_IMPL: key_impl(leaf)}
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return np.empty((0,), np.dtype(leaf.dtype))
    return leaf


def to_host(tree: Any, *, preview: bool = False) -> Dict[str, Any]:
    """The tree's leaves as host values, flat by path (see the module docstring); ``preview``: empty
    arrays of the leaves' dtypes (nothing copied: the check at the loop's start that all can be stored)."""
    return {path: (_empty if preview else _host)(leaf) for path, leaf in flatten(tree)[0]}


def _spec(leaf: Any) -> Tuple[Any, Any]:
    """(shape, dtype name) of a live leaf as it is saved; the key data's for a key."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), f"key<{key_impl(leaf)}>"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(int(d) for d in leaf.shape), str(leaf.dtype)
    return None, type(leaf).__name__


def _saved_spec(value: Any) -> Tuple[Any, Any]:
    if isinstance(value, dict) and KEY_DATA in value:
        return tuple(np.shape(value[KEY_DATA])), f"key<{value.get(KEY_IMPL)}>"
    if isinstance(value, np.ndarray):
        return tuple(value.shape), str(value.dtype)
    return None, type(value).__name__


def check_tree(name: str, live: Any, saved: Dict[str, Any], where: str) -> None:
    """Raise :class:`StateMismatchError` (one line) at the first difference between the live tree and
    a saved flat dict: a path only one has, another shape, dtype or key implementation."""
    pairs = flatten(live)[0]
    paths = [p for p, _ in pairs]
    missing = [p for p in paths if p not in saved]
    if missing:
        raise StateMismatchError(
            f"{name}: '{missing[0]}' is not in the checkpoint {where} ({len(missing)} leaves missing of "
            f"{len(paths)}); the model or state differs. Nothing was loaded.")
    extra = [p for p in saved if p not in set(paths)]
    if extra:
        raise StateMismatchError(
            f"{name}: the checkpoint {where} has '{extra[0]}' that the live {name} lacks ({len(extra)} in "
            "all); the model or state differs. Nothing was loaded.")
    for path, leaf in pairs:
        (shape, dtype), (saved_shape, saved_dtype) = _spec(leaf), _saved_spec(saved[path])
        if _scalars(leaf, saved[path]):
            continue  # a step count built as 0 that the first jitted step made a 0-d array
        if shape != saved_shape:
            raise StateMismatchError(
                f"{name}: '{path}' has shape {saved_shape} in the checkpoint {where} but {shape} here; "
                "the model or state differs. Nothing was loaded.")
        if dtype != saved_dtype:
            raise StateMismatchError(
                f"{name}: '{path}' has dtype {saved_dtype} in the checkpoint {where} but {dtype} here; "
                "build it with the checkpoint's dtype. Nothing was loaded.")


def _scalars(live: Any, saved: Any) -> bool:
    """A Python number on one side and a number or a 0-d array on the other: the same leaf."""
    def number(x: Any) -> bool:
        return isinstance(x, (bool, int, float)) or (np.ndim(x) == 0 and not is_key(x)
                                                     and not isinstance(x, dict))
    return (isinstance(live, (bool, int, float)) or isinstance(saved, (bool, int, float))) and \
        number(live) and number(saved)


def _put(template: Any, value: Any) -> Any:
    """A saved leaf rebuilt like its live template: on its devices, with its sharding and dtype."""
    if is_key(template):
        data = jax.device_put(np.asarray(value[KEY_DATA]), template.sharding)
        return jax.random.wrap_key_data(data, impl=value[KEY_IMPL])
    if isinstance(template, jax.Array):
        return jax.device_put(np.asarray(value, dtype=template.dtype), template.sharding)
    if isinstance(template, np.ndarray):
        return np.array(value, dtype=template.dtype)
    if isinstance(template, np.generic):
        return template.dtype.type(value)
    if isinstance(value, np.ndarray):  # a 0-d array where the code starts from a Python number
        return jax.device_put(value)
    return type(template)(value) if isinstance(template, (bool, int, float)) else value


def from_host(template: Any, saved: Dict[str, Any]) -> Any:
    """A tree of ``template``'s structure whose leaves are the saved ones (checked by :func:`check_tree`)."""
    pairs, treedef = flatten(template)
    return jax.tree_util.tree_unflatten(treedef, [_put(leaf, saved[path]) for path, leaf in pairs])

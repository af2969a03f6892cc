"""Capture and restore the global random number generators a training depends on.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator and every CUDA device's
generator (only when torch is already imported; this module never imports a framework). Adapters can
add their own (Keras seed generators, TensorFlow's global generator) with :func:`register`.

A private generator the user registers (``random.Random``, ``np.random.Generator`` /
``RandomState``) is saved with :func:`generator_state` and put back with :func:`set_generator_state`,
one format for every adapter:

>>> g = np.random.default_rng(7)
>>> saved = generator_state(g)
>>> first = g.random()
>>> set_generator_state(g, saved)
>>> g.random() == first
True
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Dict, Iterator, Tuple, Union

import numpy as np

_PROVIDERS: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]] = {}

#: the private generators :func:`generator_state` covers (torch's ``Generator`` is the torch adapter's)
GENERATORS = (random.Random, np.random.Generator, np.random.RandomState)
Generator = Union[random.Random, np.random.Generator, np.random.RandomState]


def register(name: str, capture: Callable[[], Any], restore: Callable[[Any], None]) -> None:
    """Add a generator (e.g. a framework's) to what :func:`capture` / :func:`restore` cover."""
    _PROVIDERS[name] = (capture, restore)


def capture() -> Dict[str, Any]:
    state: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
    for name, (cap, _) in _PROVIDERS.items():
        state[name] = cap()
    return state


def restore(state: Dict[str, Any]) -> None:
    if "python" in state:
        random.setstate(_as_tuple(state["python"]))
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None:
        if "torch_cpu" in state:
            torch.set_rng_state(state["torch_cpu"].clone())
        if "torch_cuda" in state and torch.cuda.is_available():
            saved = [s.clone() for s in state["torch_cuda"]]
            torch.cuda.set_rng_state_all(saved[: torch.cuda.device_count()])
    for name, (_, res) in _PROVIDERS.items():
        if name in state:
            res(state[name])


@contextlib.contextmanager
def unchanged() -> Iterator[None]:
    """Every generator :func:`capture` covers is left as it was by the block, whatever it draws (user
    code keepalive calls to look at something: a batch, a schedule) and however it ends."""
    state = capture()
    try:
        yield
    finally:
        restore(state)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def generator_state(g: Generator) -> Dict[str, Any]:
    """A private generator's state as a storable tree: a numpy bit generator's 128-bit integers as text
    (JSON readers other than Python's cap integers), the rest as arrays and numbers."""
    if isinstance(g, np.random.Generator):
        return {"numpy_generator": _ints_as_text(g.bit_generator.state)}
    if isinstance(g, np.random.RandomState):
        name, keys, pos, has_gauss, gauss = g.get_state()
        return {"numpy_legacy": [name, np.asarray(keys), int(pos), int(has_gauss), float(gauss)]}
    version, internal, gauss = g.getstate()
    return {"python": [version, np.asarray(internal, dtype=np.uint64), gauss]}


def set_generator_state(g: Generator, state: Dict[str, Any]) -> None:
    """Put back a state :func:`generator_state` took (into a generator of the same kind)."""
    if "numpy_generator" in state:
        g.bit_generator.state = _text_as_ints(state["numpy_generator"])  # type: ignore[union-attr]
    elif "numpy_legacy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy_legacy"]
        g.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),  # type: ignore[union-attr]
                     float(gauss)))
    else:
        version, internal, gauss = state["python"]
        g.setstate((int(version), tuple(int(v) for v in internal), gauss))  # type: ignore[union-attr]


def _ints_as_text(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _ints_as_text(v) for k, v in x.items()}
    if isinstance(x, int) and not isinstance(x, bool):
        return {"int": str(x)}
    return x


def _text_as_ints(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"int"}:
            return int(x["int"])
        return {k: _text_as_ints(v) for k, v in x.items()}
    return x

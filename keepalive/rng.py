"""Capture and restore the global random number generators a training depends on.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator and every CUDA device's
generator (only when torch is already imported; this module never imports a framework). Adapters can
add their own (Keras seed generators, TensorFlow's global generator) with :func:`register`.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Dict, Iterator, Tuple

import numpy as np

_PROVIDERS: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]] = {}


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

"""What every ``DriveCheckpoint`` adapter shares: views on its run, save / flush / close, ``with``,
and the check that a checkpoint fits the live objects before anything is loaded.

An adapter subclasses :class:`CheckpointAdapter` (or :class:`RunViews` where the framework's own base
class already has ``epoch`` / ``step``, as fastai's ``Callback`` does), creates ``self.core`` (a
:class:`keepalive.core.Checkpointer`), and implements the contract's two methods: ``capture()`` (its
objects' state as a :class:`~keepalive.statetree.Captured` tree) and ``restore(tree)`` (a loaded
:class:`~keepalive.statetree.StateTree` put back into its objects), plus its framework's hooks, which
call the core at boundaries (``core.advance`` / ``core.end_epoch`` / ``core.end_stage``); nothing
else. The framework internals an adapter relies on are listed in its ``callbacks/_compat_*.py``.

>>> from keepalive.adapter import check_fits
>>> import numpy as np
>>> check_fits("model", {"w": np.zeros((3, 2))}, {"w": np.zeros((3, 2))}, where="ckpt-1")
>>> check_fits("model", {"w": np.zeros((3, 2))}, {"w": np.zeros((4, 2))}, where="ckpt-1")
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
keepalive.errors.StateMismatchError: model: 'w' has shape (4, 2) in the checkpoint ckpt-1 but (3, 2) here; ...
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, MutableMapping, Optional, Sequence

from .errors import StateMismatchError
from .statetree import Captured, StateTree

if TYPE_CHECKING:  # the adapters build their Checkpointer; this module only names its type
    from .core import Checkpointer

__all__ = ["RunViews", "CheckpointAdapter", "check_fits", "shape_of"]


class RunViews(abc.ABC):
    """The adapter contract (:meth:`capture`, :meth:`restore`) and read-only views on ``self.core``."""

    core: "Checkpointer"

    @abc.abstractmethod
    def capture(self) -> Captured:
        """The adapter's objects as a state tree (``objects``, ``data``, its framework's section)."""

    @abc.abstractmethod
    def restore(self, tree: StateTree) -> None:
        """Put a loaded checkpoint's state into the live objects (it was checked to fit first)."""

    @property
    def counters(self) -> MutableMapping[str, int]:
        """``epoch`` (completed), ``step`` (optimizer steps), ``batch`` (within the epoch), ``samples``."""
        return self.core.counters

    @property
    def extras(self) -> Dict[str, Any]:
        """Your own JSON-able values, saved and restored with the state (e.g. the best metric)."""
        return self.core.extras

    @property
    def finished(self) -> bool:
        """True once training ran to its end (and that end is checkpointed)."""
        return self.core.finished

    @property
    def stopped(self) -> bool:
        """True when training ended early to save before the session's deadline."""
        return self.core.stopped

    @property
    def url(self) -> str:
        """The run folder (local path or URL)."""
        return self.core.url

    # ------------------------------------------------------------------------------- actions
    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``), e.g. after validation."""
        self.core.save(self.capture, sync=sync, reason="by hand")

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the write in flight and the uploads (at most ``timeout`` seconds)."""
        self.core.flush(timeout)

    def close(self) -> None:
        """Finish the write in flight and release the run's writer lease."""
        self.core.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CheckpointAdapter(RunViews):
    """:class:`RunViews` plus ``epoch`` and ``step``."""

    @property
    def epoch(self) -> int:
        """Epochs completed (the next epoch to run)."""
        return self.core.counters["epoch"]

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.core.counters["step"]


# ----------------------------------------------------------------------------------- fit check
def shape_of(x: Any) -> Any:
    """An array's shape as a tuple of ints, else the value's type name."""
    try:
        shape = getattr(x, "shape", None)
        if shape is not None:
            return tuple(int(d) for d in shape)
    except (TypeError, RuntimeError):  # torch's lazy parameters have no shape before their first use
        pass
    return type(x).__name__


def _is_array(x: Any) -> bool:
    try:
        return hasattr(x, "shape") and hasattr(x, "dtype")
    except RuntimeError:
        return True  # an uninitialised (lazy) tensor


def _shape_known(x: Any) -> bool:
    try:
        x.shape  # noqa: B018 - reading it is the test
        return True
    except (AttributeError, RuntimeError):
        return False


def check_fits(name: str, live: Any, saved: Any, *, where: str, names: Optional[Sequence[str]] = None,
               lacks: str = "the architecture differs") -> None:
    """Raise :class:`~keepalive.errors.StateMismatchError` naming the first difference between a live
    state tree and a saved one (missing or extra keys, list lengths, array shapes). Nothing is loaded
    before this passes, so a refused checkpoint changes nothing.

    ``names`` label the entries of a top-level list (e.g. Keras variable paths); ``lacks`` says what a
    difference means.
    """
    _compare(name, live, saved, [], where, names, lacks)


def _label(path: List[str]) -> str:
    return ".".join(path) if path else "(root)"


def _compare(name: str, live: Any, saved: Any, path: List[str], where: str,
             names: Optional[Sequence[str]], lacks: str) -> None:
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            raise StateMismatchError(f"{name}: '{_label(path)}' is a mapping here but a "
                                     f"{type(saved).__name__} in the checkpoint {where}. Nothing was loaded.")
        for key, value in live.items():
            if key not in saved:
                raise StateMismatchError(
                    f"{name}: '{_label(path + [str(key)])}' is not in the checkpoint {where} (it has "
                    f"{len(saved)} entries there); {lacks}. Nothing was loaded.")
            _compare(name, value, saved[key], path + [str(key)], where, None, lacks)
        extra = [k for k in saved if k not in live]
        if extra:
            raise StateMismatchError(
                f"{name}: the checkpoint {where} has '{_label(path + [str(extra[0])])}' that the live "
                f"{name} lacks ({len(extra)} in all); {lacks}. Nothing was loaded.")
        return
    if isinstance(live, (list, tuple)) and not _is_array(live):
        if not isinstance(saved, (list, tuple)):
            raise StateMismatchError(f"{name}: '{_label(path)}' is a list here but a "
                                     f"{type(saved).__name__} in the checkpoint {where}. Nothing was loaded.")
        if len(saved) != len(live):
            raise StateMismatchError(
                f"{name}: the checkpoint {where} has {len(saved)} entries at '{_label(path)}', the live "
                f"{name} {len(live)}; {lacks}. Nothing was loaded.")
        for i, (a, b) in enumerate(zip(live, saved)):
            label = names[i] if names is not None and i < len(names) else str(i)
            _compare(name, a, b, path + [label], where, None, lacks)
        return
    # a lazy parameter that has not run yet takes the saved shape when it is loaded
    if _is_array(live) and _shape_known(live) and shape_of(live) != shape_of(saved):
        raise StateMismatchError(
            f"{name}: '{_label(path)}' has shape {shape_of(saved)} in the checkpoint {where} but "
            f"{shape_of(live)} here; {lacks}. Nothing was loaded.")

"""A ``Trainer`` subclass's own counters: what it keeps beside ``TrainerState`` that feeds ``log_history``.

Libraries built on the Hugging Face ``Trainer`` accumulate their own metrics on the instance: TRL's
``SFTTrainer`` keeps ``self._metrics`` (per ``"train"`` / ``"eval"``, lists of entropies and token
accuracies averaged into the next log) and ``self._total_train_tokens`` (logged as ``num_tokens``).
``TrainerState`` does not hold them: a resumed run would log other values.

Which attributes are the subclass's: those on the instance that no ``transformers`` class of the
Trainer's defines (:func:`trainer_names`: every ``self.<name> =`` in their source, and their class
attributes). :class:`SubclassCounters` notes them when ``train()`` begins, before a checkpoint is
restored; an attribute seen changed since then (at a boundary) is tracked. A tracked attribute holding a
plain value (numbers, strings, small tensors, lists / dicts of them: ``defaultdict`` s included) is saved
with each checkpoint and put back on resume, into the live containers (a ``defaultdict`` stays one).
Others (objects, values over :data:`keepalive.loopstate.MAX_BYTES`) are named once, with what to do.
The values saved are those of the last boundary (:meth:`SubclassCounters.at_boundary`), so a save made
during an evaluation (a pause) holds the state the rest of its tree holds. Nothing here draws random
numbers or changes a value of the training.
"""
from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from typing import Any, Dict, FrozenSet, Mapping, Optional, Set

from transformers import Trainer

from ..core import Checkpointer
from ..loopstate import MAX_BYTES, plain_size

__all__ = ["SubclassCounters", "trainer_names"]


@functools.cache
def trainer_names(cls: type) -> FrozenSet[str]:
    """The attribute names the ``transformers`` classes in ``cls``'s MRO define: assigned as
    ``self.<name>`` in their methods, or class attributes (methods included)."""
    names: Set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        names.update(vars(klass))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and isinstance(node.ctx, ast.Store)):
                names.add(node.attr)
    return frozenset(names)


def _view(value: Any, depth: int = 0) -> Any:
    """``value`` with its dict subclasses (``defaultdict``) as dicts; nothing else copied."""
    if isinstance(value, dict) and depth < 8:
        return {k: _view(v, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple) and depth < 8:
        return type(value)(_view(v, depth + 1) for v in value)
    return value


def _plain(value: Any) -> Optional[Any]:
    """A copy of ``value`` as a plain value (dict subclasses as dicts, tensors cloned), or None when it
    is not one or is too large to keep."""
    view = _view(value)
    size = plain_size(view)
    if size is None or size > MAX_BYTES:
        return None
    return copy.deepcopy(view)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    equal = getattr(a, "equal", None)  # a tensor
    if callable(equal) and hasattr(a, "shape"):
        return bool(a.shape == b.shape and a.dtype == b.dtype and equal(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array's ambiguous truth value: compare as bytes
        return repr(a) == repr(b)


def _into(live: Any, saved: Any) -> Any:
    """``saved`` put into the live value's containers where their kinds match (a ``defaultdict`` keeps
    its factory); the value to set when they do not."""
    if isinstance(live, dict) and isinstance(saved, dict):
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            live[key] = _into(live[key], value) if key in live else _fresh(live, value)
        return live
    if isinstance(live, list) and isinstance(saved, list):
        live[:] = [copy.deepcopy(v) for v in saved]
        return live
    return copy.deepcopy(saved)


def _fresh(container: Dict[Any, Any], value: Any) -> Any:
    """A saved value for a key the live container lacks: of the container's default kind, if any."""
    factory = getattr(container, "default_factory", None)
    if factory is not None:
        try:
            return _into(factory(), value)
        except TypeError:
            pass
    return copy.deepcopy(value)


class SubclassCounters:
    """The subclass attributes of one ``Trainer`` in one ``train()`` call (see the module)."""

    def __init__(self, trainer: Trainer, core: Checkpointer):
        self.trainer, self.core = trainer, core
        #: the values when train() began: plain copies, or the objects themselves (compared by identity)
        self.begun: Dict[str, Any] = {}
        self.tracked: Set[str] = set()
        self.named: Set[str] = set()
        self.boundary: Dict[str, Any] = {}
        for name, value in self._own().items():
            plain = _plain(value)
            self.begun[name] = (True, plain) if plain is not None else (False, value)

    def _own(self) -> Dict[str, Any]:
        known = trainer_names(type(self.trainer))  # type: ignore[arg-type]  # classes hash by identity
        return {n: v for n, v in vars(self.trainer).items() if n not in known and not n.startswith("__")}

    def at_boundary(self) -> None:
        """A step or epoch boundary: note the tracked attributes' values (what a save holds until the
        next boundary), and find attributes changed since ``train()`` began."""
        self.boundary = {}
        for name, value in self._own().items():
            plain = _plain(value)
            if name not in self.tracked:
                was_plain, before = self.begun.get(name, (False, _ABSENT))
                if _same(plain, before) if was_plain else value is before:
                    continue  # unchanged since train() began
                self.tracked.add(name)
            if plain is None:
                self._name(name, value)
            else:
                self.boundary[name] = plain

    def _name(self, name: str, value: Any) -> None:
        if name in self.named:
            return
        self.named.add(name)
        size = plain_size(_view(value))
        why = (f"holds {size / 2**20:.0f} MiB, over the {MAX_BYTES // 2**20} MiB kept" if size is not None
               else f"is an object ({type(value).__name__}) keepalive cannot store")
        self.core.warn(f"{type(self.trainer).__name__}.{name} changes during training and {why}: a resume "
                       "starts it from its value at train(), so what it feeds (log_history) may differ from an "
                       "uninterrupted run's. Keep it as plain values (numbers, lists, dicts), or in a "
                       "TrainerCallback with state() (ExportableState), which keepalive saves",
                       key=f"hf-counter-{name}")

    def capture(self) -> Dict[str, Any]:
        """The values of the last boundary, by attribute name."""
        return dict(self.boundary)

    def restore(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Put the saved values back into the trainer (into its live containers where they fit)."""
        state = vars(self.trainer)
        for name, value in (saved or {}).items():
            setattr(self.trainer, name, _into(state[name], value) if name in state else copy.deepcopy(value))
            self.tracked.add(name)
        self.at_boundary()


#: an attribute the trainer did not have when ``train()`` began
_ABSENT = object()

"""Objects the training changes that were never registered: named once, with the line that fixes it.

A timm-style loop keeps an EMA of the model (``ModelEmaV3``), an SWA loop an ``AveragedModel``, a GAN
a second model: each changes at every step, and a user who forgot ``ckpt.register('ema', ema)`` gets
a resume that restarts it from its state before the loop while the resume line reads as a success.

:class:`UnregisteredWatch` looks at the variables of the loop's frame (its locals and the module's
globals, handed to :meth:`~UnregisteredWatch.start` when the loop starts) for objects with state: a
module with parameters or buffers, an optimizer, anything with ``state_dict()`` and
``load_state_dict()``, and an instance of a class the script or notebook defines itself whose
attributes registering would save (build-nanogpt's ``DataLoaderLite``). An object registered, or one
whose tensors all belong to registered objects (a submodule of the model, the DDP / ``torch.compile``
wrapper around it), is no concern. The others are fingerprinted by their tensors' version counters
and storages, plain objects by their attributes (never their data: nothing is read, copied,
synchronised or drawn from a generator) and, at each save (:meth:`~UnregisteredWatch.check`), one
that changed since is named once. One that never changes (a frozen teacher, a loss module with a
class-weight buffer) is never named.
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from .torchstate import PlainObject, RandomState, tensor_print, unwrap_module, value_print

__all__ = ["UnregisteredWatch", "state_tensors"]


def state_tensors(obj: Any) -> List[torch.Tensor]:
    """The tensors an object's state holds, read without calling its code: a module's parameters and
    buffers, an optimizer's state (moments, step counts; not the parameters: they are the model's),
    another object's tensor attributes."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        return [v for state in list(obj.state.values()) for v in state.values() if isinstance(v, torch.Tensor)]
    attrs = getattr(obj.obj if isinstance(obj, PlainObject) else obj, "__dict__", None) or {}
    return [v for v in list(attrs.values()) if isinstance(v, torch.Tensor)]  # a scaler's scale, ...


def _settings(obj: Any) -> Any:
    """What changes in a stateful object beside its tensors: an optimizer's group settings (a learning
    rate set by hand or by a scheduler), a scheduler's or scaler's own attributes."""
    if isinstance(obj, torch.nn.Module):
        return None
    if isinstance(obj, torch.optim.Optimizer):
        return tuple(tuple((k, value_print(v)) for k, v in g.items() if k != "params") for g in obj.param_groups)
    return tuple((k, value_print(v)) for k, v in list(vars(obj).items()) if not isinstance(v, torch.Tensor))


def _stateful(value: Any) -> bool:
    """Whether a variable's value is an object whose state a checkpoint would need."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor)):
        return False
    if type(value).__module__.split(".")[0] == "keepalive":
        return False
    if isinstance(value, torch.nn.Module):
        return next(iter(state_tensors(value)), None) is not None
    if isinstance(value, torch.optim.Optimizer):
        return True
    # read from the class: an instance's __getattr__ (a proxy, a logger's run object) is user code.
    # Loaders, datasets and samplers have their own handling (ckpt.batches): not their state_dict here
    cls = type(value)
    return callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None)) \
        and not hasattr(cls, "__iter__") and not hasattr(cls, "__getitem__") and hasattr(value, "__dict__")


def _plain_object(value: Any, home: Set[str]) -> bool:
    """An instance of a class defined in the loop's own script or notebook (build-nanogpt's
    ``DataLoaderLite``) that registering would save by its attributes: its position is the loop's
    state. Classes of libraries (progress bars, meters, loggers) are not looked at."""
    cls = type(value)
    if cls.__module__ not in home or isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return False
    # datasets and samplers of the script go through ckpt.batches(), which positions them
    return not any(hasattr(cls, a) for a in ("state_dict", "__iter__", "__getitem__")) and \
        PlainObject.refusal("", value) is None


def _attributes(obj: Any) -> Tuple[Tuple[str, Any], ...]:
    return tuple((k, value_print(v)) for k, v in list(vars(obj).items()))


class UnregisteredWatch:
    """Names, once each, the stateful objects of the loop's variables that the training changes and
    no registered object holds. ``registered``: the checkpoint's objects (name -> object), read live."""

    def __init__(self, core: Any, registered: Mapping[str, Any]):
        self.core = core
        self.registered = registered
        self.namespaces: List[Dict[str, Any]] = []
        #: id(object) -> (variable name, weak or strong reference, (kind, fingerprint at the start))
        self.watched: Dict[int, Tuple[str, Any, Any]] = {}
        self.done: Set[int] = set()  # named, or seen to belong to registered objects
        self.ckpt_name = "ckpt"
        self._owned_key: Optional[Tuple[int, ...]] = None
        self._owned: Set[int] = set()

    def start(self, namespaces: Iterable[Dict[str, Any]]) -> None:
        """The loop starts: remember its variables (the dicts themselves: a module's globals stay live, so
        an object made later in a top-level loop is seen too) and fingerprint what they hold now."""
        self.namespaces = []
        for ns in namespaces:
            if not any(ns is seen for seen in self.namespaces):
                self.namespaces.append(ns)
        self._scan()

    def start_at(self, frame: Optional[types.FrameType]) -> None:
        """:meth:`start` with the variables of ``frame`` (the user's code that runs the loop)."""
        if frame is not None:
            self.start([frame.f_locals, frame.f_globals])

    def check(self) -> None:
        """At a save: name each watched object that changed and is not registered (cheap: version
        counters and storage pointers)."""
        if not self.namespaces:
            return
        self._scan()
        owned = self._registered_tensors()
        for key, (name, ref, before) in list(self.watched.items()):
            obj = ref() if isinstance(ref, weakref.ref) else ref
            if obj is None:
                del self.watched[key]
                continue
            if self._is_registered(obj):
                self.done.add(key)
                del self.watched[key]
                continue
            now = _attributes(obj) if before[0] == "plain" else self._fingerprint(obj, owned)
            if now != before[1]:
                self.done.add(key)
                del self.watched[key]
                changed = [k for k, v in now if (k, v) not in before[1]] if before[0] == "plain" else []
                self._tell(name, obj, changed)

    # ------------------------------------------------------------------------------------ parts
    def _scan(self) -> None:
        owned = self._registered_tensors()
        home = {"__main__", *(str(ns.get("__name__")) for ns in self.namespaces if "__name__" in ns)}
        for ns in self.namespaces:
            for name, value in list(ns.items()):
                if value is not self and type(value).__module__.startswith("keepalive.") and \
                        getattr(value, "core", None) is self.core:
                    self.ckpt_name = name  # the user's name for the checkpointer, for the fix line
                if name.startswith("_") or id(value) in self.watched or id(value) in self.done:
                    continue
                if _stateful(value):
                    before = ("state", self._fingerprint(value, owned))
                elif _plain_object(value, home):
                    before = ("plain", _attributes(value))
                else:
                    continue
                if self._is_registered(value):
                    continue
                try:
                    ref: Any = weakref.ref(value)
                except TypeError:
                    ref = value
                self.watched[id(value)] = (name, ref, before)

    def _registered_objects(self) -> List[Any]:
        out = []
        sharded = getattr(self.core, "dcp_objects", None)  # an FSDP2 model and its optimizers: saved through DCP
        if sharded is not None:
            out.extend([*sharded.models.values(), *sharded.optimizers.values()])
        for obj in list(self.registered.values()):
            out.append(obj)
            if isinstance(obj, (PlainObject, RandomState)):
                out.append(obj.obj if isinstance(obj, PlainObject) else obj.gen)
        return out

    def _is_registered(self, obj: Any) -> bool:
        inner = unwrap_module(obj)
        return any(inner is o or obj is o for o in self._registered_objects())

    def _registered_tensors(self) -> Set[int]:
        """The ids of the tensors registered objects hold (recomputed when the registered set changes)."""
        objects = self._registered_objects()
        key = tuple(id(o) for o in objects)
        if key != self._owned_key:
            self._owned_key = key
            self._owned = {id(t) for o in objects for t in state_tensors(o)}
        return self._owned

    @staticmethod
    def _fingerprint(obj: Any, owned: Set[int]) -> Any:
        """The object's own tensors (not those of registered objects) by version and storage, with
        its settings; ``None`` tensors part when all of them are registered ones."""
        tensors = tuple((id(t), tensor_print(t)) for t in state_tensors(obj) if id(t) not in owned)
        return tensors, _settings(obj)

    def _tell(self, name: str, obj: Any, attributes: List[str]) -> None:
        ckpt = self.ckpt_name
        which = f" (its {', '.join(attributes[:4])})" if attributes else ""
        self.core.warn(
            f"`{name}` ({type(obj).__name__}) changed during the training{which} and is not in the checkpoint: a "
            f"resume would start it again from its state before the loop. Register it with "
            f"`{ckpt}.register('{name}', {name})` before the loop.", key=f"unregistered:{name}")

"""State helpers shared by the adapters of torch-based frameworks (plain torch, fastai, and later
Hugging Face and Lightning): fit checks for modules and optimizers, owned copies of loaded tensors,
per-batch worker seeding. It is no adapter itself; adapters import it, never each other.
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from .. import rng
from ..adapter import check_fits
from ..errors import StateMismatchError

__all__ = ["RandomState", "PlainObject", "class_name", "plain_value", "tensor_print", "value_print",
           "watch_steps", "gate_steps", "changed_hyperparameters", "check_module", "check_objects",
           "check_optimizer", "state_summary",
           "frozen_parameters", "gradients", "gradients_pending", "hyperparameters", "optimizer_settings",
           "restore_gradients",
           "restore_requires_grad", "accelerate_wrapper", "schedule_lrs", "schedule_settings",
           "scheduler_with_settings", "unwrap_module", "unwrapped_keys", "without_lazy"]


def watch_steps(core: Any, optimizer: torch.optim.Optimizer) -> None:
    """Count ``optimizer``'s steps in ``core`` (:meth:`keepalive.core.Checkpointer.optimizer_stepped`)
    through its step post-hook: a step a GradScaler skipped never runs the optimizer, so is no step.
    The hook holds the checkpointer weakly: it must not keep it alive."""
    ref, index = weakref.ref(core), core.watched
    core.watched += 1

    def stepped(*_: Any) -> None:
        target = ref()
        if target is not None:
            target.optimizer_stepped(index)

    optimizer.register_step_post_hook(stepped)
    gate_steps(core, optimizer)  # after the counting hook: the gate opens once the step is counted


def gate_steps(core: Any, optimizer: torch.optim.Optimizer) -> None:
    """Let ``core``'s pause guard save from its thread while the loop pauses between steps: a step of
    ``optimizer`` waits at its start while the guard copies the state
    (:class:`keepalive.pauses.StepGate`). Adapters whose framework counts the steps call this alone."""
    gate = core.step_gate
    gate.watch(optimizer)

    def stepping(*_: Any) -> None:
        gate.enter_step()

    def stepped(*_: Any) -> None:
        gate.leave_step()

    optimizer.register_step_pre_hook(stepping)
    optimizer.register_step_post_hook(stepped)


def check_module(name: str, module: torch.nn.Module, saved: Dict[str, Any], where: str = "") -> None:
    """A module's ``state_dict`` against a saved one: same keys, same shapes (else nothing loads)."""
    check_fits(name, module.state_dict(), saved, where=where or "")


def check_optimizer(name: str, opt: torch.optim.Optimizer, saved: Dict[str, Any]) -> None:
    """A torch optimizer's saved state against the live one's parameter groups and shapes."""
    groups = saved.get("param_groups", [])
    if len(groups) > len(opt.param_groups):
        added = "; ".join(f"group {i}: {len(g['params'])} parameter(s), lr {g.get('lr')}"
                          for i, g in enumerate(groups) if i >= len(opt.param_groups))
        raise StateMismatchError(
            f"{name}: the checkpoint has {len(groups)} parameter group(s), the optimizer "
            f"{len(opt.param_groups)}: the run added group(s) after it started ({name}.add_param_group, "
            f"e.g. at an unfreeze; {added}). Nothing was loaded. To continue it, add the same group(s) to "
            f"{name} now (as your loop did) and run the loop again (the same checkpointer retries the "
            "resume); or start a new run (another path or run=).")
    if len(groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"{name}: the checkpoint has {len(groups)} parameter group(s), the optimizer "
            f"{len(opt.param_groups)}: your code adds group(s) that the run had not added yet when it "
            f"saved. Nothing was loaded. Add them later in the loop (as the run did), or start a new run.")
    params: List[Any] = []
    for i, (g_saved, g_live) in enumerate(zip(groups, opt.param_groups)):
        if len(g_saved["params"]) != len(g_live["params"]):
            raise StateMismatchError(f"{name}: parameter group {i} has {len(g_saved['params'])} "
                                     f"parameters in the checkpoint, {len(g_live['params'])} in the "
                                     "optimizer. Nothing was loaded.")
        params.extend(zip(g_saved["params"], g_live["params"]))
    state = saved.get("state", {})
    for saved_id, p in params:
        if is_lazy(p):  # takes its shape when the model's state is loaded
            continue
        for k, v in (state.get(saved_id) or {}).items():
            if hasattr(v, "shape") and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise StateMismatchError(f"{name}: state '{k}' of parameter {saved_id} has shape "
                                         f"{tuple(v.shape)} in the checkpoint, the parameter "
                                         f"{tuple(p.shape)}. Nothing was loaded.")


def check_objects(objects: Mapping[str, Any], tree: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything is changed, a checkpoint whose objects do not fit the live ones:
    missing state, another class (SGD -> Adam), other parameter names or shapes."""
    saved = tree.get("objects", {})
    missing = [n for n in objects if n not in saved]
    if missing:
        raise StateMismatchError(
            f"checkpoint {where} has no state for {missing} (it holds "
            f"{sorted(saved)}); register the same objects as the run that wrote it, or start a new run")
    classes = (tree.get("torch") or {}).get("classes") or {}
    for name, obj in objects.items():
        was = classes.get(name)
        if was in _WRAPPER_CLASSES and isinstance(obj, torch.nn.Module):
            was = None  # written before keepalive unwrapped them: its keys are checked below
        if was is not None and was != class_name(obj):
            raise StateMismatchError(
                f"{name}: the checkpoint {where} holds a {was}, this run has a {class_name(obj)}. "
                f"Nothing was loaded. Keep the {was} to continue this run, or start a new run "
                "(another path or run=).")
        if isinstance(obj, torch.nn.Module):
            check_module(name, obj, saved[name], where)
        elif isinstance(obj, torch.optim.Optimizer):
            check_optimizer(name, obj, saved[name])


def class_name(obj: Any) -> str:
    """The class a checkpoint records for a registered object: an object saved by its attributes
    (:class:`PlainObject`) is told from the same class with its own state_dict() (another state)."""
    if isinstance(obj, PlainObject):
        return f"{type(obj.obj).__name__} (attributes)"
    return type(obj).__name__


def changed_hyperparameters(now: Mapping[str, List[Dict[str, Any]]],
                            saved: Optional[Mapping[str, Any]]) -> Iterator[Tuple[str, str]]:
    """``(optimizer name, message)`` for each optimizer whose settings the code now sets otherwise
    than the run that wrote the checkpoint did: the checkpoint's values are in force (training state)."""
    for name, groups in now.items():
        before = (saved or {}).get(name)
        if not before:
            continue
        changes = [f"{key} {g_old[key]!r} -> {new!r} (group {i})"
                   for i, (g_new, g_old) in enumerate(zip(groups, before))
                   for key, new in g_new.items() if key in g_old and g_old[key] != new]
        if changes:
            yield name, (f"{name}: your code now sets {', '.join(changes[:4])}, but the checkpoint's "
                         "values (part of the training state, e.g. scheduled) are used. To change them, "
                         f"set them after ckpt.resume(), e.g. `for g in {name}.param_groups: g['lr'] = ...`")


def gradients_pending(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Gradients exist on the optimizers' parameters (``zero_grad()`` sets them to None, the
    default since torch 2.0): with no step since, an accumulation is in progress."""
    return any(p.grad is not None for opt in optimizers for group in opt.param_groups for p in group["params"])


def gradients(objects: Mapping[str, Any], optimizers: Sequence[Any]) -> Dict[str, List[List[Any]]]:
    """The pending gradients of each registered optimizer's parameters, by group (for a checkpoint
    taken inside a gradient accumulation)."""
    return {name: [[p.grad for p in g["params"]] for g in opt.param_groups]
            for name, opt in objects.items() if any(opt is o for o in optimizers)}


def restore_gradients(objects: Mapping[str, Any], saved: Optional[Mapping[str, Any]]) -> None:
    """Put :func:`gradients` back on the live parameters (an optimizer not registered now: skipped)."""
    for name, groups in (saved or {}).items():
        opt = objects.get(name)
        if opt is None:
            continue
        for g_live, g_saved in zip(opt.param_groups, groups):
            for p, grad in zip(g_live["params"], g_saved):
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype).clone()


def without_lazy(tree: Dict[str, Any]) -> Dict[str, Any]:
    """``tree`` with the parameters of lazy modules that have not run yet (``nn.LazyLinear``: no
    shape before the first batch) left out of its objects: what can be checked for storability."""
    objects = tree["objects"]
    for name, sd in list(objects.items()):
        if isinstance(sd, dict):
            objects[name] = {k: v for k, v in sd.items() if not is_lazy(v)}
    return tree


def hyperparameters(opt: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """The scalar settings of each parameter group (lr, weight_decay, momentum, ...) as the code set
    them: where a scheduler keeps the code's learning rate (``initial_lr``), that one, and a momentum
    that a scheduler cycles (OneCycleLR, CyclicLR: ``max_momentum``) is no setting. So an optimizer
    whose scheduler has decayed its lr (a cell run again in the same kernel) reads as set the same."""
    out = []
    for group in opt.param_groups:
        values = {k: _setting(v) for k, v in group.items() if k != "params" and _setting(v) is not None
                  and not k.startswith("initial_")}
        if isinstance(group.get("initial_lr"), (int, float)):
            values["lr"] = group["initial_lr"]
        if "max_momentum" in group:
            values.pop("momentum", None)
        out.append(values)
    return out


def _setting(value: Any) -> Any:
    """A group's value as a plain setting (a number, a flag, a name; Adam's ``betas`` as a list, what a
    checkpoint's JSON gives back), or None for what is none (a tensor learning rate, a ``foreach`` left unset)."""
    if isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float, bool)) for v in value):
        return list(value)
    return None


#: optimizer options that choose how a step is computed, not what it computes: the same training
STEP_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})


def optimizer_settings(name: str, opt: torch.optim.Optimizer, groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The optimizer registered as ``name``, flat, for telling one training from another
    (:mod:`keepalive.runidentity`): its class and each group's :func:`hyperparameters` ``groups``
    (the code's values), a group after the first as ``name[i]``; no implementation switch.

    >>> opt = torch.optim.AdamW([torch.zeros(1)], lr=1e-3)
    >>> s = optimizer_settings("opt", opt, hyperparameters(opt))
    >>> s["opt"], s["opt.lr"], s["opt.betas"], "opt.foreach" in s
    ('AdamW', 0.001, [0.9, 0.999], False)
    """
    out: Dict[str, Any] = {name: class_name(opt)}
    for i, group in enumerate(groups):
        where = name if i == 0 else f"{name}[{i}]"
        out.update({f"{where}.{k}": v for k, v in group.items() if k not in STEP_IMPLEMENTATION})
    return out


# ----------------------------------------------------------------------------- wrapped modules
def unwrap_module(obj: Any) -> Any:
    """The object a wrapper holds (in any nesting): the module of a ``DistributedDataParallel`` or
    ``torch.compile`` wrapper (its state has no ``module.`` / ``_orig_mod.`` prefix, so a checkpoint
    resumes with or without the wrapper: another world size, compile toggled between sessions), and
    the torch optimizer / scheduler inside Accelerate's ``AcceleratedOptimizer`` /
    ``AcceleratedScheduler`` (what ``accelerator.prepare`` returns). The inner optimizer's step hook
    runs only on the steps that change the weights: the wrapper's ``step()`` does nothing on the
    micro-batches of a gradient accumulation (``accelerator.accumulate``), and a GradScaler's skipped
    step never reaches it. The same checkpoint resumes with the prepared objects or the raw ones."""
    while True:
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            obj = obj.module
        elif isinstance(obj, torch.nn.Module) and type(obj).__name__ == "OptimizedModule" and \
                isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod  # torch.compile's wrapper (torch._dynamo is not imported to test it)
        elif accelerate_wrapper(obj) is not None:
            obj = accelerate_wrapper(obj)
        elif fabric_wrapper(obj) is not None:
            obj = fabric_wrapper(obj)
        else:
            return obj


#: Accelerate's wrappers (``accelerator.prepare``) and the attribute that holds the wrapped torch object;
#: checked against the installed accelerate by :data:`keepalive.callbacks._compat.ACCELERATE`
ACCELERATE_WRAPPERS = {"accelerate.optimizer.AcceleratedOptimizer": "optimizer",
                       "accelerate.scheduler.AcceleratedScheduler": "scheduler"}


#: Lightning Fabric's wrappers (``fabric.setup``) and the attribute that holds the user's torch object: the
#: module as it was passed in (not the DDP wrapper around it), the torch optimizer (whose step hook runs
#: when Fabric's strategy steps it); checked against the installed lightning by ``_compat.FABRIC``
FABRIC_WRAPPERS = {"_FabricModule": "_original_module", "_FabricOptimizer": "_optimizer"}
FABRIC_MODULES = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")


def fabric_wrapper(obj: Any) -> Any:
    """The torch object inside a Fabric ``_FabricModule`` / ``_FabricOptimizer``, or None (lightning is
    not imported to tell). A ``_FabricOptimizer`` poses as its optimizer's class: its MRO names it."""
    for cls in type(obj).__mro__:
        attr = FABRIC_WRAPPERS.get(cls.__qualname__)
        if attr is not None and cls.__module__ in FABRIC_MODULES:
            from ._compat import FABRIC

            FABRIC.check()  # once per process: a lightning whose wrappers changed is refused here
            return getattr(obj, attr, None)
    return None


def accelerate_wrapper(obj: Any) -> Any:
    """The torch object inside an Accelerate ``AcceleratedOptimizer`` / ``AcceleratedScheduler``, or None
    for anything else (accelerate is not imported to tell: a run without it never pays for it)."""
    attr = ACCELERATE_WRAPPERS.get(f"{type(obj).__module__}.{type(obj).__qualname__}")
    if attr is None:
        return None
    from ._compat import ACCELERATE

    ACCELERATE.check()  # once per process: an accelerate whose wrappers changed is refused here
    return getattr(obj, attr)


_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_WRAPPER_CLASSES = frozenset({"OptimizedModule", "DistributedDataParallel"})


def unwrapped_keys(live: Mapping[str, Any], saved: Dict[str, Any]) -> Dict[str, Any]:
    """``saved`` (a module's state) with the prefixes of wrappers stripped where the live module's keys
    have none (a checkpoint of a compiled or DDP-wrapped model written before keepalive unwrapped
    them); ``saved`` itself when its keys are the live ones."""
    if not saved or set(saved) == set(live):
        return saved
    keys = list(saved)
    changed = False
    for prefix in _WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in keys) and not any(k.startswith(prefix) for k in live):
            keys = [k[len(prefix):] for k in keys]
            changed = True
    return dict(zip(keys, saved.values())) if changed else saved


# ----------------------------------------------------------------------------- requires_grad
def frozen_parameters(module: torch.nn.Module) -> List[str]:
    """The names of ``module``'s parameters that do not require gradients (frozen): part of the state
    a loop changes (an unfreeze at some epoch), saved with the module."""
    return [n for n, p in module.named_parameters() if not p.requires_grad]


def restore_requires_grad(module: torch.nn.Module, frozen: Sequence[str]) -> int:
    """Set ``requires_grad`` of ``module``'s parameters as saved (the names in ``frozen`` off, the
    others on); returns how many changed."""
    off = set(frozen)
    changed = 0
    for n, p in module.named_parameters():
        want = n not in off
        if p.requires_grad != want and (p.is_floating_point() or p.is_complex()):
            p.requires_grad_(want)
            changed += 1
    return changed


# ----------------------------------------------------------------------------------- schedules
#: a scheduler's state that is its progress, not its settings (the code's plan)
_PROGRESS = frozenset({"last_epoch", "base_lrs", "T_i", "T_cur", "best", "num_bad_epochs",
                       "cooldown_counter", "_step_count", "_is_initial", "_get_lr_called_within_step",
                       "_last_lr", "verbose"})


def schedule_settings(scheduler: Any) -> Dict[str, Any]:
    """A learning-rate scheduler's settings as the code built it (T_max, total_steps, step_size,
    gamma, ...): its public state that is no progress, as plan values (:func:`keepalive.plan.plain`)."""
    from ..plan import plain

    try:
        state = scheduler.state_dict()
    except Exception:  # noqa: BLE001 - a scheduler whose state cannot be read has no plan to compare
        return {}
    return {k: plain(v) for k, v in state.items() if not k.startswith("_") and k not in _PROGRESS
            and not isinstance(v, torch.Tensor)}


def scheduler_with_settings(saved: Mapping[str, Any], live: Mapping[str, Any]) -> Dict[str, Any]:
    """The saved scheduler state with the live scheduler's settings (every key that is no progress,
    including private derived ones such as OneCycleLR's phases): the code's plan, the run's progress."""
    merged = dict(saved)
    merged.update({k: v for k, v in live.items() if k not in _PROGRESS})
    return merged


def schedule_lrs(scheduler: Any) -> Optional[List[float]]:
    """The learning rates ``scheduler``'s settings give at its progress (its closed form), or None
    where torch has none (a chainable-only schedule); may raise torch's ValueError (OneCycleLR past
    its total_steps)."""
    closed = getattr(scheduler, "_get_closed_form_lr", None)
    if callable(closed):
        return [float(v) for v in closed()]
    if isinstance(scheduler, (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.LambdaLR,
                              torch.optim.lr_scheduler.CyclicLR)):
        was = scheduler._get_lr_called_within_step
        scheduler._get_lr_called_within_step = True  # get_lr() outside step() would warn
        try:
            return [float(v) for v in scheduler.get_lr()]
        finally:
            scheduler._get_lr_called_within_step = was
    return None


class RandomState:
    """A private random generator as an object with ``state_dict`` / ``load_state_dict`` (python and
    numpy ones in :func:`keepalive.rng.generator_state`'s format, torch's as its state tensor)."""

    def __init__(self, gen: Any):
        self.gen = gen

    @staticmethod
    def wraps(obj: Any) -> bool:
        return isinstance(obj, (*rng.GENERATORS, torch.Generator))

    def state_dict(self) -> Dict[str, Any]:
        if isinstance(self.gen, torch.Generator):
            return {"torch": self.gen.get_state()}
        return rng.generator_state(self.gen)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "torch" in state:
            self.gen.set_state(state["torch"].clone())
        else:
            rng.set_generator_state(self.gen, state)


def state_summary(obj: Any) -> Any:
    """A cheap, comparable summary of an object's state, for an adapter's fingerprint
    (:attr:`keepalive.core.Checkpointer.fingerprint`): a scheduler: its step counts; anything else:
    its state_dict's plain values, tensors by their version counter and storage."""
    if isinstance(obj, PlainObject):
        return obj.summary()
    inner = getattr(obj, "scheduler", obj)  # accelerate's wrapper
    if isinstance(inner, torch.optim.lr_scheduler.LRScheduler):
        return (inner.last_epoch, getattr(inner, "_step_count", None))
    try:
        state = obj.state_dict()
    except Exception:  # noqa: BLE001 - whatever it is, a change of it cannot be seen
        return None
    return value_summary(state)


def value_summary(x: Any) -> Any:
    """A cheap, comparable stand-in for a value: containers as tuples, numbers as they are, a tensor by
    its version counter and storage (an in-place change or a new tensor both change it; no device
    sync), anything else by its repr."""
    if isinstance(x, dict):
        return tuple((k, value_summary(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return tuple(value_summary(v) for v in x)
    if isinstance(x, torch.Tensor):
        return ("tensor", x._version, x.data_ptr())
    if isinstance(x, np.generic):
        return x.item()
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


# ------------------------------------------------------------------------ objects without state_dict
#: the largest tensor or array attribute of a plain object that is saved (bigger ones are left alone:
#: a shard's whole token array is no position)
PLAIN_ARRAY_BYTES = 16 << 20
#: the most values a list / tuple / dict attribute may hold (all levels) to be saved
PLAIN_ITEMS = 10_000
_SCALARS = (type(None), bool, int, float, str, bytes)


def plain_value(x: Any) -> bool:
    """Whether ``x`` is a value a checkpoint holds as it is: a number, string, bytes, None, a numpy
    scalar, a tensor or array up to :data:`PLAIN_ARRAY_BYTES`, or a small list / tuple / dict / set of
    such values. Reads no data (sizes and types only)."""
    budget = [PLAIN_ITEMS]

    def walk(v: Any, depth: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > 6:
            return False
        if isinstance(v, _SCALARS):
            return not isinstance(v, bytes) or len(v) <= PLAIN_ARRAY_BYTES
        if isinstance(v, (np.generic, np.ndarray)):  # the dtypes a checkpoint stores
            return v.dtype.kind in "biufc" and v.dtype.itemsize <= 8 and v.nbytes <= PLAIN_ARRAY_BYTES
        if isinstance(v, torch.Tensor):
            return v.layout == torch.strided and v.device.type != "meta" and not v.is_quantized and \
                (not v.is_complex() or v.dtype == torch.complex64) and \
                v.numel() * v.element_size() <= PLAIN_ARRAY_BYTES
        if type(v) in (list, tuple, set, frozenset):
            return all(walk(i, depth + 1) for i in v)
        if type(v) is dict:
            return all(isinstance(k, (str, int)) and walk(i, depth + 1) for k, i in v.items())
        return False

    return walk(x, 0)


def tensor_print(t: torch.Tensor) -> Tuple[Any, ...]:
    """A tensor's cheap fingerprint: an in-place change moves its version counter, a new tensor its
    storage (no device sync, no data read)."""
    try:
        return (t._version, t.data_ptr(), tuple(t.shape))
    except (RuntimeError, NotImplementedError):  # inference / sparse tensors have no counter or pointer
        return (id(t), tuple(t.shape))


def value_print(x: Any) -> Any:
    """A cheap fingerprint of any attribute value that never calls user code: tensors and arrays by
    identity and version / storage, a module by its tensors, small plain values as they are, other
    objects by identity (a new object is a change; what happens inside one is not seen)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x), tensor_print(x))
    if isinstance(x, np.ndarray):
        return ("array", id(x), x.ctypes.data, x.shape)
    if isinstance(x, torch.nn.Module):
        return ("module", id(x), tuple(tensor_print(t) for t in (*x.parameters(), *x.buffers())))
    if isinstance(x, _SCALARS) or isinstance(x, np.generic):
        return x
    if type(x) in (list, tuple) and len(x) <= 64:
        return (type(x).__name__, id(x), tuple(value_print(v) for v in x))
    return ("object", id(x), len(x) if isinstance(x, (list, tuple, dict, set)) else None)


def _owned(x: Any, device: Optional[str]) -> Any:
    """A value read from a checkpoint as the attribute's own (containers rebuilt, tensors copied onto
    ``device``, arrays copied out of the loaded buffer)."""
    if isinstance(x, torch.Tensor):
        try:
            return x.to(device or "cpu", copy=True)
        except (RuntimeError, AssertionError):  # a GPU tensor resumed where there is none: on the CPU
            return x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (list, tuple, set, frozenset)):
        return type(x)(_owned(v, None) for v in x)
    if isinstance(x, dict):
        return {k: _owned(v, None) for k, v in x.items()}
    return x


def _attrs(obj: Any) -> Dict[str, Any]:
    """A copy of ``obj``'s instance attributes: a save from the pause guard's thread reads them while
    the loop may add one (iterating the live dict would then raise)."""
    return dict(vars(obj))


class PlainObject:
    """A registered object without ``state_dict()`` (build-nanogpt's ``DataLoaderLite``, with its
    ``current_shard`` / ``current_position``) as one that has it: its instance attributes that hold
    plain values (:func:`plain_value`) are saved, and put back by ``setattr`` on a resume (tensors on
    their device). Its other attributes (the shard's token array, objects) are not saved: they must not
    change after the registration, and one that does is named once with the fix (``tell``), because a
    resume would keep it as the code builds it. :meth:`refusal` says why an object cannot be wrapped."""

    def __init__(self, name: str, obj: Any, tell: Any = None):
        self.name, self.obj, self.tell = name, obj, tell
        attrs = _attrs(obj)
        #: the attributes not saved, as they were at the registration (a change of one is named)
        self.kept = {k: value_print(v) for k, v in attrs.items() if not plain_value(v)}
        self.told: set = set()

    @staticmethod
    def refusal(name: str, obj: Any) -> Optional[str]:
        """Why ``obj`` cannot be saved attribute by attribute (the line to add), or None if it can."""
        cls = type(obj).__name__
        head = f"{name}: a {cls} has no state_dict()/load_state_dict()"
        fix = (f"give {cls} a state_dict() that returns what positions it and a load_state_dict(state) that "
               "puts it back, or put plain values in ckpt.extras instead")
        if isinstance(obj, torch.utils.data.DataLoader):
            return (f"{head}, and a DataLoader's position is in its iterator: pass it through "
                    f"`for batch in ckpt.batches({name}):` instead of registering it")
        if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
            return f"{head} and no attributes keepalive can save: {fix}"
        slots = [s for c in type(obj).__mro__[:-1] for s in getattr(c, "__slots__", ())
                 if s not in ("__dict__", "__weakref__")]
        if slots:
            return f"{head}, and its __slots__ ({', '.join(slots[:4])}) cannot be saved by attribute: {fix}"
        if not hasattr(obj, "__dict__"):
            return f"{head} and no attributes keepalive can save: {fix}"
        if not any(plain_value(v) for v in _attrs(obj).values()):
            held = ", ".join(f"{k} ({type(v).__name__})" for k, v in list(_attrs(obj).items())[:4]) or "none"
            return f"{head} and none of its attributes is a plain value (it holds {held}): {fix}"
        return None

    def saved_names(self) -> List[str]:
        return [k for k, v in _attrs(self.obj).items() if plain_value(v)]

    def state_dict(self) -> Dict[str, Any]:
        self.check_kept()
        values: Dict[str, Any] = {}
        devices: Dict[str, str] = {}
        for k, v in _attrs(self.obj).items():
            if plain_value(v):
                values[k] = v
                if isinstance(v, torch.Tensor):
                    devices[k] = str(v.device)
        return {"attributes": values, "devices": devices}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        devices = state.get("devices") or {}
        for k, v in (state.get("attributes") or {}).items():
            setattr(self.obj, k, _owned(v, devices.get(k)))
        # what the object holds now is what a resumed run starts from: changes are counted from here
        self.kept = {k: value_print(v) for k, v in _attrs(self.obj).items() if not plain_value(v)}

    def summary(self) -> Any:
        """A cheap, comparable stand-in for :meth:`state_dict` (the adapter's fingerprint)."""
        return tuple((k, value_print(v)) for k, v in _attrs(self.obj).items())

    def check_kept(self) -> None:
        """Name, once each, the attributes that are not saved and changed since the registration."""
        if self.tell is None:
            return
        attrs = _attrs(self.obj)
        for k, v in attrs.items():
            if k in self.told or plain_value(v) or self.kept.get(k) == value_print(v):
                continue
            self.told.add(k)
            size = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else getattr(v, "nbytes", None)
            what = type(v).__name__ + (f", {size / 2**20:.0f} MiB" if isinstance(size, int) else "")
            cls = type(self.obj).__name__
            self.tell(f"{self.name}.{k} ({what}) changed since {self.name} was registered and is not in the "
                      f"checkpoint (saved are plain values up to {PLAIN_ARRAY_BYTES >> 20} MiB each: "
                      f"{', '.join(self.saved_names()[:6])}): a resume would keep the {k} your code builds. "
                      f"Give {cls} a state_dict() and a load_state_dict(state) that rebuilds {k} from "
                      "the saved position.", key=f"plain-kept:{self.name}.{k}")

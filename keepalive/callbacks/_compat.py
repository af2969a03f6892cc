"""Framework internals the adapters rely on: listed per framework, checked when a callback is created.

Every adapter reaches past its framework's public API somewhere: a private attribute it reads or sets
(``Trainer._tr_loss``), a method it replaces on one instance (``Trainer._run_epoch``), a local variable
of a framework function whose frame it walks (Keras ``fit``'s ``epoch_iterator``), a private module it
imports (``keras.src...``). Each is an :class:`Internal` in its framework's inventory
(``_compat_keras``, ``_compat_fastai``, ``_compat_transformers``, ``_compat_lightning``): what it is,
where the adapter uses it, and a probe that says whether the installed version still has it.
``DriveCheckpoint(...)`` runs the probes once per process (:meth:`Framework.check`) and refuses a
version that lacks one with :class:`~keepalive.errors.IncompatibleFrameworkError`, whose one-line
message names the framework, its version, the tested range and what is missing: at the callback's
creation, not in the middle of a training.

Names that say *how* the adapter reaches in (a patched method, the variables of a walked frame, the
attributes read from a callback) are constants of the inventory modules, used by the adapters; plain
attribute reads stay spelled out in the adapters, and ``tests/test_compat.py`` checks both ways that
the inventory and the adapters' sources agree.

An inventory is a table, data rather than code: a module-level tuple of :class:`Internal` rows whose
probe is a :class:`Check` (or a tuple of them, all of which must hold) naming what to look at as text
(``"module:Class.attr"``, imported only when the check runs) and how to look. :meth:`Framework.missing`
walks the table. A check looks at classes and code objects only, nothing is instantiated or run: an
attribute of a class or module (``has``); a name a class's own code reads or sets (``uses``:
``co_names``, which holds the instance attributes ``__init__`` creates; ``stores``: also through
fastcore's ``store_attr('a,b')``); a string constant of its code (``says``); a local variable of a
function (``local``: ``co_varnames`` / ``co_cellvars``, what a frame walk finds in ``f_locals``); a
parameter (``param``: ``inspect.signature``); a dataclass field (``field``). The few looks no check
can say are small functions of the inventory module, in the table by name like the checks.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from ..errors import IncompatibleFrameworkError

__all__ = ["ACCELERATE", "FABRIC", "Internal", "Package", "Framework", "Check", "code_names", "code_consts",
           "local_names", "params_of", "resolve", "has", "uses", "says", "stores", "local", "param", "field"]

#: a look at the installed version: True when it has what the adapter needs (a :class:`Check` is one)
Probe = Callable[[], bool]
#: what an inventory row checks: one look, or several that must all hold
Looks = Union[Probe, Tuple[Probe, ...]]


@dataclass(frozen=True)
class Internal:
    """One framework internal an adapter relies on."""

    name: str           #: as a reader finds it in the framework: ``Trainer._run_epoch``
    what: str           #: what it is and what the adapter does with it
    where: str          #: the adapter file, then what in it: ``transformers.py: _EpochRunner``
    probe: Looks        #: True (each of them) when the installed version has it
    token: str = ""     #: text the adapter file contains where it uses it (default: the name's last part)
    package: str = ""   #: the distribution that provides it (default: the framework's, listed first)
    required: bool = True  #: False: the adapter falls back without it (said to the user); never refused

    @property
    def text(self) -> str:
        return self.token or self.name.rsplit(".", 1)[-1]

    @property
    def file(self) -> str:
        return self.where.split(":", 1)[0].strip()


@dataclass(frozen=True)
class Package:
    """A distribution an adapter's internals come from, and the versions it is tested with."""

    name: str           #: as pip knows it: ``transformers``
    module: str         #: the module whose ``__version__`` is its version
    tested: str         #: the range the extras accept: ``>=5.3,<6``
    only_if_imported: bool = False  #: its internals are checked only when the module is imported already


class Framework:
    """A framework's inventory and its check (run once per process, at callback creation)."""

    def __init__(self, name: str, packages: Sequence[Package],
                 internals: Union[Sequence[Internal], Callable[[], Iterable[Internal]]]):
        self.name = name
        self.packages = {p.name: p for p in packages}
        self._table = internals  # the inventory's table (or a callable that lists one)
        self._internals: Optional[List[Internal]] = None
        self._verdict: Optional[str] = None  # "" when the check passed, else its message
        self._missing: Tuple[str, ...] = ()

    @property
    def internals(self) -> List[Internal]:
        if self._internals is None:
            table = self._table
            self._internals = list(table() if callable(table) else table)
        return self._internals

    def package_of(self, item: Internal) -> Package:
        """The package an internal comes from: its own, else the framework's (the first)."""
        return self.packages[item.package] if item.package else next(iter(self.packages.values()))

    def version(self, package: str) -> str:
        module = sys.modules.get(self.packages[package].module)
        if module is None:
            try:
                module = importlib.import_module(self.packages[package].module)
            except ImportError:
                return "(not installed)"
        return str(getattr(module, "__version__", "(unknown version)"))

    def applies(self, item: Internal) -> bool:
        pkg = self.package_of(item)
        return not pkg.only_if_imported or pkg.module in sys.modules

    def missing(self, *, required_only: bool = True) -> List[Internal]:
        """The internals the installed versions lack (all, or only those the adapter cannot do without)."""
        return [i for i in self.internals if (i.required or not required_only) and self.applies(i)
                and not _holds(i.probe)]

    def message(self, missing: Sequence[Internal]) -> str:
        """One line: what is missing, from which version, the tested range, what to do."""
        parts, specs = [], []
        for pkg in self.packages.values():
            names = [i.name for i in missing if self.package_of(i) is pkg]
            if names:
                parts.append(f"{_words(names)}, which {pkg.name} {self.version(pkg.name)} lacks (tested with "
                             f"{pkg.name}{pkg.tested})")
                specs.append(f'"{pkg.name}{pkg.tested}"')
        return (f"keepalive's {self.name} adapter needs {'; and '.join(parts)}; install a tested version "
                f"(pip install {' '.join(specs)}) or update keepalive")

    def check(self) -> None:
        """Raise :class:`~keepalive.errors.IncompatibleFrameworkError` when a required internal is
        missing. The verdict is kept for the process: later callbacks pay nothing."""
        if self._verdict is None:
            missing = self.missing()
            self._verdict = self.message(missing) if missing else ""
            self._missing = tuple(i.name for i in missing)
        if self._verdict:
            raise IncompatibleFrameworkError(self._verdict, framework=self.name, missing=self._missing)

    def reset(self) -> None:
        """Forget the verdict (tests that take an internal away)."""
        self._verdict = None


def _holds(probe: Looks) -> bool:
    try:
        return all(bool(p()) for p in (probe if isinstance(probe, tuple) else (probe,)))
    except Exception:  # noqa: BLE001 - a probe that cannot look (a module gone, a class renamed): missing
        return False


def _words(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# --------------------------------------------------------------------------------- code objects
def _codes(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _functions(obj: Any) -> Iterable[Any]:
    """The plain functions of ``obj``: itself (unwrapped), or everything a class and its bases define
    (methods, static / class methods, property accessors)."""
    if not isinstance(obj, type):
        yield inspect.unwrap(getattr(obj, "__func__", obj))
        return
    for cls in obj.__mro__:
        if cls is object:
            continue
        for value in vars(cls).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                yield from (f for f in (value.fget, value.fset, value.fdel) if f is not None)
            elif callable(value) and hasattr(inspect.unwrap(value), "__code__"):
                yield inspect.unwrap(value)


def code_names(obj: Any) -> Set[str]:
    """The attribute and global names a function's (or a class's) code reads or sets, nested code too."""
    return {n for f in _functions(obj) if hasattr(f, "__code__") for c in _codes(f.__code__) for n in c.co_names}


def code_consts(obj: Any) -> Set[str]:
    """The string constants of a function's (or a class's) code."""
    return {k for f in _functions(obj) if hasattr(f, "__code__") for c in _codes(f.__code__)
            for k in c.co_consts if isinstance(k, str)}


def local_names(func: Any, *, unwrap: bool = True) -> Set[str]:
    """The local variables of a function's own frame (arguments and variables, closed-over ones too)."""
    f = inspect.unwrap(func) if unwrap else func
    code = f.__code__
    return set(code.co_varnames) | set(code.co_cellvars)


def params_of(func: Any) -> Set[str]:
    return set(inspect.signature(func).parameters)


# ----------------------------------------------------------------------------------- checks
def resolve(at: Any) -> Any:
    """The object a check names: ``"module"`` or ``"module:Attr.path"`` (imported now), else ``at``
    itself (an object already at hand)."""
    if not isinstance(at, str):
        return at
    module, _, path = at.partition(":")
    obj = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _stored(obj: Any, name: str) -> bool:
    """``obj``'s code reads or sets ``name``, also through fastcore's ``store_attr('a,b,...')``."""
    return name in code_names(obj) or any(name in k.replace(" ", "").split(",") for k in code_consts(obj))


#: how a check looks: its kind -> (the object, the names, unwrap) -> whether the object has them all
_LOOKS: Dict[str, Callable[[Any, Tuple[str, ...], bool], bool]] = {
    "has": lambda obj, names, _: all(hasattr(obj, n) for n in names),
    "uses": lambda obj, names, _: set(names) <= code_names(obj),
    "says": lambda obj, names, _: set(names) <= code_consts(obj),
    "stores": lambda obj, names, _: all(_stored(obj, n) for n in names),
    "local": lambda obj, names, unwrap: set(names) <= local_names(obj, unwrap=unwrap),
    "param": lambda obj, names, _: set(names) <= params_of(obj),
    "field": lambda obj, names, _: set(names) <= set(getattr(obj, "__dataclass_fields__", ())),
}


@dataclass(frozen=True)
class Check:
    """One look at the installed version, as data: ``how`` (a key of :data:`_LOOKS`) the object ``at``
    names (see :func:`resolve`) is looked at, for ``names``. Called, it looks."""

    how: str
    at: Any
    names: Tuple[str, ...]
    unwrap: bool = True  #: ``local``: the frame of the function under its decorators

    def __call__(self) -> bool:
        return _LOOKS[self.how](resolve(self.at), self.names, self.unwrap)


def has(at: Any, *names: str) -> Check:
    """The class or module at ``at`` has these attributes."""
    return Check("has", at, names)


def uses(at: Any, *names: str) -> Check:
    """The code at ``at`` (a class: all its methods, bases included; or a function) reads or sets
    these attributes: instance attributes, which a class only shows once an instance exists."""
    return Check("uses", at, names)


def says(at: Any, *texts: str) -> Check:
    """The code at ``at`` holds these string constants (an event name it passes on)."""
    return Check("says", at, texts)


def stores(at: Any, *names: str) -> Check:
    """Like :func:`uses`, or the names are set through fastcore's ``store_attr('a,b,...')``."""
    return Check("stores", at, names)


def local(at: Any, *names: str, unwrap: bool = True) -> Check:
    """The frame of the function at ``at`` holds these local variables."""
    return Check("local", at, names, unwrap)


def param(at: Any, *names: str) -> Check:
    """The function at ``at`` takes these parameters."""
    return Check("param", at, names)


def field(at: Any, *names: str) -> Check:
    """The dataclass at ``at`` has these fields."""
    return Check("field", at, names)


# ------------------------------------------------------------------- Accelerate (torch adapter)
_OPT, _SCHED = "accelerate.optimizer:AcceleratedOptimizer", "accelerate.scheduler:AcceleratedScheduler"
_SHARD, _DISPATCHER = "accelerate.data_loader:DataLoaderShard", "accelerate.data_loader:DataLoaderDispatcher"

#: What the torch adapter relies on in the objects ``accelerator.prepare`` returns: the torch object each
#: wrapper holds (``torchstate.ACCELERATE_WRAPPERS``), the DataLoader a prepared loader iterates
#: (``_torch_replay._base_loader``), and the loader's epoch count (saved as a counter).
ACCELERATE_INTERNALS = (
    Internal("accelerate.optimizer.AcceleratedOptimizer.optimizer", "the torch optimizer inside: "
             "registered, its step hook counts the steps that change the weights",
             "torchstate.py: ACCELERATE_WRAPPERS", uses(_OPT, "optimizer"), token='"optimizer"'),
    Internal("accelerate.scheduler.AcceleratedScheduler.scheduler", "the torch scheduler inside: "
             "registered, its settings are the plan", "torchstate.py: ACCELERATE_WRAPPERS",
             uses(_SCHED, "scheduler"), token='"scheduler"'),
    Internal("accelerate.data_loader.DataLoaderShard.base_dataloader", "the torch DataLoader a "
             "prepared loader iterates: its index sampler is positioned", "_torch_replay.py: _base_loader",
             uses(_SHARD, "base_dataloader")),
    Internal("accelerate.data_loader.DataLoaderDispatcher.base_dataloader", "the same for a loader "
             "prepared with dispatch_batches=True (iterated on rank 0 only; its state and split_batches "
             "say how many base batches a rank's batch stands for: _Dispatch)",
             "_torch_replay.py: _base_loader", uses(_DISPATCHER, "base_dataloader", "state", "split_batches")),
    Internal("accelerate.data_loader.DataLoaderDispatcher._drop_last", "whether the dispatcher completes "
             "an uneven last batch with the iteration's first samples (told: not replayed after a resume)",
             "_torch_replay.py: _Dispatch.completes_last_batch", uses(_DISPATCHER, "_drop_last"),
             token='"_drop_last"'),
    Internal("accelerate.data_loader.DataLoaderShard.iteration", "the prepared loader's epoch count "
             "(its sampler's set_epoch): saved with a checkpoint as a counter of the loader",
             "_torch_order.py: OrderSources.counters", uses(_SHARD, "iteration", "set_epoch"), token="def counters"),
)

#: Accelerate's objects as the torch adapter takes them (checked when a prepared object is registered)
ACCELERATE = Framework("Accelerate", [Package("accelerate", "accelerate", ">=1.1,<2")], ACCELERATE_INTERNALS)


# ------------------------------------------------------------------- Lightning Fabric (torch adapter)
_WRAPPERS = "lightning.fabric.wrappers"

#: What the torch adapter relies on in the objects ``fabric.setup`` / ``setup_dataloaders`` return: the
#: torch object each wrapper holds (``torchstate.FABRIC_WRAPPERS``), the DataLoader a Fabric loader wraps
#: (``_torch_replay._base_loader``), and its count of ``iter()`` calls (the epoch it sets on the sampler;
#: saved as a counter of the loader).
FABRIC_INTERNALS = (
    Internal("lightning.fabric.wrappers._FabricModule._original_module", "the user's module inside "
             "(not the DDP wrapper): its state is saved", "torchstate.py: FABRIC_WRAPPERS",
             uses(f"{_WRAPPERS}:_FabricModule", "_original_module"), token='"_original_module"'),
    Internal("lightning.fabric.wrappers._FabricOptimizer._optimizer", "the torch optimizer inside: "
             "registered, its step hook counts the steps", "torchstate.py: FABRIC_WRAPPERS",
             uses(f"{_WRAPPERS}:_FabricOptimizer", "_optimizer"), token='"_optimizer"'),
    Internal("lightning.fabric.wrappers._FabricDataLoader._dataloader", "the torch DataLoader a Fabric "
             "loader iterates: its index sampler is positioned", "_torch_replay.py: _base_loader",
             uses(f"{_WRAPPERS}:_FabricDataLoader", "_dataloader"), token='"_dataloader"'),
    Internal("lightning.fabric.wrappers._FabricDataLoader._num_iter_calls", "the loader's count of "
             "iter() calls, the epoch Fabric sets on its sampler: saved with a checkpoint as a counter",
             "_torch_order.py: OrderSources.counters", uses(f"{_WRAPPERS}:_FabricDataLoader", "_num_iter_calls"),
             token="def counters"),
)

#: Lightning Fabric's objects as the torch adapter takes them (checked when a Fabric object is registered)
FABRIC = Framework("Lightning Fabric", [Package("lightning", "lightning", ">=2.6,<2.7")], FABRIC_INTERNALS)

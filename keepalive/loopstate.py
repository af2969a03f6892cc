"""The loop's own state: the variables a training loop assigns, read from the loop's code.

A training loop keeps more than the registered objects: a best loss, a patience counter, an iteration
number, a batch drawn ahead (nanoGPT's ``X, Y = get_batch('train')`` at the end of each step). Which
variables a loop assigns is read from the code of the frame that runs it (:func:`read_loop`: the
``for`` whose iterator is keepalive's call, and the names its body stores, nested loops included) with
:func:`dis.get_instructions`: no source is needed, so scripts and notebook cells alike are read.

At the top level of a script or a cell those variables are the module's globals, which can be written
back: :class:`LoopVariables` saves the ones holding plain values (numbers, strings, small arrays and
tensors, small lists / tuples / dicts of them) with each checkpoint and puts them back on resume, before
the loop continues, and names the others the loop carries from one step to the next, with the line
that fixes it. Inside a function (whose variables cannot be written back) it names the loop-carried
ones. Loop-carried: read in a loop's body before that body assigns it (in the code's linear order, an
approximation): ``loss`` or ``logits``, assigned before use every step, are not; a ``+=`` counter is.

JAX arrays in those variables (the loop's PRNG key: ``rng, input_rng = jax.random.split(rng)``, a loss
kept in a history) are saved as host arrays, a typed key as its key data and implementation, and put
back as JAX arrays (:func:`_jax_host` / :func:`_jax_back`). Reading the values changes nothing (no
random number is drawn, nothing is mutated). This module
imports nothing but the standard library (tensors and arrays are recognised through ``sys.modules``),
so that every adapter can use it and its analysis runs under every supported Python.
"""
from __future__ import annotations

import dis
import inspect
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Callable, Collection, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

__all__ = ["LoopCode", "LoopVariables", "MAX_BYTES", "caller_frame", "plain_size", "read_loop",
           "reads_after"]

#: what the loop's variables may hold in all, per checkpoint (bigger values are named, not saved)
MAX_BYTES = 16 * 2**20
#: elements of the lists, tuples and dicts of one value (more: not a small value)
MAX_ITEMS = 10_000
_TORCH_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                           "uint8", "bool"})
_SCOPES = ("NAME", "GLOBAL", "FAST", "DEREF")
#: methods that change a list / dict / set in place: a container the loop only appends to (a history of
#: losses) is loop state as much as a rebound counter
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update",
                      "setdefault", "popitem", "add", "discard", "__setitem__", "__iadd__"})


def caller_frame(depth: int = 1) -> Optional[FrameType]:
    """The frame ``depth`` levels above the caller of this function (1: its caller's caller, the
    user's loop when called from a ``ckpt.epochs()`` facade method), or None where there is none."""
    try:
        return sys._getframe(depth + 1)
    except (ValueError, AttributeError):  # no such frame, or an implementation without frames
        return None


def _accesses(ins: dis.Instruction) -> List[Tuple[str, str]]:
    """(``load`` / ``store`` / ``global`` / ``clear``, name) for each variable ``ins`` reads or writes,
    in the order it does (3.13 fuses two accesses into one instruction)."""
    op, val = ins.opname, ins.argval
    if op == "LOAD_FAST_AND_CLEAR":  # an inlined comprehension's own variable (3.12+)
        return [("clear", val)]
    if op == "STORE_FAST_LOAD_FAST":
        return [("store", val[0]), ("load", val[1])]
    names = val if isinstance(val, tuple) else (val,)
    if op.startswith("STORE_") and op.split("_")[1] in _SCOPES:
        kind = "global" if op == "STORE_GLOBAL" else "name" if op == "STORE_NAME" else "store"
        return [(kind, str(n)) for n in names]
    if op.startswith("LOAD_") and any(scope in op for scope in _SCOPES):
        return [("load", str(n)) for n in names]
    return []


@dataclass(frozen=True)
class LoopCode:
    """What the body of one ``for`` loop assigns (names in the order first assigned)."""

    module_level: bool
    #: assigned names that are the frame's globals (module-level code, or ``global`` in a function)
    globals: Tuple[str, ...]
    #: assigned names that are a function's own variables (cannot be written back)
    locals: Tuple[str, ...]
    #: assigned names that a loop body reads before it assigns them
    carried: FrozenSet[str]
    #: the loop's body: the offsets of its ``FOR_ITER`` and of the instruction that ends it
    span: Tuple[int, int]


def _loops(instructions: Sequence[dis.Instruction], after: int, end: int) -> List[Tuple[int, int]]:
    """(``FOR_ITER`` offset, its jump target) of every ``for`` loop starting in (after, end)."""
    return [(i.offset, int(i.argval)) for i in instructions
            if i.opname == "FOR_ITER" and after < i.offset < end and isinstance(i.argval, int)]


def _carried(instructions: Sequence[dis.Instruction], spans: List[Tuple[int, int]]) -> Set[str]:
    """Names some span reads before its first assignment of them (and assigns)."""
    carried: Set[str] = set()
    for lo, hi in spans:
        loaded: Dict[str, int] = {}
        stored: Dict[str, int] = {}
        for ins in instructions:
            if lo < ins.offset < hi:
                for kind, name in _accesses(ins):
                    (loaded if kind == "load" else stored).setdefault(name, ins.offset)
        carried |= {n for n, at in stored.items() if n in loaded and loaded[n] < at}
    return carried


def _subscripted(instructions: Sequence[dis.Instruction], i: int) -> Optional[dis.Instruction]:
    """The load of the container in ``name[key].append(...)`` whose subscript is instruction ``i``:
    the first instruction of its line (``starts_line``: the line's number, or True on 3.13+; None /
    False inside a line), when it loads a plain name (not ``self.history[key]``: an attribute)."""
    while i > 0 and instructions[i].starts_line in (None, False):
        i -= 1
    after = instructions[i + 1] if i + 1 < len(instructions) else None
    return None if after is None or after.opname in ("LOAD_ATTR", "LOAD_METHOD") else instructions[i]


def _subscript(ins: dis.Instruction) -> bool:
    return ins.opname == "BINARY_SUBSCR" or (ins.opname == "BINARY_OP" and ins.argrepr == "[]")


def _mutated(instructions: Sequence[dis.Instruction], span: Tuple[int, int]) -> List[Tuple[str, str]]:
    """(scope, name) of the variables a loop body changes in place without assigning them:
    ``history.append(x)`` (a load, then a mutating method), ``history[key].append(x)`` (the load that
    starts the statement: Flax's ``metrics_history[f'train_{metric}'].append(value)``) and
    ``scores[k] = v`` (the container's load two instructions before ``STORE_SUBSCR``, or the first of a
    fused pair just before it on 3.13). Scope: ``global`` (a global or module name) or ``local``."""
    found: List[Tuple[str, str]] = []
    for i, ins in enumerate(instructions):
        if not span[0] < ins.offset < span[1] or i < 1:
            continue
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and str(ins.argval) in MUTATORS and \
                _subscript(instructions[i - 1]):
            container = _subscripted(instructions, i - 1)
            if container is None:
                continue
            target, pick = container, 0
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and str(ins.argval) in MUTATORS:
            target, pick = instructions[i - 1], -1
        elif ins.opname == "STORE_SUBSCR" and isinstance(instructions[i - 1].argval, tuple):
            target, pick = instructions[i - 1], 0  # 3.13 fuses the container's and the key's loads
        elif ins.opname == "STORE_SUBSCR" and i >= 2:
            target, pick = instructions[i - 2], -1
        else:
            continue
        loads = [name for kind, name in _accesses(target) if kind == "load"]
        if loads:
            scope = "local" if "FAST" in target.opname or "DEREF" in target.opname else "global"
            found.append((scope, loads[pick]))
    return found


def read_loop(code: CodeType, after: int, module_level: bool) -> Optional[LoopCode]:
    """The ``for`` loop of ``code`` whose iterator is the call at offset ``after`` (the first
    ``FOR_ITER`` after it: a call wrapped in ``tqdm()`` / ``enumerate()`` too), and what its body
    assigns; None when no loop follows. ``module_level``: the code runs with its globals as its
    namespace (a script, a notebook cell), where ``STORE_NAME`` writes a global."""
    instructions = list(dis.get_instructions(code))
    found = _loops(instructions, after, sys.maxsize)
    if not found:
        return None
    span = found[0]
    glob: Dict[str, None] = {}
    local: Dict[str, None] = {}
    cleared: Set[str] = set()
    for ins in instructions:
        if span[0] < ins.offset < span[1]:
            for kind, name in _accesses(ins):
                if kind == "clear":
                    cleared.add(name)
                elif kind == "global" or (kind == "name" and module_level):
                    glob[name] = None
                elif kind in ("store", "name"):
                    local[name] = None
    spans = [span, *_loops(instructions, span[0], span[1])]
    carried = _carried(instructions, spans) - cleared
    for scope, name in _mutated(instructions, span):
        if name in cleared or name in glob or name in local:
            continue  # assigned in the loop too (an inner loop's `param_group`): the assignment decides
        if scope == "global":  # a module's name (or a function's global): written back on resume
            glob.setdefault(name, None)
        else:  # a function's own container: carried, and it cannot be written back
            local.setdefault(name, None)
            carried.add(name)
    return LoopCode(module_level, tuple(n for n in glob if n not in cleared),
                    tuple(n for n in local if n not in cleared), frozenset(carried), span)


def reads_after(code: CodeType, after: int, until: Optional[int] = None) -> Tuple[str, ...]:
    """The names that the code after the ``for`` loop over the call at ``after`` reads (up to offset
    ``until``: the end of an enclosing loop's body) before assigning them, and that the loop assigns:
    what an epoch's code after its batch loop (``print(loss.item())``) takes from its last batch."""
    instructions = list(dis.get_instructions(code))
    found = _loops(instructions, after, sys.maxsize)
    if not found:
        return ()
    lo, hi = found[0]
    assigned = {name for ins in instructions if lo < ins.offset < hi
                for kind, name in _accesses(ins) if kind != "load"}
    reads: Dict[str, None] = {}
    stored: Set[str] = set()
    for ins in instructions:
        if hi <= ins.offset < (until if until is not None else sys.maxsize):
            for kind, name in _accesses(ins):
                if kind == "load" and name in assigned and name not in stored:
                    reads[name] = None
                elif kind != "load":
                    stored.add(name)
    return tuple(reads)


def _modules() -> Tuple[Any, Any]:
    """numpy and torch where already imported (never imported here)."""
    return sys.modules.get("numpy"), sys.modules.get("torch")


#: marks a JAX array saved among the loop's variables: {JAX_MARK: host array, "key": impl or None}
JAX_MARK = "__keepalive_jax__"


def _jax_array(value: Any) -> Any:
    """``jax`` when ``value`` is a JAX array (jax already imported), else None."""
    jax = sys.modules.get("jax")
    return jax if jax is not None and isinstance(value, jax.Array) else None


def _jax_host(jax: Any, value: Any) -> Dict[str, Any]:
    """A JAX array as host data: a typed PRNG key as its key data (reading it draws nothing)."""
    np = sys.modules["numpy"]
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return {JAX_MARK: np.array(jax.random.key_data(value)), "key": str(jax.random.key_impl(value))}
    return {JAX_MARK: np.array(value), "key": None}


def _jax_back(saved: Dict[str, Any]) -> Any:
    """:func:`_jax_host`'s value as the JAX array the loop had (on the default device)."""
    import jax  # a checkpoint holding a JAX array was written by a loop that had it imported

    data = jax.device_put(saved[JAX_MARK])
    return jax.random.wrap_key_data(data, impl=saved["key"]) if saved.get("key") else data


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and type(value) is torch.Tensor


def plain_size(value: Any, depth: int = 0) -> Optional[int]:
    """The bytes ``value`` takes in a checkpoint if it is a plain value (None, a bool, int, float,
    str or bytes, a numpy or torch scalar, a numpy array or a torch tensor of a storable dtype, a
    small list / tuple / dict of those: exact types, so that a value put back has its type), else
    None. Reads only: no conversion, no device transfer."""
    kind = type(value)
    if value is None or kind in (bool, int, float):
        return 8
    if kind in (str, bytes):
        return len(value)
    np, torch = _modules()
    jax = _jax_array(value)
    if jax is not None:
        if value.is_deleted():  # donated to a jitted step: nothing left to save
            return None
        key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        return 8 * int(value.size) + 8 if key else (int(value.nbytes) if value.dtype.kind in "biuf" and
                                                     value.dtype.itemsize <= 8 else None)
    if np is not None and (isinstance(value, np.generic) or kind is np.ndarray):
        return int(value.nbytes) if value.dtype.kind in "biuf" and value.dtype.itemsize <= 8 else None
    if torch is not None and kind is torch.Tensor:  # not a Parameter: the model's own state
        if value.layout != torch.strided or value.is_quantized or str(value.dtype)[6:] not in _TORCH_DTYPES:
            return None
        return int(value.numel() * value.element_size())
    if kind in (list, tuple, dict) and depth < 8 and len(value) <= MAX_ITEMS:
        items = [*value.keys(), *value.values()] if kind is dict else list(value)
        total = 8
        for item in items:
            size = plain_size(item, depth + 1)
            if size is None:
                return None
            total += size
        return total
    return None


def _snapshot(value: Any, devices: List[str]) -> Any:
    """A copy of a plain value's containers, its tensors detached (their devices noted in order)."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_snapshot(v, devices) for v in value)
    if kind is dict:
        return {k: _snapshot(v, devices) for k, v in value.items()}
    if _is_tensor(value):
        devices.append(str(value.device))
        return value.detach().contiguous()
    jax = _jax_array(value)
    return _jax_host(jax, value) if jax is not None else value


def _containers(value: Any, depth: int = 0) -> Any:
    """``value`` with its lists, tuples and dicts copied (small ones: what :func:`plain_size` may
    accept), everything else shared."""
    kind = type(value)
    if kind in (list, tuple) and depth < 8 and len(value) <= MAX_ITEMS:
        return kind(_containers(v, depth + 1) for v in value)
    if kind is dict and depth < 8 and len(value) <= MAX_ITEMS:
        return {k: _containers(v, depth + 1) for k, v in value.items()}
    return value


def _put_back(value: Any, devices: List[str]) -> Any:
    """A loaded value as the loop had it: tensors on their devices, arrays in their own memory."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_put_back(v, devices) for v in value)
    if kind is dict and JAX_MARK in value:
        return _jax_back(value)
    if kind is dict:
        return {k: _put_back(v, devices) for k, v in value.items()}
    np = sys.modules.get("numpy")
    if _is_tensor(value):
        device = devices.pop(0) if devices else "cpu"
        return value.to(device) if device != "cpu" else value.clone()
    if np is not None and type(value) is np.ndarray:
        return value.copy()
    return value


def _fix_for(name: str, value: Any, size: Optional[int]) -> str:
    """The line that keeps ``value`` (assigned in the loop as ``name``) across a resume."""
    what = type(value).__qualname__
    if size is not None:
        return (f"`{name}` ({what}, {size / 2**20:.0f} MiB) is over the {MAX_BYTES // 2**20} MiB kept for "
                "the loop's variables: draw it inside the step, or keep it in a registered module")
    if callable(getattr(type(value), "state_dict", None)):
        return f"`{name}` ({what}): register it with ckpt.register('{name}', {name})"
    return (f"`{name}` ({what}): keep what it holds in ckpt.extras (ckpt.extras['{name}'] = ... at the "
            f"end of a step, read back after ckpt.resume())")


class LoopVariables:
    """The variables of the loop one checkpointer runs: saved, put back and named as they can be.

    ``watch(frame)`` when the outermost keepalive loop starts; ``capture()`` for each checkpoint
    (its ``loop`` section); ``loaded(section)`` when a checkpoint is restored; ``put_back()`` once the
    loop continues; ``keep()`` at each step boundary and ``put(tree, kept)`` for a save made during an
    evaluation (it saves the boundary's values). ``say`` / ``warn(message, key)`` are the core's.
    """

    def __init__(self, say: Callable[[str], None], warn: Callable[..., None], *, enabled: bool = True,
                 track: Optional[Sequence[str]] = None, max_bytes: int = MAX_BYTES):
        self.say, self.warn = say, warn
        self.enabled = enabled
        self.track = None if track is None else tuple(track)
        self.max_bytes = max_bytes
        self.loop: Optional[LoopCode] = None
        self.namespace: Optional[Dict[str, Any]] = None   # the globals the loop's code writes
        self.function = ""                                # the loop's function (for messages)
        self.pending: Optional[Dict[str, Any]] = None     # a loaded section, put back at the loop's start
        self.code: Optional[CodeType] = None                # the code running the loop
        self.told: Set[str] = set()
        self.said_saved = False
        self._read: Dict[Tuple[Any, ...], Any] = {}        # the code read so far (a loop runs many times)
        #: inner loops in functions of their own, named at the next save that may speak
        self._pending_functions: List[Tuple[str, LoopCode]] = []
        #: values the adapter saves itself (a JAX train state handed to ckpt.update()): neither kept
        #: among the loop's variables nor named as missing
        self.owned: Callable[[Any], bool] = lambda value: False
        #: names of variables holding such values where they cannot be read (a loop in a function):
        #: not named as missing either
        self.managed_names: Collection[str] = ()

    # ------------------------------------------------------------------------------ the loop's code
    def watch(self, frame: Optional[FrameType]) -> None:
        """The loop over the call ``frame`` is running (keepalive's outermost loop) is the one whose
        variables are kept."""
        if frame is None or not (self.enabled or self.track):
            return
        code = frame.f_code
        # a function's frame is never read for its locals (that would copy them on 3.11 / 3.12)
        module_level = not code.co_flags & inspect.CO_OPTIMIZED and frame.f_globals is frame.f_locals
        loop = self._reading(read_loop, code, frame.f_lasti, module_level)
        if loop is not None:
            self.loop, self.namespace, self.function, self.code = loop, frame.f_globals, code.co_name, code

    def inner(self, frame: Optional[FrameType]) -> None:
        """A keepalive loop inside the watched one that runs in a function of its own (timm's
        ``train_one_epoch()`` with the batch loop, called from a top-level ``ckpt.epochs()`` loop):
        that function's carried variables (``num_updates += 1``) cannot be put back: named, once."""
        if frame is None or not self.enabled or frame.f_code is self.code:
            return
        code = frame.f_code
        if not code.co_flags & inspect.CO_OPTIMIZED:
            return
        loop = self._reading(read_loop, code, frame.f_lasti, False)
        key = f"function:{code.co_name}:{code.co_firstlineno}"
        if loop is not None and key not in self.told:
            self.told.add(key)
            self._pending_functions.append((code.co_name, loop))

    def _reading(self, read: Callable[..., Any], code: CodeType, *args: Any) -> Any:
        """``read(code, *args)``, once per code and call site; None where the code cannot be read."""
        key = (read, code, *args)
        if key not in self._read:
            try:
                self._read[key] = read(code, *args)
            except Exception:  # noqa: BLE001 - an unreadable code object: nothing is kept, nothing changes
                self._read[key] = None
        return self._read[key]

    def unrestored_reads(self, frame: FrameType, until: Optional[int]) -> Tuple[str, ...]:
        """What the code after the batch loop starting in ``frame`` reads from its last batch (up to
        ``until``, the end of the epoch loop's body) that a resume does not put back."""
        reads = self._reading(reads_after, frame.f_code, frame.f_lasti, until) or ()
        kept = self.restored(frame)
        return tuple(n for n in reads if n not in kept)

    def names(self) -> Tuple[str, ...]:
        """The globals saved with each checkpoint."""
        if self.track is not None:
            return self.track
        return self.loop.globals if self.loop is not None and self.enabled else ()

    def restored(self, frame: Optional[FrameType]) -> Set[str]:
        """Of the names ``frame``'s code uses, those a resume puts back (the watched loop's globals)."""
        if frame is None or self.namespace is None or frame.f_globals is not self.namespace:
            return set()
        return set(self.names())

    # ------------------------------------------------------------------------------------- saving
    def capture(self, tell: bool) -> Optional[Dict[str, Any]]:
        """The ``loop`` section of a checkpoint (None: nothing to keep); ``tell``: the loop has run a
        step in this process, so what is saved and what is not can be said (once)."""
        return self._section(self.now(), tell)

    def now(self) -> Dict[str, Any]:
        """The saved names' values as the loop's globals hold them now."""
        ns = self.namespace
        return {} if ns is None else {n: ns[n] for n in self.names() if n in ns}

    def keep(self) -> Dict[str, Any]:
        """What a save between steps (during an evaluation) takes of this boundary: the values as
        they are now, their lists / tuples / dicts copied (the code after the boundary may append to
        them), no tensor or array copied (the loop rebinds those, it does not change them)."""
        return {n: _containers(v) for n, v in self.now().items()}

    def put(self, tree: Dict[str, Any], kept: Dict[str, Any]) -> None:
        """Make ``tree``'s ``loop`` section the one of the boundary ``kept`` was taken at."""
        section = self._section(kept, tell=False)
        if section is None:
            tree.pop("loop", None)
        else:
            tree["loop"] = section

    def _section(self, now: Dict[str, Any], tell: bool) -> Optional[Dict[str, Any]]:
        values: Dict[str, Any] = {}
        devices: Dict[str, List[str]] = {}
        skipped: Dict[str, Tuple[Any, Optional[int]]] = {}
        used = 0
        for name, value in now.items():
            if inspect.ismodule(value) or inspect.isroutine(value) or inspect.isclass(value) or self.owned(value):
                continue  # code, not state; or state the adapter saves
            size = plain_size(value)
            if size is None or used + size > self.max_bytes:
                skipped[name] = (value, size)
                continue
            used += size
            found: List[str] = []
            values[name] = _snapshot(value, found)
            if any(d != "cpu" for d in found):
                devices[name] = found
        if tell:
            self._tell(values, skipped)
        return {"values": values, "devices": devices} if values else None

    def _tell(self, values: Dict[str, Any], skipped: Dict[str, Tuple[Any, Optional[int]]]) -> None:
        """Once: which variables are saved, which the loop carries and are not, with the fix."""
        loop = self.loop
        if values and not self.said_saved:
            self.said_saved = True
            self.say(f"the loop's variables are saved with each checkpoint and put back on resume: "
                     f"{', '.join(values)}")
        carried = loop.carried if loop is not None and self.track is None else frozenset()
        unsaved = [n for n in skipped if n in carried and n not in self.told and n not in self.managed_names]
        if unsaved:
            self.told.update(unsaved)
            fixes = "; ".join(_fix_for(n, *skipped[n]) for n in unsaved)
            self.warn(f"the loop carries {len(unsaved)} variable(s) from one step to the next that the "
                      f"checkpoint does not hold (a resumed run starts them from what the code before the "
                      f"loop sets): {fixes}", key="loop-unsaved:" + ",".join(unsaved))
        if loop is not None and not loop.module_level and "function" not in self.told and self.enabled:
            self.told.add("function")
            self._tell_function(loop, self.function)
        pending, self._pending_functions = self._pending_functions, []
        for function, inner in pending:
            self._tell_function(inner, function)

    def _tell_function(self, loop: LoopCode, function: str) -> None:
        names = [n for n in loop.locals if n in loop.carried and n not in self.managed_names]
        if not names:
            return
        first = names[0]
        self.warn(f"the training loop runs inside {function}(), whose variables cannot be put back on "
                  f"resume: {', '.join(names)} carry from one step to the next and a resumed run starts them "
                  "from what the code before the loop sets. Move the loop to the top level of the script or "
                  "cell (its variables are then saved with each checkpoint), or keep them in ckpt.extras: "
                  f"`ckpt.extras['{first}'] = {first}` at the end of each step and "
                  f"`{first} = ckpt.extras.get('{first}', {first})` after `ckpt.resume()`.",
                  key=f"loop-in-function:{function}")

    # ------------------------------------------------------------------------------------ resuming
    def loaded(self, section: Optional[Dict[str, Any]]) -> None:
        """A checkpoint's ``loop`` section, put back when the loop continues."""
        self.pending = dict(section) if section else None

    def put_back(self) -> None:
        """Write the loaded values into the loop's globals (once, before the loop continues)."""
        section, self.pending = self.pending, None
        if section is None or self.namespace is None:
            return
        wanted = set(self.names()) if self.track is not None or self.enabled else set()
        devices = section.get("devices") or {}
        for name, value in (section.get("values") or {}).items():
            if name in wanted:
                self.namespace[name] = _put_back(value, list(devices.get(name, [])))

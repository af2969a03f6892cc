"""The framework-neutral training state and its safe on-disk form.

A training state is a tree of dicts, lists and tuples whose leaves are numbers, strings, bytes,
``None``, torch tensors, numpy arrays (what ``state_dict()`` methods and RNG getters return) or JAX
arrays. It is stored as two files:

* ``tensors.safetensors`` - every tensor and array, in the safetensors format (readable by the
  ``safetensors`` library too), laid out largest item size first so every tensor is aligned;
* ``state.json`` - everything else, with each tensor replaced by a reference to its key.

Loading parses JSON and raw bytes only; it never unpickles and so never runs code from a checkpoint.
Values that would need pickling raise :class:`~keepalive.errors.UnsupportedStateError` at save time,
naming where in the state they sit.

:class:`HostSnapshot` copies the tensors of a state into one reusable host buffer laid out exactly as
the safetensors data section, so a background thread can write it while training goes on, and the
next snapshot reuses the memory (host memory stays at about one extra copy of the state, given back
at the end of the training). :func:`prepare` encodes a state without copying anything, so the writer
can first ask whether a full copy fits in memory (:mod:`keepalive.memory`).

Every dtype safetensors knows is stored bit for bit, bfloat16 and float8 included: torch's own, and
numpy's through ``ml_dtypes`` (what ``np.asarray`` of a bf16 JAX array gives). A numpy-written one is
read back as an ``ml_dtypes`` array, a torch-written one as a torch tensor.

JAX arrays are held by reference (they never change in place): a snapshot starts their transfer to
the host (``copy_to_host_async``) and converts them (``np.asarray``, which gathers a sharded array of
this process's devices) when it copies them; they are read back as numpy arrays. Only a donation
(``jax.jit(..., donate_argnums=...)``) deletes one, so a lazy snapshot's copy must be settled before
the loop's next step can donate its buffers (:meth:`PendingCopy.wait`: the JAX adapter does so at
each step boundary); a deleted array met anyway fails the save with one line, never reads freed memory.
"""
from __future__ import annotations

import base64
import json
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

from .errors import CheckpointCorruptError, UnsupportedStateError

STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"

_MARK = "__ka_"
# safetensors dtype code <-> numpy dtype (bf16 / fp8: see _ML_DTYPE_NAMES)
_NP_CODES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64,
}
_NP_TO_CODE = {np.dtype(v): k for k, v in _NP_CODES.items()}
_TORCH_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_CODE_TO_TORCH = {v: k for k, v in _TORCH_CODES.items()}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
             "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# the codes numpy holds only through ml_dtypes (a numpy extension that jax and tensorflow import): an
# array of these dtypes exists only where ml_dtypes was imported, so it is looked up, never imported,
# when writing, and imported when a numpy-written one is read
_ML_DTYPE_NAMES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_ML_TO_CODE: Dict[Any, str] = {}


def _numpy_code(dtype: Any) -> Optional[str]:
    """The safetensors code of a numpy dtype, None for one that cannot be stored."""
    code = _NP_TO_CODE.get(dtype)
    if code is None and not _ML_TO_CODE:
        ml_dtypes = sys.modules.get("ml_dtypes")
        if ml_dtypes is not None:
            _ML_TO_CODE.update({np.dtype(getattr(ml_dtypes, name)): code
                                for code, name in _ML_DTYPE_NAMES.items()})
    return code if code is not None else _ML_TO_CODE.get(dtype)


def _numpy_dtype(code: str) -> Any:
    """The numpy dtype a numpy-written tensor of safetensors code ``code`` is read back as."""
    if code in _NP_CODES:
        return np.dtype(_NP_CODES[code])
    import ml_dtypes  # only bf16 / fp8 need it; whoever wrote them as numpy arrays had it

    return np.dtype(getattr(ml_dtypes, _ML_DTYPE_NAMES[code]))


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never import torch here: only recognise its tensors
    return torch is not None and isinstance(x, torch.Tensor)


def _is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")  # never import jax here: only recognise its arrays
    array = getattr(jax, "Array", None) if jax is not None else None
    return array is not None and isinstance(x, array)


def _is_torch_dtype(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)


@dataclass
class TensorRef:
    key: str
    value: Any          # the live tensor / array (not copied yet)
    kind: str           # "torch" | "numpy" | "jax" (a jax.Array, written as a numpy one)
    code: str           # safetensors dtype code
    shape: Tuple[int, ...]
    nbytes: int
    itemsize: int
    offset: int = 0


# ------------------------------------------------------------------------------------- encoding
def encode(tree: Any) -> Tuple[Any, List[TensorRef]]:
    """Split a state tree into a JSON-able tree and the list of its tensors."""
    encoder = _Encoder()
    return encoder.enc(tree, []), encoder.tensors


class _Encoder:
    """One :func:`encode`: the tensors found so far, and the keys given to them (each unique)."""

    def __init__(self) -> None:
        self.tensors: List[TensorRef] = []
        self.used: Dict[str, int] = {}

    def key_for(self, path: List[str]) -> str:
        base = ".".join(path) or "tensor"
        n = self.used.get(base, 0)
        self.used[base] = n + 1
        return base if n == 0 else f"{base}#{n}"

    def enc(self, x: Any, path: List[str]) -> Any:
        enc = self.enc
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, np.generic) and _numpy_code(x.dtype) is not None:  # before float: np.float64 is one
            return {_MARK + "npscalar__": self.add_numpy(np.asarray(x), self.key_for(path))}
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x)
        if _is_torch_tensor(x):
            return {_MARK + "tensor__": self.add_torch(x, self.key_for(path))}
        if isinstance(x, np.ndarray):
            return {_MARK + "tensor__": self.add_numpy(x, self.key_for(path))}
        if _is_jax_array(x):
            return {_MARK + "tensor__": self.add_jax(x, self.key_for(path))}
        if isinstance(x, (bytes, bytearray)):
            return {_MARK + "bytes__": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, tuple):
            return {_MARK + "tuple__": [enc(v, path + [str(i)]) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, path + [str(i)]) for i, v in enumerate(x)]
        if isinstance(x, (set, frozenset)):
            return {_MARK + "set__": [enc(v, path + [str(i)]) for i, v in enumerate(sorted(x, key=repr))]}
        if isinstance(x, Mapping):
            if all(isinstance(k, str) and not k.startswith(_MARK) for k in x):
                return {k: enc(v, path + [k]) for k, v in x.items()}
            return {_MARK + "dict__": [[enc(k, path + ["key"]), enc(v, path + [str(k)])]
                                       for k, v in x.items()]}
        if _is_torch_dtype(x):
            return {_MARK + "torch_dtype__": str(x).replace("torch.", "")}
        where = "state" + "".join(f"[{p!r}]" for p in path)
        raise UnsupportedStateError(
            f"cannot store a {type(x).__module__}.{type(x).__qualname__} at {where}: checkpoints hold "
            "only tensors, arrays, numbers, strings, bytes, lists and dicts, because loading must never "
            "run code (no pickle). Convert it, or leave it out of the state.")

    def add_torch(self, t: Any, key: str) -> str:
        name = str(t.dtype).replace("torch.", "")
        if name not in _TORCH_CODES:
            raise UnsupportedStateError(f"tensor {key} has dtype {t.dtype}, which safetensors cannot hold")
        if t.is_sparse or getattr(t, "is_quantized", False):
            raise UnsupportedStateError(f"tensor {key} is sparse or quantized; store a dense copy")
        self.tensors.append(TensorRef(key, t, "torch", _TORCH_CODES[name], tuple(t.shape),
                                      t.numel() * t.element_size(), t.element_size()))
        return key

    def add_numpy(self, a: np.ndarray, key: str) -> str:
        code = _numpy_code(a.dtype)
        if code is None:
            raise UnsupportedStateError(f"array {key} has dtype {a.dtype}, which cannot be stored safely")
        self.tensors.append(TensorRef(key, a, "numpy", code, tuple(a.shape), a.nbytes, a.dtype.itemsize))
        return key

    def add_jax(self, a: Any, key: str) -> str:
        """A ``jax.Array``, by reference: it is converted to a host array when the snapshot copies it."""
        jax = sys.modules["jax"]
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            raise UnsupportedStateError(f"array {key} is a typed PRNG key ({a.dtype}): store "
                                        "jax.random.key_data(key) and the name of jax.random.key_impl(key)")
        if a.is_deleted():
            raise UnsupportedStateError(deleted_message(key))
        if not a.is_fully_addressable:
            raise UnsupportedStateError(
                f"array {key} is sharded over several processes (jax.distributed): this process holds only "
                "part of it, and keepalive's own format stores whole arrays; such state is saved through Orbax")
        code = _numpy_code(np.dtype(a.dtype))
        if code is None:
            raise UnsupportedStateError(f"array {key} has dtype {a.dtype}, which cannot be stored safely")
        self.tensors.append(TensorRef(key, a, "jax", code, tuple(a.shape), int(a.nbytes), a.dtype.itemsize))
        return key


def deleted_message(key: str) -> str:
    """The line for a JAX array deleted before a save could copy it (a buffer donated to a step)."""
    return (f"array {key} was deleted before the checkpoint copied it (a buffer donated to a jitted step: "
            "donate_argnums): the save is dropped, the previous checkpoint stays the newest. Hand keepalive "
            "the arrays the step returned, and settle the save (Checkpointer.settle_snapshot()) before a step "
            "that donates them, or use snapshot='blocking'")


def layout(tensors: List[TensorRef]) -> Tuple[bytes, int]:
    """Assign offsets (largest item size first: every tensor ends up aligned) and build the
    safetensors header. Returns (header bytes incl. its 8-byte length prefix, data size)."""
    tensors.sort(key=lambda t: -t.itemsize)  # stable: keeps state order within one item size
    offset = 0
    header: Dict[str, Any] = {}
    kinds = {}
    for t in tensors:
        t.offset = offset
        header[t.key] = {"dtype": t.code, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        kinds[t.key] = "numpy" if t.kind == "jax" else t.kind  # read back as host arrays
        offset += t.nbytes
    header["__metadata__"] = {"keepalive.kinds": json.dumps(kinds, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    # the data section starts page-aligned: in the host buffer (page-aligned itself) and in the file,
    # so the store can write it with O_DIRECT (no page-cache copy); at most 4 KiB of JSON spaces
    raw += b" " * (-(len(raw) + 8) % 4096)
    return struct.pack("<Q", len(raw)) + raw, offset


@dataclass
class Encoded:
    """A state tree split for writing: its JSON form, its tensors laid out, the safetensors header
    and the size of the data section (what a host copy of the tensors takes)."""

    json_tree: Any
    tensors: List[TensorRef]
    header: bytes
    size: int

    def state_json(self) -> bytes:
        return json.dumps(self.json_tree, separators=(",", ":"), allow_nan=True).encode()


def prepare(tree: Any) -> Encoded:
    """Encode ``tree`` and lay its tensors out (nothing is copied yet)."""
    json_tree, tensors = encode(tree)
    header, size = layout(tensors)
    return Encoded(json_tree, tensors, header, size)


class HostSnapshot:
    """A reusable host-memory buffer holding a copy of a state's tensors.

    ``take(tree)`` copies every tensor into the buffer (the only part that blocks training) and
    returns the files to commit. The buffer is reused by the next ``take`` when the state has the
    same size or less; so at most one extra copy of the state lives in host memory, and none after
    :meth:`release` (the end of the training). Whether a full copy may be made at all is the
    writer's question (:mod:`keepalive.memory`); a state that does not fit is streamed instead
    (:mod:`keepalive.hoststream`).
    """

    def __init__(self) -> None:
        self._buffer: Optional[np.ndarray] = None
        self._pinned: Any = None
        self._reserving: Optional[threading.Thread] = None
        #: the tensors of the last :meth:`take` still to copy (a lazy snapshot), or None
        self.pending: Optional[PendingCopy] = None

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def reserve(self, tree: Any, fits: Optional[Callable[[int], bool]] = None) -> None:
        """Allocate the buffer for ``tree`` and touch every page in a background thread.

        Called when training starts, so that the first save copies into memory that is already
        mapped: faulting in a fresh buffer costs more than the copy itself (0.2-1.3 s per GiB seen
        here). ``ctypes.memset`` releases the GIL, so training runs on meanwhile. ``fits(size)``:
        whether a full copy may be held at all (the memory budget); if not, nothing is allocated.
        """
        if self._buffer is not None or self._reserving is not None:
            return
        _, tensors = encode(tree)
        _, size = layout(tensors)
        if size < (64 << 20) or fits is not None and not fits(size):
            return  # small states fault in quickly at the first save; a state too large is streamed

        def run() -> None:
            import ctypes

            buf = host_buffer(size)
            ctypes.memset(buf.ctypes.data, 0, buf.nbytes)
            self._buffer = buf

        self._reserving = threading.Thread(target=run, name="keepalive-reserve", daemon=True)
        self._reserving.start()

    def take(self, tree: Any, *, defer: Optional[Callable[[TensorRef], bool]] = None) -> Dict[str, Any]:
        """Copy ``tree``'s tensors into the buffer and return the files to commit (:meth:`fill`)."""
        return self.fill(prepare(tree), defer=defer)

    def held(self) -> int:
        """The bytes of the buffer held (once a reservation under way has finished)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        return self.capacity

    def fill(self, encoded: Encoded, *, defer: Optional[Callable[[TensorRef], bool]] = None) -> Dict[str, Any]:
        """Copy an encoded state's tensors into the buffer and return the files to commit.

        With ``defer``, the tensors it accepts are not copied now: :attr:`pending` holds them, with
        each one's version counter at this moment, for :meth:`PendingCopy.run` to copy later (the
        lazy snapshot: parameters and optimizer state do not change until the next optimizer step).
        JAX arrays never change in place, so with ``defer`` given (the caller settles the copy before
        the loop's next step, which may donate them) every one of them is copied later, and each
        one's transfer to the host starts here. The files are complete only once that copy has run."""
        self.held()
        tensors, header, size = encoded.tensors, encoded.header, encoded.size
        if self._buffer is None or self._buffer.nbytes < size:
            self.release()  # free the old buffer before allocating the bigger one
            self._buffer = host_buffer(size)
        buf = self._buffer
        _start_host_transfers(tensors)
        later: List[Tuple[TensorRef, np.ndarray]] = []
        for t in tensors:
            slot = buf[t.offset:t.offset + t.nbytes]
            if defer is not None and t.nbytes and (t.kind == "jax" or t.kind == "torch" and defer(t)):
                later.append((t, slot))
            else:
                copy_into(t, slot)
        self.pending = PendingCopy(later, self) if later else None
        return {STATE_FILE: encoded.state_json(), TENSOR_FILE: [header, buf[:size].data]}

    def release(self) -> None:
        """Give the buffer back (unpinned first), and the lazy copy that refers to it: the training
        is over, or the next copy needs a larger one, or none (a streamed save). A later
        :meth:`fill` allocates a new one."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._buffer is not None and self._pinned is not None:
            unpin_host(self._pinned)
        self._buffer, self._pinned, self.pending = None, None, None

    def pin_for(self, tensors: List[TensorRef]) -> None:
        """Page-lock the buffer once when the state holds CUDA tensors, so device-to-host copies run
        asynchronously on a side stream at full speed (kept across saves: registering costs more
        than a copy). No extra GPU memory is used."""
        if self._buffer is None or self._pinned is not None:
            return
        if not any(t.kind == "torch" and t.value.is_cuda for t in tensors):
            return
        self._pinned = pin_host(self._buffer)


def copy_into(t: TensorRef, slot: np.ndarray) -> None:
    """Copy one tensor of a snapshot into its slot of the host buffer (bit for bit: no cast)."""
    if t.kind == "torch":
        _copy_torch_into(t.value, slot)
    elif t.nbytes:
        value = host_array(t) if t.kind == "jax" else t.value
        np.copyto(slot.view(value.dtype).reshape(t.shape), value, casting="no")


def host_array(t: TensorRef) -> np.ndarray:
    """A JAX array's values on the host (a sharded one gathered from this process's devices); a
    deleted one (donated to a step before this copy) raises :class:`UnsupportedStateError`."""
    try:
        return np.asarray(t.value)
    except RuntimeError:
        if t.value.is_deleted():
            raise UnsupportedStateError(deleted_message(t.key)) from None
        raise


def _start_host_transfers(tensors: List[TensorRef]) -> None:
    """Start every JAX array's device-to-host transfer before any is waited for (they overlap each
    other and the training; on CPU there is nothing to transfer)."""
    for t in tensors:
        if t.kind == "jax" and t.nbytes:
            try:
                t.value.copy_to_host_async()
            except RuntimeError:  # deleted meanwhile: its copy says so in one line
                pass


class PendingCopy:
    """The tensors of a lazy snapshot still to copy into its host buffer.

    :meth:`run` copies them (the writer's thread, while the loop runs its next forward and backward);
    :meth:`wait` blocks until what the next step may change is copied (the next optimizer step's
    pre-hook) and, with ``help=True``, copies what the thread has not reached yet itself, with torch's
    threads: a step that comes before the copy is done waits no longer than a blocking copy would have
    taken (a training that keeps every core busy leaves the writer's thread little time). :meth:`changed`
    then names every tensor whose version counter moved since the snapshot, i.e. that was changed in
    place before (or while) it was copied: its copy may hold the new values, so the snapshot is not one
    state. CPU tensors are copied in pieces of :attr:`PIECE_BYTES`, which either side claims; CUDA
    tensors with ``non_blocking`` on a side stream into the (pinned) buffer, one event per group of
    tensors, so the copy engine overlaps the compute.

    JAX arrays never change in place; the next step may only donate (delete) them. Those of an
    accelerator are waited for only until their host values are held (:class:`HostValues`): their
    copies go on in the writer's thread while the step runs. Those of the CPU backend are copied
    before the step like torch tensors: their host value is a view of the buffer, and holding it
    across the step stops JAX from donating that buffer, which made the step slower by more than
    the copy itself (a fresh allocation of the whole state: +40-95 ms for 96 MB against a 27 ms copy).
    """

    #: bytes of one CUDA event's group of tensors
    GROUP_BYTES = 64 << 20
    #: bytes of one piece of a CPU tensor's copy (claimed by the writer's thread or the waiter)
    PIECE_BYTES = 16 << 20

    def __init__(self, items: List[Tuple[TensorRef, np.ndarray]], owner: "HostSnapshot"):
        self.items = items
        self.versions = [getattr(t.value, "_version", 0) for t, _ in items]
        self.nbytes = sum(t.nbytes for t, _ in items)
        self._done = threading.Event()   # every item copied
        self._safe = threading.Event()   # what must be before the next step copied, host values held
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self._cuda = any(t.kind == "torch" and t.value.is_cuda for t, _ in items)
        self._host = HostValues([t for t, _ in items if t.kind == "jax" and not _in_host_memory(t.value)])
        held = {t.key for t in self._host.refs}
        # CPU: (source bytes or None for a whole-tensor copy, the tensor, its slot, first, end byte);
        # those to copy before the next step first: a waiter claims only those
        self._pieces: List[Tuple[Any, TensorRef, np.ndarray, int, int]] = []
        if not self._cuda:
            for t, slot in sorted(items, key=lambda item: item[0].key in held):
                flat = cpu_bytes(t.value) if t.kind == "torch" else None  # a JAX array: copied whole
                if flat is None:
                    self._pieces.append((None, t, slot, 0, t.nbytes))
                    continue
                for lo in range(0, t.nbytes, self.PIECE_BYTES):
                    self._pieces.append((flat, t, slot, lo, min(t.nbytes, lo + self.PIECE_BYTES)))
        self._next = 0
        self._left = len(self._pieces)
        self._before_left = sum(1 for piece in self._pieces if piece[1].key not in held)
        self._held = not self._host.refs
        owner.pin_for([t for t, _ in items])

    @property
    def copied(self) -> bool:
        return self._done.is_set()

    def run(self) -> None:
        """Copy every pending tensor (those no waiter claimed); never raises (:attr:`error` keeps
        what failed)."""
        try:
            if self._cuda:
                self._run_cuda()
                self._finished()
            else:
                self._hold_host_values()
                self._copy_pieces(threaded=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the waiter
            self.error = exc
            self._finished()

    def _finished(self) -> None:
        self._done.set()
        self._safe.set()

    def _hold_host_values(self) -> None:
        if self._held:
            return
        self._host.hold()
        with self._lock:
            self.error = self.error or self._host.error
            self._held = True
            if self._before_left == 0:
                self._safe.set()

    def _run_cuda(self) -> None:
        stream, events, group = _side_stream(self.items), [], 0
        for t, slot in self.items:
            if t.kind == "torch":
                _copy_torch_into(t.value, slot, stream=stream)
            else:
                copy_into(t, slot)
            group += t.nbytes
            if stream is not None and group >= self.GROUP_BYTES:
                events.append(_record(stream))
                group = 0
        if stream is not None:
            events.append(_record(stream))
            for event in events:
                event.synchronize()

    def _copy_pieces(self, threaded: bool, before_step: bool = False) -> None:
        while True:
            with self._lock:
                if self._next >= len(self._pieces) or before_step and self._pieces[self._next][1] in self._host:
                    return
                flat, t, slot, lo, hi = self._pieces[self._next]
                self._next += 1
            try:
                if t.kind == "jax":
                    self._host.copy(t, slot)
                elif flat is None:
                    copy_into(t, slot)
                elif threaded:  # torch's copy spreads over its intra-op threads
                    import torch

                    torch.from_numpy(slot[lo:hi]).copy_(flat[lo:hi])
                else:  # numpy's: one core, without the GIL
                    np.copyto(slot[lo:hi], flat[lo:hi].numpy())
            except BaseException as exc:  # noqa: BLE001 - reported by the waiter
                self.error = exc
            with self._lock:
                self._left -= 1
                self._before_left -= t not in self._host
                if self._before_left == 0 and self._held:
                    self._safe.set()
                if self._left == 0:
                    self._finished()

    def wait(self, timeout: Optional[float] = None, help: bool = False) -> bool:
        """Block until the next step may run: every torch tensor and CPU JAX array copied, every other
        JAX array's host value held (their copies go on in the writer's thread). False when
        ``timeout`` passed first."""
        if not self._cuda:
            self._hold_host_values()
        if help and not self._cuda and not self._done.is_set() and not self._safe.is_set():
            self._copy_pieces(threaded=True, before_step=True)
        return self._done.is_set() or self._safe.wait(timeout)  # (all copied implies safe)

    def changed(self) -> List[str]:
        """The keys of tensors changed in place since the snapshot (call after :meth:`wait`, from the
        thread that trains: its in-place operations have all finished then)."""
        return [t.key for (t, _), v in zip(self.items, self.versions) if getattr(t.value, "_version", 0) != v]


class HostValues:
    """The host values of a lazy snapshot's JAX arrays on an accelerator, each held from :meth:`hold`
    until :meth:`copy` has put it into the buffer: from then on the loop's next step may donate
    (delete) the array. A host value is the host copy whose transfer the save started
    (``copy_to_host_async``). (:meth:`copy` copies any JAX array: one not held is converted then.)"""

    def __init__(self, refs: List[TensorRef]):
        self.refs = refs
        self._keys = {t.key for t in refs}
        self.error: Optional[BaseException] = None
        self._values: Dict[str, np.ndarray] = {}
        self._copied: Set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, t: TensorRef) -> bool:
        return t.key in self._keys

    def hold(self) -> None:
        """Take every array's host value not taken or copied yet (a deleted one: :attr:`error`)."""
        for t in self.refs:
            with self._lock:
                if t.key in self._values or t.key in self._copied:
                    continue
            try:
                value = host_array(t)
            except BaseException as exc:  # noqa: BLE001 - reported by the waiter
                self.error = exc
                continue
            with self._lock:
                if t.key not in self._copied:
                    self._values.setdefault(t.key, value)

    def copy(self, t: TensorRef, slot: np.ndarray) -> None:
        """Copy one array's host value (taken now if :meth:`hold` has not) into its slot, and let
        the value go."""
        with self._lock:
            value = self._values.get(t.key)
        if value is None:
            value = host_array(t)
        np.copyto(slot.view(value.dtype).reshape(t.shape), value, casting="no")
        with self._lock:
            self._values.pop(t.key, None)
            self._copied.add(t.key)


def _in_host_memory(a: Any) -> bool:
    """Whether a JAX array lives in host memory (the CPU backend: ``np.asarray`` gives a view of it)."""
    return all(d.platform == "cpu" for d in a.devices())


def cpu_bytes(t: Any) -> Any:
    """A CPU tensor's bytes as a flat uint8 view (no copy), or None where there is none."""
    import torch

    src = t.detach()
    if src.is_cuda or not src.is_contiguous() or src.dtype is torch.bool or src.numel() == 0:
        return None
    return src.reshape(-1).view(torch.uint8)


def host_buffer(size: int) -> np.ndarray:
    """A fresh buffer for snapshots. Large ones are anonymous mappings advised to use transparent
    huge pages: the first save touches every page, and 2 MiB pages make that ~3x cheaper than 4 KiB
    ones (0.18 s vs 0.55 s per GiB measured here)."""
    if size >= (1 << 20):
        import mmap

        try:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            return np.frombuffer(m, dtype=np.uint8)
        except (OSError, ValueError, AttributeError):  # pragma: no cover - not Linux
            pass
    return np.empty(max(size, 1), dtype=np.uint8)


def _copy_torch_into(t, slot: np.ndarray, stream: Any = None) -> None:
    import torch

    if t.numel() == 0:
        return
    src = t.detach()
    dst = torch.from_numpy(slot).view(t.dtype).view(t.shape)
    with torch.no_grad():
        if stream is not None and src.is_cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)


def _side_stream(items: List[Tuple[TensorRef, np.ndarray]]) -> Any:
    """A CUDA stream for the device-to-host copies, ordered after the work queued so far on the
    tensors' device (the step that produced them); None on CPU."""
    cuda = [t.value for t, _ in items if t.kind == "torch" and t.value.is_cuda]
    if not cuda:
        return None
    import torch

    device = cuda[0].device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _record(stream: Any) -> Any:
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event


def pin_host(buf: np.ndarray) -> Any:
    """Register ``buf`` with CUDA as page-locked memory (None where that fails: copies stay correct,
    only slower and synchronous)."""
    try:
        import torch

        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)) != 0:
            return None
        return buf.ctypes.data
    except Exception:  # noqa: BLE001 - pinning is an optimisation
        return None


def unpin_host(ptr: Any) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001
        pass


def frozen_copy(tree: Any) -> Any:
    """A copy of a state tree whose tensors and arrays are copies (on their own device), so it can be
    encoded later while the training changes the originals (FSDP2 saves, :mod:`keepalive.dcp`, take
    the small unsharded rest of the state this way and encode it in the background). Containers are
    rebuilt; immutable leaves are shared."""
    if _is_torch_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if _is_jax_array(tree):  # never changed in place, but a step may donate (delete) it
        return tree.copy()
    if isinstance(tree, bytearray):
        return bytes(tree)
    if isinstance(tree, tuple):
        return tuple(frozen_copy(v) for v in tree)
    if isinstance(tree, list):
        return [frozen_copy(v) for v in tree]
    if isinstance(tree, (set, frozenset)):
        return type(tree)(frozen_copy(v) for v in tree)
    if isinstance(tree, Mapping):
        return {k: frozen_copy(v) for k, v in tree.items()}
    return tree


def to_files(tree: Any) -> Dict[str, Any]:
    """The files of a state without keeping a reusable buffer (one-off saves and tests)."""
    return HostSnapshot().take(tree)


# ------------------------------------------------------------------------------------- decoding
def read_safetensors(buf, where: str = "?") -> Dict[str, Tuple[str, Tuple[int, ...], memoryview, str]]:
    """Parse a safetensors buffer without copying: key -> (dtype code, shape, bytes view, kind)."""
    view = memoryview(buf).cast("B")
    if len(view) < 8:
        raise CheckpointCorruptError(where, f"{TENSOR_FILE} is shorter than its header")
    (n,) = struct.unpack("<Q", view[:8])
    if n > len(view) - 8 or n > 100 << 20:
        raise CheckpointCorruptError(where, f"{TENSOR_FILE} has an impossible header length {n}")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except ValueError:
        raise CheckpointCorruptError(where, f"{TENSOR_FILE} header is not valid JSON") from None
    meta = header.pop("__metadata__", {}) or {}
    kinds = json.loads(meta.get("keepalive.kinds", "{}"))
    data = view[8 + n:]
    out = {}
    for key, spec in header.items():
        start, end = spec["data_offsets"]
        if not (0 <= start <= end <= len(data)):
            raise CheckpointCorruptError(where, f"tensor {key} lies outside {TENSOR_FILE}")
        code, shape = spec["dtype"], spec["shape"]
        count = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                count = -1
                break
            count *= d
        if code not in _ITEMSIZE or count * _ITEMSIZE[code] != end - start:
            raise CheckpointCorruptError(where, f"tensor {key}: dtype {code!r} and shape {shape!r} do not "
                                                f"fit its {end - start} bytes")
        out[key] = (code, tuple(shape), data[start:end], kinds.get(key, "torch"))
    return out


def _materialise(code: str, shape, raw: memoryview, kind: str, copy: bool):
    if kind == "numpy" or "torch" not in sys.modules and code in _NP_CODES:
        arr = np.frombuffer(raw, dtype=_numpy_dtype(code)).reshape(shape)
        return arr.copy() if copy else arr
    import torch

    dtype = getattr(torch, _CODE_TO_TORCH[code])
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.clone() if copy else t


def decode(json_tree: Any, tensors: Mapping[str, Any]) -> Any:
    """Rebuild a state tree from its JSON form and its tensors."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if len(x) == 1:
            (k, v), = x.items()
            if k.startswith(_MARK):
                tag = k[len(_MARK):-2]
                if tag == "tensor":
                    return tensors[v]
                if tag == "npscalar":
                    return np.asarray(tensors[v])[()]
                if tag == "bytes":
                    return base64.b64decode(v)
                if tag == "tuple":
                    return tuple(dec(i) for i in v)
                if tag == "set":
                    return {dec(i) for i in v}
                if tag == "dict":
                    return {_hashable(dec(kk)): dec(vv) for kk, vv in v}
                if tag == "torch_dtype":
                    import torch

                    dtype = getattr(torch, v, None) if isinstance(v, str) else None
                    if not isinstance(dtype, torch.dtype):  # never hand out other torch attributes
                        raise ValueError(f"{v!r} is not a torch dtype")
                    return dtype
        return {k: dec(v) for k, v in x.items()}

    return dec(json_tree)


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def from_files(files: Mapping[str, Any], where: str = "?", copy: bool = False) -> Any:
    """Rebuild a state from the verified files of a checkpoint.

    With ``copy=False`` tensors are views on the (memory-mapped) file buffer, valid as long as it is;
    ``load_state_dict`` copies them into the live objects anyway, so no second copy is made.
    """
    try:
        json_tree = json.loads(bytes(files[STATE_FILE]))
    except KeyError:
        raise CheckpointCorruptError(where, f"no {STATE_FILE}") from None
    except ValueError:
        raise CheckpointCorruptError(where, f"{STATE_FILE} is not valid JSON") from None
    tensors = {}
    if TENSOR_FILE in files:
        try:
            for key, (code, shape, raw, kind) in read_safetensors(files[TENSOR_FILE], where).items():
                tensors[key] = _materialise(code, shape, raw, kind, copy)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:  # a malformed header
            raise CheckpointCorruptError(where, f"{TENSOR_FILE} has an invalid tensor entry: "
                                                f"{type(exc).__name__}: {exc}") from None
    try:
        return decode(json_tree, tensors)
    except KeyError as exc:
        raise CheckpointCorruptError(where, f"{STATE_FILE} refers to a missing tensor {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointCorruptError(where, f"{STATE_FILE} is malformed: {exc}") from None

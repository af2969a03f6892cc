"""A save that streams: the state's tensors written piece by piece, with no full copy in host memory.

When a full host copy of the state does not fit in the memory budget (:mod:`keepalive.memory`), the
writer does not copy the state into a buffer as large as itself and write that in the background.
It writes ``tensors.safetensors`` while the training waits (a blocking save), its data section made
while the file is written (:class:`StreamedTensors`):

* a tensor or array already in host memory (a CPU tensor, a numpy array, a JAX array of the CPU
  backend) is written straight from its own memory: no copy at all;
* any other (a CUDA tensor, a JAX array on an accelerator, a bool or non-contiguous tensor) is
  copied piece by piece into one bounded buffer (:class:`StreamBuffer`, 64-256 MiB, pinned where CUDA
  copies go through it), which is written each time it is full.

The bounded buffer is kept while a run trains and given back at its end, as the full buffer is. The
data section is a re-iterable source: a write that is retried (a transient storage error, or the
spool taking over a failed destination) makes it again from the live tensors, which cannot change
meanwhile because the training waits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from .state import STATE_FILE, TENSOR_FILE, Encoded, TensorRef, cpu_bytes, host_array, host_buffer, pin_host, unpin_host
from .units import format_bytes

__all__ = ["StreamBuffer", "StreamedTensors", "Streamed", "buffered", "streamed_files"]


@dataclass(frozen=True)
class Streamed:
    """The figures of a streamed save, for the line that says so."""

    size: int       # the state's tensors, bytes
    limit: int      # the memory budget, bytes
    piece: int      # the bounded buffer, bytes
    source: str     # where the budget comes from, in words
    buffered: bool  # some tensors go through the bounded buffer (not all are in host memory)

    def line(self) -> str:
        how = (f"piece by piece through a {format_bytes(self.piece)} buffer" if self.buffered
               else "straight from the training's memory")
        return (f"the training state ({format_bytes(self.size)}) does not fit in the memory a save may use "
                f"for a copy of it ({format_bytes(self.limit)}: {self.source}): saves are written {how} while "
                "the training waits, with no full copy in memory (memory_budget= sets the budget)")


class StreamBuffer:
    """The bounded host buffer of streamed saves, reused from save to save and given back by
    :meth:`release`. Page-locked (pinned) when CUDA tensors are copied through it."""

    def __init__(self) -> None:
        self._buffer: Optional[np.ndarray] = None
        self._pinned: Any = None

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def get(self, size: int, cuda: bool) -> np.ndarray:
        """A buffer of ``size`` bytes (the one held when it has that size), pinned if ``cuda``."""
        if self._buffer is None or self._buffer.nbytes != size:
            self.release()
            self._buffer = host_buffer(size)
        if cuda and self._pinned is None:
            self._pinned = pin_host(self._buffer)
        return self._buffer

    def release(self) -> None:
        if self._buffer is not None and self._pinned is not None:
            unpin_host(self._pinned)
        self._buffer, self._pinned = None, None


class StreamedTensors:
    """The data section of ``tensors.safetensors``, made while it is written: each iteration yields
    its bytes in order, from the tensors' own memory or through the bounded buffer (each yielded
    buffer is valid until the next is asked for: the store writes and hashes it first)."""

    def __init__(self, tensors: List[TensorRef], size: int, buffer: StreamBuffer, piece: int):
        self.tensors, self.size, self.buffer, self.piece = tensors, size, buffer, piece

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[memoryview]:
        buf = np.empty(0, dtype=np.uint8)  # the bounded buffer, taken when a tensor first needs it
        fill = 0  # bytes of it not written yet
        for t in self.tensors:
            if not t.nbytes:
                continue
            own = _own_bytes(t)
            if own is not None:
                if fill:
                    yield buf[:fill].data
                    fill = 0
                yield own
                continue
            if not buf.nbytes:
                buf = self.buffer.get(self.piece, cuda=self._cuda())
            source, lo = _device_bytes(t), 0
            while lo < t.nbytes:
                n = min(t.nbytes - lo, self.piece - fill)
                _copy_bytes(source, lo, buf[fill:fill + n])
                fill, lo = fill + n, lo + n
                if fill == self.piece:
                    yield buf.data
                    fill = 0
        if fill:
            yield buf[:fill].data

    def _cuda(self) -> bool:
        return any(t.kind == "torch" and t.value.is_cuda for t in self.tensors)


def streamed_files(encoded: Encoded, buffer: StreamBuffer, piece: int) -> Dict[str, Any]:
    """The files of a streamed save (``{name: bytes or [buffers]}``, as the store commits them)."""
    data = StreamedTensors(encoded.tensors, encoded.size, buffer, piece)
    return {STATE_FILE: encoded.state_json(), TENSOR_FILE: [encoded.header, data]}


def buffered(tensors: List[TensorRef]) -> bool:
    """Whether a streamed save of ``tensors`` copies some through the bounded buffer (a tensor on a
    GPU, a bool or non-contiguous one, a JAX array outside host memory)."""
    return any(t.nbytes and (t.kind == "torch" and cpu_bytes(t.value) is None
                             or t.kind == "jax" and not all(d.platform == "cpu" for d in t.value.devices()))
               for t in tensors)


def _own_bytes(t: TensorRef) -> Optional[memoryview]:
    """The bytes of a tensor already in host memory, without a copy (None: it needs one)."""
    if t.kind == "torch":
        flat = cpu_bytes(t.value)
        return None if flat is None else flat.numpy().data
    if t.kind == "jax":  # on the CPU backend a view, on an accelerator one array's host copy
        return np.ascontiguousarray(host_array(t)).reshape(-1).view(np.uint8).data
    a = t.value if t.value.flags.c_contiguous else np.ascontiguousarray(t.value)
    return a.reshape(-1).view(np.uint8).data


def _device_bytes(t: TensorRef) -> Any:
    """A torch tensor's bytes as a flat uint8 tensor on its device (a non-contiguous one is made
    contiguous first: one tensor's copy, on its device)."""
    import torch

    src = t.value.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    return src.reshape(-1).view(torch.uint8)


def _copy_bytes(source: Any, lo: int, dst: np.ndarray) -> None:
    import torch

    with torch.no_grad():
        torch.from_numpy(dst).copy_(source[lo:lo + dst.nbytes])

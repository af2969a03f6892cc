"""Whether a ``for`` loop over a generator was left by ``break`` (or ``return``) or by an exception.

``for epoch in ckpt.epochs(n)`` treats a ``break`` as the run's end (early stopping) and an exception
passing through the loop as an interruption (the next run trains on). Python tells the generator
neither: it only closes it (``GeneratorExit``). What tells them apart is the instruction the loop's
frame was running when its iterator was dropped: leaving a ``for`` by ``break`` / ``return`` pops the
iterator with an instruction of its own (``POP_TOP`` on CPython 3.11 to 3.13, ``POP_ITER`` from
3.14), while an exception drops it while unwinding from the instruction that raised (a call, a
``raise``), and an explicit ``close()`` or ``del`` runs a call or a ``DELETE_*``.

The instruction is read with :func:`dis.get_instructions` at the frame's ``f_lasti`` (documented APIs,
no raw bytecode), so a new CPython's encoding does not matter, only the name of the instruction that
pops a loop's iterator. Where the answer cannot be read (no frame, no instruction at that offset,
another implementation), it is "no break": an interruption, the safe reading (the next run trains on
from the last checkpoint).

This module imports nothing but the standard library (its tests run it under several Pythons).
"""
from __future__ import annotations

import dis
from types import FrameType
from typing import Optional

__all__ = ["closed_by_break", "LOOP_EXITS"]

#: the instructions that drop a ``for`` loop's iterator when the loop is left by ``break`` / ``return``
LOOP_EXITS = frozenset({"POP_TOP", "POP_ITER"})


def instruction_at(frame: FrameType) -> Optional[str]:
    """The name of the instruction ``frame`` is running (or last ran), or None if it cannot be read."""
    at = frame.f_lasti
    if at < 0:  # not started
        return None
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset == at:
            return ins.opname
        if ins.offset > at:
            break
    return None


def closed_by_break(frame: Optional[FrameType]) -> bool:
    """Whether a generator being closed now was dropped by a ``break`` (or a ``return``) out of the
    ``for`` loop running in ``frame`` (the frame that closes it: ``sys._getframe(1)`` inside the
    generator's ``except GeneratorExit``), rather than by an exception passing through the loop.
    Anything else (an explicit ``close()``, ``del``, the garbage collector, an unreadable frame)
    counts as no break."""
    if frame is None:
        return False
    try:
        return instruction_at(frame) in LOOP_EXITS
    except Exception:  # noqa: BLE001 - an unreadable frame or code object: undecidable, so no break
        return False

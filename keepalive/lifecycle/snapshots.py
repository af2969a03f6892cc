"""Lazy snapshots: which tensors a save may copy after the training loop went on, and when that copy
must be finished.

With ``snapshot="lazy"`` (the default) and a background writer, a save copies the parameters and
state of the optimizers whose steps pass the step gate (:class:`keepalive.pauses.StepGate`) after it
returns: they change only inside an optimizer step, and the step first settles the copy
(:meth:`LazySnapshots.settle`: the gate's ``before_step``, or the adapter itself). Adapters add more
such tensors through ``lazy_sources``. A tensor found changed in place before its copy drops that
write: it is said once, that tensor is copied at once from then on, and the save is owed to the next
boundary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Set, Tuple

from .. import boundary as bd

if TYPE_CHECKING:
    from ..core import Checkpointer

__all__ = ["LazySnapshots"]


class LazySnapshots:
    """The lazy-copy policy of ``ckpt``'s saves."""

    def __init__(self, ckpt: "Checkpointer"):
        self.ckpt = ckpt
        #: keys of tensors a lazy snapshot found changed in place before their copy: copied at once
        self.copy_at_once: Set[str] = set()
        self._reason: Optional[str] = None  # the last lazy save's reason and step, to make it again
        self._step = 0

    def prepare(self, *, reason: str, step: int, sync: bool) -> Optional[Callable[[Any], bool]]:
        """Before a save is submitted: the last lazy save's copy settled (its failure said here, not
        inside the writer's wait), and which of this save's tensors may be copied later (None: all now)."""
        self.settle()
        defer = None if sync else self.deferrable()
        self._reason = reason if defer is not None else None
        self._step = step
        return defer

    def deferrable(self) -> Optional[Callable[[Any], bool]]:
        """Which tensors of a save the writer may copy after the loop went on: the parameters and
        state of the optimizers whose steps wait at the step gate (they change only inside a step,
        and the step settles the copy first). None: copy everything now."""
        ckpt = self.ckpt
        if ckpt.config.snapshot != "lazy" or not ckpt.writer.background:
            return None
        optimizers = ckpt.step_gate.watched()
        if not optimizers and not ckpt.lazy_sources:
            return None
        deferred: Set[Tuple[int, int]] = set()

        def add(t: Any) -> None:
            if hasattr(t, "data_ptr") and hasattr(t, "_version"):
                deferred.add((t.data_ptr(), t.numel() * t.element_size()))

        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p)
            for per_param in opt.state.values():
                for value in per_param.values():
                    add(value)
        for source in ckpt.lazy_sources:
            for t in source():
                add(t)
        at_once = self.copy_at_once

        def defer(ref: Any) -> bool:
            return ref.key not in at_once and (ref.value.data_ptr(), ref.nbytes) in deferred

        return defer

    def settle(self) -> None:
        """:meth:`keepalive.core.Checkpointer.settle_snapshot`: wait for the last lazy save's copy and
        check it (a no-op when none is unsettled)."""
        writer = self.ckpt.writer
        if not writer.unsettled:
            return
        changed = writer.settle()
        if not changed:
            return
        self.copy_at_once.update(changed)
        names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        self.ckpt.warn(f"{names} changed in place before its snapshot was copied: copied synchronously from now on, "
                       f"and the save of step {self._step} is made again at the next step boundary (a save copies "
                       "parameters and optimizer state in the background until the next optimizer step; nothing "
                       "to change, or snapshot='blocking' to copy everything at once)",
                       key="lazy-copy-changed")
        self.ckpt.machine.owe(bd.Due(save=self._reason or "a save made again"))

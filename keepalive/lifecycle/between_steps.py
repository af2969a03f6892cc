"""The pause guard: saves while the training loop pauses between steps (an evaluation, a data stall).

The mechanism and its rules are :mod:`keepalive.pauses`' (the mark, the boundary parts, the step gate, the
guard's thread); this module applies them to one checkpointer. At each consistent boundary it remembers
the mark (:meth:`BetweenSteps.remember`), with what each boundary part (:meth:`BetweenSteps.add_part`:
``ckpt.extras`` here, a scheduler's state in the torch adapter) kept of it. When a signal, a cloud's
notice or the deadline cannot wait for the next boundary, it saves the tensors as they are now with the
mark's random state and parts, only when no tensor moved since the mark
(:meth:`BetweenSteps.save_now`), either from the training thread
(:meth:`keepalive.core.Checkpointer.active`) or from the guard's thread while the loop has not called
keepalive for a while (:meth:`BetweenSteps.guard_act`, holding the step gate). Otherwise what came
due is owed to the next boundary, and said once (naming the tensor that moved) when a step is not
simply under way.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .. import boundary as bd
from .. import distributed as _distributed
from .. import pauses as _pauses
from .. import rng
from .. import session as _session
from ..interrupts import raise_for, signal_name
from ..runs import position
from ..statetree import StateTree
from ..writer import SnapshotChanged
from . import Capture
from .messages import exit_words

if TYPE_CHECKING:
    from ..core import Checkpointer

log = logging.getLogger("keepalive")

#: a save between steps now, if the state is still the mark's (``capture``, ``in_thread``)
PauseSave = Callable[[Optional[Capture], bool], None]

__all__ = ["BetweenSteps"]


class BetweenSteps:
    """The saves of ``ckpt`` between its loop's steps. ``pause_save`` is what the guard's thread calls
    to save (the checkpointer's own entry, which ends in :meth:`save_now`)."""

    def __init__(self, ckpt: "Checkpointer", pause_save: PauseSave):
        self.ckpt = ckpt
        self._pause_save = pause_save
        #: the state at the last consistent boundary (None: none since, or not consistent)
        self.mark: Optional[_pauses.Mark] = None
        self._last_capture: Optional[Capture] = None
        #: when the loop last called keepalive (monotonic)
        self.last_call = time.monotonic()
        self._guard: Optional[_pauses.PauseGuard] = None
        self._refusal_told = False
        #: what a save between steps takes as it was at the mark (adapters add theirs)
        self.parts: List[_pauses.BoundaryPart] = [
            _pauses.KeptValue("ckpt.extras", ("extras",), lambda: ckpt.extras)]
        self._kept: Dict[_pauses.BoundaryPart, Any] = {}

    def add_part(self, part: _pauses.BoundaryPart) -> None:
        """``part`` is kept at each consistent boundary and put into each save between steps
        (:class:`keepalive.pauses.BoundaryPart`)."""
        self.parts.append(part)

    # ------------------------------------------------------------------------- the loop's calls
    def alive(self) -> None:
        """The loop called keepalive: it is not paused, and the run is not idle."""
        self.last_call = time.monotonic()
        self.ckpt.store.lease.progress = self.ckpt.state.counters.as_dict()
        _session.note_activity()

    def remember(self, capture: Capture, consistent: bool) -> None:
        """After a boundary: the mark a save between steps starts from (none after an inconsistent
        one: gradients are pending, the loader is ahead)."""
        ckpt = self.ckpt
        self.last_call = time.monotonic()
        self._last_capture = capture
        if not consistent or ckpt.state.finished or ckpt.state.stopped:
            self.mark = None
            return
        self.mark = _pauses.Mark(counters=ckpt.state.counters, rng=rng.capture(),
                                 optimizer_steps=ckpt.optimizer_steps,
                                 versions=_pauses.versions(ckpt.saver.tracked), tensors=ckpt.saver.tracked,
                                 fingerprint=ckpt.fingerprint() if ckpt.fingerprint is not None else None,
                                 at=self.last_call, parts=self.keep_parts())

    def keep_parts(self) -> Tuple[Tuple[_pauses.BoundaryPart, Any], ...]:
        """What each part keeps of this boundary (from what it kept at the last one)."""
        kept: List[Tuple[_pauses.BoundaryPart, Any]] = []
        for part in self.parts:
            before = self._kept.get(part)
            try:
                value = part.keep(None if before is _pauses.UNKEPT else before)
            except Exception as exc:  # noqa: BLE001 - a part that cannot keep refuses saves between steps
                log.debug("%s not kept at the boundary: %s", part.name, exc)
                value = _pauses.UNKEPT
            kept.append((part, value))
        self._kept = dict(kept)
        return tuple(kept)

    def mark_checkpoint(self) -> None:
        """After a resume: until the first boundary, the checkpoint is the state (a signal during a
        pause before it, the validation of an epoch resumed at its end, needs no new save)."""
        ckpt = self.ckpt
        self.mark = _pauses.Mark(counters=ckpt.state.counters, rng=None, optimizer_steps=ckpt.optimizer_steps,
                                 versions=None, fingerprint=None, at=time.monotonic())

    # ----------------------------------------------------------------------------- the guard
    def start_guard(self) -> None:
        if self._guard is None:
            self._guard = _pauses.PauseGuard(lambda: self.last_call, self.guard_act)

    def stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        self.mark = None

    def wake(self) -> None:
        """A signal was noted: the guard looks at once."""
        if self._guard is not None:
            self._guard.wake()

    def guard_act(self) -> None:
        """The guard's thread, while the loop has not called keepalive for a while."""
        ckpt, lock = self.ckpt, self.ckpt.machine.lock
        if ckpt.writer.unsettled and lock.acquire(blocking=False):
            # a lazy snapshot's write waits for its check: with no step able to start, the loop's
            # pause is as good a moment as its next step
            try:
                with ckpt.step_gate.closed() as between_steps:
                    if between_steps:
                        ckpt.snapshots.settle()
            finally:
                lock.release()
        capture = self._last_capture
        if (self.mark is None or (capture is None and ckpt.state.unsaved) or not ckpt.step_gate.used
                or _distributed.GROUP.active or not lock.acquire(blocking=False)):
            return
        try:
            with ckpt.step_gate.closed() as between_steps:
                if between_steps:
                    self._pause_save(capture, True)
        finally:
            lock.release()

    # ------------------------------------------------------------------------------- the save
    def save_now(self, capture: Optional[Capture], in_thread: bool) -> None:
        """Save now what cannot wait for the next boundary, if the state is still the mark's."""
        ckpt = self.ckpt
        signum = ckpt.signals.peek()
        if signum is None:  # one taken at a boundary that could not save it
            signum = ckpt.state.pending.signal
        due = bd.Due()
        if signum is None:
            due = ckpt.trigger.between_steps_due(slack=_pauses.POLL_SECONDS + _pauses.PAUSE_SECONDS)
            if due.save is None and due.stop is None:
                return
        reason = f"{signal_name(signum)} received" if signum is not None else (due.stop or due.save or "")
        problem, stepping = self.unchanged_since_mark()
        tree: Optional[StateTree] = None
        mark = self.mark
        assert mark is not None
        moved = ""
        if problem is None and ckpt.state.unsaved:
            if capture is None:
                return
            tree = self.tree_at_mark(capture, mark)
            problem, moved = self._tree_problem(tree, mark)
        if problem is not None:
            ckpt.machine.owe(due)  # the next boundary saves it (a signal stays queued)
            if not stepping:  # a step under way is no pause: its boundary comes soon, nothing to say
                self._tell_refusal(reason, problem, moved)
            return
        if tree is not None and capture is not None:
            check = (lambda: self._tree_problem(tree, mark)[0]) if in_thread else None
            try:
                ckpt.save(capture, sync=True, reason=f"{reason} (during a pause of the training loop)",
                          tree=tree, check=check)
            except SnapshotChanged as exc:
                ckpt.machine.owe(due)
                log.debug("the state changed while it was copied: %s", exc)
                return
        self._after_save(signum, due, in_thread)

    def unchanged_since_mark(self) -> Tuple[Optional[str], bool]:
        """What moved since the mark (None: nothing), and whether a training step is under way. (The
        tensors are compared on the tree a save builds: :meth:`_tree_problem`.)"""
        ckpt, mark = self.ckpt, self.mark
        if mark is None:
            return "no step ended yet", True
        if ckpt.optimizer_steps != mark.optimizer_steps or ckpt.state.counters != mark.counters:
            return "an optimizer step ran since the last step boundary", True
        if ckpt.fingerprint is not None and mark.fingerprint is not None:
            # (the adapter's summary of what no boundary part keeps: the position, and its objects'
            # state that changes only where the loop cannot pause, or that could not be kept)
            now = ckpt.fingerprint()
            if now[1] != mark.fingerprint[1]:
                return "the next batch is under way", True
            if now != mark.fingerprint:
                return "the loop changed state beside the tensors since its last step (e.g. a scheduler stepped)", False
        for part, kept in mark.parts:
            if kept is _pauses.UNKEPT:
                return f"{part.name} could not be copied at the last step boundary", False
        return None, False

    def tree_at_mark(self, capture: Capture, mark: _pauses.Mark) -> StateTree:
        """The state tree of a save between steps: the tensors as they are now, the random state and
        what the boundary parts kept as they were at ``mark``."""
        tree = self.ckpt.build_tree(capture, rng_state=mark.rng)
        for part, kept in mark.parts:
            part.put(tree, kept)
        return tree

    def _tree_problem(self, tree: StateTree, mark: _pauses.Mark) -> Tuple[Optional[str], str]:
        """What changed in ``tree``'s tensors since ``mark`` (a forward's BatchNorm statistics, an EMA
        updated in place), or None; and the tensor that moved ("" when none is named)."""
        if mark.versions is None:  # (a mark of the checkpoint resumed from has nothing unsaved)
            return "no step ended since the resume", ""
        moved = _pauses.changed_tensor(tree, mark.tensors, mark.versions)
        if moved is not None:
            return ("a tensor of the state was changed in place since the last step (a forward pass in "
                    "training mode, an EMA update)"), moved
        if self.ckpt.fingerprint is not None and self.ckpt.fingerprint() != mark.fingerprint:
            return "the loop changed its state while it was copied", ""
        return None, ""

    def _tell_refusal(self, reason: str, problem: str, moved: str) -> None:
        if self._refusal_told:
            return
        self._refusal_told = True
        named = f". Changed in place since that step: {moved}" if moved else ""
        self.ckpt.warn(f"{reason.split(' -> ')[0]} while the training loop paused between steps (an evaluation?), "
                       f"but its state is no longer that of its last step ({problem}): the save waits for the next "
                       f"step boundary. {self.ckpt.pause_hint}{named}", key="pause-refused")

    def _after_save(self, signum: Optional[int], due: bd.Due, in_thread: bool) -> None:
        ckpt = self.ckpt
        where = position(ckpt.state.counters.as_dict())
        self.mark = None if signum is not None else self.mark
        if signum is not None:
            ckpt.say(f"{signal_name(signum)}: saved {where} to {ckpt.url} during a pause of the training loop"
                     f"{exit_words(signum)}")
            ckpt.saver.give_back_lease()
            ckpt.events.ended("stopped", signal_name(signum))
            if in_thread:
                # the signal is still queued: the handler, run again in the main thread, acts at once
                # (a real signal, so that a sleep or a wait in the main thread ends now)
                signal.pthread_kill(threading.main_thread().ident or 0, signum)
                return
            ckpt.signals.take()
            ckpt.machine.forget_signal()
            ckpt.uninstall_signal_handlers()
            raise_for(signum)
        ckpt.stops.flush_for_notice()
        if due.stop is not None:
            ckpt.machine.feed(bd.Deadline(due.stop))  # the loop stops at its next boundary (nothing new to save)
            ckpt.say(f"saved {where} to {ckpt.url} during a pause of the training loop; the training stops at its "
                     f"next step. Why: {ckpt.messages.stop_words(due.stop)}.")
        else:
            ckpt.say(f"saved {where} to {ckpt.url} during a pause of the training loop ({due.save})")

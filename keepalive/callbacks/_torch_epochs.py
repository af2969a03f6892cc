"""The epoch loop of a plain-PyTorch ``DriveCheckpoint``: ``for epoch in ckpt.epochs(n)``.

:class:`EpochLoop` yields the epochs still to run and ends each at the core (``core.end_epoch``, a
save as configured). Before the loop it compares the code's plan with the loaded checkpoint's (the
number of epochs; a loop left by a ``break`` in an earlier run) and says what wins. A ``break`` out of
the loop (early stopping, told from an interruption by :mod:`keepalive.callbacks._torch_break`) is
saved as the run's end, marked, so that the next run says so instead of training on. Each
``ckpt.epochs()`` loop that ends is a stage of the run: a further one (another optimizer, unfrozen
layers) trains on from there. ``ckpt.iterations(n)`` runs the same loop over iterations (one optimizer
step each), saving every ``"auto"`` interval rather than every iteration.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterator, Optional

from ..autointerval import AutoInterval, expected_uptime
from ..core import Checkpointer
from ..statetree import Captured
from ..trigger import Schedule
from ._torch_break import closed_by_break
from ._torch_data import TrainingData
from ._torch_objects import TorchObjects
from ._torch_passes import Passes

__all__ = ["EpochLoop"]


class EpochLoop:
    """The ``ckpt.epochs()`` loops of one ``DriveCheckpoint`` (the stages of its run)."""

    def __init__(self, core: Checkpointer, objects: TorchObjects, data: TrainingData, passes: Passes,
                 capture: Callable[[], Captured], resume: Callable[[], bool]):
        self.core, self.objects, self.data, self.passes = core, objects, data, passes
        self.capture, self.resume = capture, resume
        self.preview = data.preview
        self.stage = 0                  # ckpt.epochs() loops that ended (stages of the run)
        self.plan_compared = False      # the loaded plan was compared with the code's (once)
        self.left_at: Optional[Dict[str, int]] = None   # a loop left by a break: {"epoch", "of"}
        self.leaving: Optional[Dict[str, int]] = None   # saved with the checkpoint of that break
        #: called once the loop has resumed, before its first epoch (the loop's variables put back)
        self.started: Callable[[], None] = lambda: None
        self.iterating = False          # the loop is ckpt.iterations(): an epoch is one iteration
        self.told_iterations = False    # an epochs() loop of single steps was told about iterations()

    def iterations(self, n: int) -> None:
        """The next loop is ``ckpt.iterations(n)``: with ``every`` left at ``"epoch"``, saves every
        ``"auto"`` interval instead of every iteration (said once)."""
        self.iterating = True
        trigger = self.core.trigger
        if self.core.config.every == "epoch" and trigger.schedule.epoch:
            trigger.schedule = Schedule("auto")
            trigger.auto = AutoInterval(expected_uptime)
            self.core.say(f"ckpt.iterations({n}) saves every 'auto' interval (a save's measured cost against "
                          "the expected time between interruptions), not every iteration; every=N saves every "
                          "N iterations")

    def epochs(self, n: int) -> Iterator[int]:
        """See :meth:`keepalive.callbacks.torch.DriveCheckpoint.epochs`."""
        self.resume()
        self.started()
        core, data = self.core, self.data
        core.total_epochs = n
        core.plan.update(stage=self.stage, epochs=int(n))
        if self._nothing_to_train(n):
            self.stage += 1
            self._loop_ended()
            return
        core.check_storable(self.preview)  # a value that cannot be stored fails now
        core.install_signal_handlers()
        data.in_epochs = True
        data.foreign.install()
        if core.finished:  # a further loop of the run (a stage) after one that ended it
            core.finished = False
        try:
            while core.counters["epoch"] < n:
                core.start_epoch()
                data.begin_epoch()
                steps_before = core.optimizer_steps
                try:
                    yield core.counters["epoch"]
                except GeneratorExit:
                    try:
                        caller: Any = sys._getframe(1)  # the frame that closed this generator
                    except ValueError:  # closed with no Python frame above it (at the interpreter's exit)
                        caller = None
                    if closed_by_break(caller):
                        self._leave(n)
                    raise
                self._tell_iteration_loop(n, core.optimizer_steps - steps_before)
                if not self._end_epoch(n):
                    return
            self.stage += 1
            self._loop_ended()
        finally:
            data.in_epochs = False
            data.foreign.uninstall()
            data.close_loaders()
            core.uninstall_signal_handlers()
            core.flush()

    def _end_epoch(self, n: int) -> bool:
        """The loop body of an epoch ran to its end: end the epoch at the core; False to stop."""
        core, data = self.core, self.data
        data.resume_rng = None  # the resumed epoch's passes are positioned
        if core.stopped:
            return False
        self.passes.claim_unstepped_epoch()
        data.left.clear()
        requested = data.take_request()
        last = core.counters["epoch"] + 1 >= n
        self.objects.check_schedule_end(last)
        return not core.end_epoch(self.capture, last=last, requested=requested).stop

    def _tell_iteration_loop(self, n: int, steps: int) -> None:
        """An ``epochs(n)`` epoch of one optimizer step and no batch loop is an iteration: with
        ``every="epoch"`` every iteration is saved (a training's time doubled). Said once."""
        core = self.core
        if (self.iterating or self.told_iterations or steps != 1 or n < 100 or self.data.batches_done
                or not core.trigger.schedule.epoch):
            return
        self.told_iterations = True
        core.warn(f"ckpt.epochs({n}) runs one optimizer step per epoch and no ckpt.batches() loop: an iteration "
                  "loop, which every='epoch' saves after every iteration (the training may take twice its time). "
                  f"Write `for it in ckpt.iterations({n}):` (saves every 'auto' interval) or give every=N "
                  "(every N iterations).", key="iteration-loop")

    def _loop_ended(self) -> None:
        """This checkpointer's loop ran to its end (or had nothing to train): the run's next loop is
        its next stage."""
        self.core.fit_trained(self.core.plan, self.objects.modules())

    def tell_no_further_stage(self) -> None:
        """A new DriveCheckpoint of a model whose loop on this path ended in this process (one
        checkpointer per stage, as one callback per fit): it resumes the run's newest checkpoint, so a
        stage meant to train on from there would be skipped, or loaded with the last stage's objects.
        Said before anything is loaded."""
        if self.stage or not any(self.core.trained_in_a_fit_here(m) for m in self.objects.modules()):
            return
        self.core.warn(
            f"run '{self.core.store.run}': a ckpt.epochs() loop of this model on this path already ran to its "
            "end in this process, and this new DriveCheckpoint resumes the run (its newest checkpoint): it "
            "does not start a further stage. For a further stage (another optimizer, unfrozen layers), "
            "register the new objects on the first DriveCheckpoint and call its epochs() again "
            "(ckpt.register('opt2', opt2); ckpt.epochs(n), n counting every stage's epochs), or give the "
            "stage its own run (run='stage2').", key="no-further-stage")

    def _nothing_to_train(self, n: int) -> bool:
        """Before a loop: compare the code's plan with the loaded checkpoint's (once, for the loop that
        wrote it) and say what wins; True when the loop has nothing to train (said why)."""
        core = self.core
        saved = core.saved_plan if not self.plan_compared else None  # the plan not compared yet
        if self._left_by_break_before(n) or self._planned_otherwise(n, saved):
            return True
        done = core.counters["epoch"]
        if done >= n:
            later = saved is not None and int(saved.get("stage", 0) or 0) > self.stage
            core.already_complete(n, message=(
                f"ckpt.epochs({n}): run '{core.store.run}' is past this loop ({done} epochs completed, saved in a "
                "later loop of the run): skipped") if later else None)
            return True
        return False

    def _left_by_break_before(self, n: int) -> bool:
        """The run was left by a break at the epoch it is at: its end, unless the code asks for
        another number of epochs now (then it trains on, said)."""
        core = self.core
        done = core.counters["epoch"]
        left, self.left_at = self.left_at or self.data.saved.pop("left_loop", None), None
        if left is None or int(left["epoch"]) != done:
            return False
        before = int(left["of"])
        if before == n or done >= n:
            core.already_complete(n, message=(
                f"the loop was left with a break after {done} of {before} epochs (e.g. early stopping), "
                "and that was saved as the end of the run: nothing to train; the model is the one it left "
                f"with. To train on from epoch {done}, ask for another number of epochs "
                f"(ckpt.epochs(n) with n > {done} and n != {before}), or start a new run."))
            return True
        core.say(f"the loop was left with a break after {done} of {before} epochs; your code now asks for "
                 f"ckpt.epochs({n}): training on from epoch {done}.")
        return False

    def _planned_otherwise(self, n: int, saved: Optional[Dict[str, Any]]) -> bool:
        """The checkpoint's plan ``saved`` (of this stage, compared once) asked for another number of
        epochs: the code's wins, said; True when that leaves nothing to train."""
        core = self.core
        if saved is None or int(saved.get("stage", 0) or 0) != self.stage or "epochs" not in saved:
            return False
        self.plan_compared = True
        done, before = core.counters["epoch"], int(saved["epochs"])
        if before > n and done >= n:
            core.warn(f"epochs {before} -> {n}: this run was planned for {before} epochs (its checkpoint's "
                      f"plan) and has completed {done}; your code's ckpt.epochs({n}) wins: nothing to "
                      f"train. To train the {before - done} epoch(s) left, run ckpt.epochs({before}).",
                      key="plan:epochs")
            core.finished = True
            return True
        if before > n:
            core.warn(f"epochs {before} -> {n}: this run was planned for {before} epochs (its checkpoint's "
                      f"plan); your code's ckpt.epochs({n}) wins: it ends after {n} epochs. To train the "
                      f"{before} planned, run ckpt.epochs({before}).", key="plan:epochs")
        elif before < n:
            core.say(f"epochs {before} -> {n}: the run goes on to {n} epochs (its checkpoint planned {before}).")
        return False

    def _leave(self, n: int) -> None:
        """The loop was left by a ``break`` (early stopping): save that as the end of the run, marked,
        so that the next run says so instead of training on to ``n``."""
        core, data = self.core, self.data
        if core.stopped or core.finished or core.pending_signal is not None or data.in_batch:
            return
        if not data.batches_done and (core.counters["batch"] or data.left):
            # left from inside the batch loop (a `return` out of both loops): no end of the run, the
            # next run continues from the last checkpoint as after any interruption
            return
        count = data.batches_done
        at = core.counters["epoch"] + (1 if count else 0)
        early = at < n  # a break after the last epoch's batches ends the run where it would have ended
        self.leaving = {"epoch": at, "of": int(n)} if early else None
        try:
            core.end_epoch(self.capture, last=True, count=count)
        finally:
            self.leaving = None
        self.stage += 1
        if early:
            self.left_at = {"epoch": at, "of": int(n)}
            core.say(f"left the loop after {at} of {n} epochs (a break): saved as the end of the run")

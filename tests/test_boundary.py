"""The boundary state machine (keepalive/boundary.py) on its own: no I/O, no framework, no clock.

Table-driven cases for each rule of the module docstring (steps are the optimizer's, saves land only
where the state is consistent, a save only when the counters moved, signals, stops, stages, the end
of training, the several-process agreement), then property checks over seeded random event
sequences: counters move only forward (but where an event sets them), the step counter is the sum of
the steps counted, nothing owed is lost, nothing is saved where it cannot be, and the transition is
pure (its input untouched, its output a function of its input).
"""
from __future__ import annotations

import dataclasses
import random
import signal
from typing import List, Optional, Sequence, Tuple

import pytest

from keepalive.boundary import (
    COUNTER_NAMES,
    BatchEnd,
    BoundaryState,
    Counters,
    Deadline,
    Decision,
    Due,
    EpochCounted,
    EpochEnd,
    Finish,
    NewFit,
    OptimizerStep,
    Pending,
    Restored,
    Saved,
    SetCounter,
    Signal,
    StageEnd,
    agreed,
    count,
    signal_name,
    transition,
)

SIGINT = int(signal.SIGINT)
SIGTERM = int(signal.SIGTERM)
NOTHING = Decision()
EVERY = "every 1 steps"
DUE = Due(save=EVERY)


def feed(events: Sequence[object], state: Optional[BoundaryState] = None) -> Tuple[BoundaryState, List[Decision]]:
    """Run ``events`` through the machine from ``state`` (a fresh one by default)."""
    state = BoundaryState() if state is None else state
    decisions = []
    for event in events:
        state, decision = transition(state, event)  # type: ignore[arg-type]
        decisions.append(decision)
    return state, decisions


def steps(n: int, index: int = 0) -> List[OptimizerStep]:
    return [OptimizerStep(index)] * n


def moved() -> BoundaryState:
    """A state whose counters moved since its last save."""
    return feed([BatchEnd(steps=1)])[0]


def unmoved() -> BoundaryState:
    """A state saved at its current counters."""
    return feed([BatchEnd(steps=1), Saved()])[0]


# ------------------------------------------------------------------------------ small pieces
def test_pending_and_decision_truthiness():
    assert not Pending()
    assert Pending(save="x") and Pending(stop="x") and Pending(signal=SIGINT)
    assert not Decision()
    assert not Decision(flush=True, sync=True, reason="x", signal=SIGINT, signal_note="insisted")
    assert Decision(save=True) and Decision(stop=True)


def test_counters_of_and_as_dict():
    assert Counters.of({"epoch": "2", "step": 7.0, "batch": None, "other": 5}) == Counters(epoch=2, step=7)
    assert Counters.of({}) == Counters()
    assert Counters(1, 2, 3, 4).as_dict() == {"epoch": 1, "step": 2, "batch": 3, "samples": 4}
    assert tuple(Counters().as_dict()) == COUNTER_NAMES


def test_state_properties():
    s = BoundaryState()
    assert s.counted_steps == 0 and s.unsaved  # never saved: the first save is always new
    assert BoundaryState(steps_seen=(1, 4, 2)).counted_steps == 4
    assert not BoundaryState(saved_at=Counters()).unsaved
    assert BoundaryState(counters=Counters(samples=1), saved_at=Counters()).unsaved


@pytest.mark.parametrize("signum, name", [
    pytest.param(SIGINT, "SIGINT", id="sigint"),
    pytest.param(SIGTERM, "SIGTERM", id="sigterm"),
    pytest.param(99, "signal 99", id="unknown-number"),
])
def test_signal_name(signum, name):
    assert signal_name(signum) == name


def test_not_an_event_is_a_type_error():
    with pytest.raises(TypeError, match="not a boundary event"):
        transition(BoundaryState(), "BatchEnd")  # type: ignore[arg-type]


def test_states_events_and_decisions_are_frozen():
    for obj, field in [(BoundaryState(), "finished"), (Counters(), "step"), (Pending(), "save"),
                       (Decision(), "save"), (BatchEnd(), "steps"), (Due(), "save")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 1)


# ------------------------------------------------------------------------------ step counting
@pytest.mark.parametrize("events, step", [
    pytest.param([BatchEnd()], 0, id="no-optimizer-step-no-step"),
    pytest.param([OptimizerStep(), BatchEnd()], 1, id="one-optimizer-once"),
    pytest.param([OptimizerStep(0), OptimizerStep(1), BatchEnd()], 1, id="two-optimizers-once-each-one-step"),
    pytest.param(steps(3) + [BatchEnd()], 3, id="one-optimizer-three-times-three-steps"),
    pytest.param([OptimizerStep(0), OptimizerStep(1), OptimizerStep(1), OptimizerStep(0), OptimizerStep(1),
                  BatchEnd()], 3, id="the-most-stepping-optimizer-counts"),
    pytest.param([OptimizerStep(3), BatchEnd()], 1, id="an-index-past-the-others"),
    pytest.param(steps(3) + [BatchEnd(steps=5)], 5, id="explicit-steps-override-counted"),
    pytest.param(steps(3) + [BatchEnd(steps=0), BatchEnd()], 0, id="explicit-steps-clear-counted"),
    pytest.param(steps(2) + [BatchEnd(), BatchEnd()], 2, id="counted-steps-cleared-at-a-boundary"),
    pytest.param(steps(2) + [BatchEnd(grads_pending=True)], 2, id="counted-at-a-grads-pending-batch-end"),
    pytest.param(steps(2) + [BatchEnd(positionable=False)], 2, id="counted-at-a-non-positionable-batch-end"),
    pytest.param([OptimizerStep(), BatchEnd(), OptimizerStep(0), OptimizerStep(1), OptimizerStep(1), BatchEnd(),
                  BatchEnd(steps=2)], 5, id="summed-over-batch-ends"),
    pytest.param(steps(4) + [EpochEnd()], 4, id="epoch-end-counts-the-steps-since-the-last-boundary"),
    pytest.param(steps(2) + [EpochEnd(count=False)], 2, id="uncounted-epoch-end-counts-steps-too"),
    pytest.param(steps(2) + [EpochEnd(last=True)], 2, id="last-epoch-end-counts-steps"),
    pytest.param(steps(2) + [BatchEnd(), OptimizerStep(), EpochEnd()], 3, id="batch-end-then-epoch-end"),
    pytest.param(steps(2) + [EpochCounted(), BatchEnd()], 2, id="epoch-counted-leaves-steps-to-the-next-boundary"),
    pytest.param(steps(2) + [Restored(Counters(step=10)), BatchEnd()], 10, id="restored-drops-steps-seen-before"),
    pytest.param(steps(2) + [Signal(SIGINT), Deadline("x"), Saved(), Finish(), BatchEnd(grads_pending=True)], 2,
                 id="other-events-keep-steps-seen"),
])
def test_steps_are_the_optimizers_steps(events, step):
    state, _ = feed(events)
    assert state.counters.step == step
    assert state.steps_seen == ()


def test_steps_seen_per_optimizer():
    state, decisions = feed([OptimizerStep(0), OptimizerStep(2), OptimizerStep(2)])
    assert state.steps_seen == (1, 0, 2) and state.counted_steps == 2
    assert decisions == [NOTHING] * 3
    assert state.counters == Counters()  # nothing counted before a boundary


def test_stage_end_counts_the_steps_since_the_previous_boundary():
    state, (*_, decision) = feed(steps(2) + [StageEnd()])
    assert decision.save
    assert state.counters.step == 2


# ------------------------------------------------------------------------------ the other counters
@pytest.mark.parametrize("events, counters", [
    pytest.param([BatchEnd(steps=1)], Counters(step=1, batch=1), id="one-step-one-batch"),
    pytest.param([BatchEnd(steps=1), BatchEnd(steps=1, batch=7)], Counters(step=2, batch=7),
                 id="explicit-batch-is-absolute"),
    pytest.param([BatchEnd(steps=1, batch=9), BatchEnd(steps=1, batch=2)], Counters(step=2, batch=2),
                 id="explicit-batch-may-go-back"),
    pytest.param([BatchEnd(steps=1, samples=32), BatchEnd(steps=1, samples=16)], Counters(step=2, batch=2, samples=48),
                 id="samples-add-up"),
    pytest.param([BatchEnd(steps=1, batch=3), EpochEnd()], Counters(epoch=1, step=1),
                 id="epoch-end-counts-and-resets-batch"),
    pytest.param([EpochEnd(), EpochEnd()], Counters(epoch=2), id="epoch-ends-without-batches"),
    pytest.param([EpochEnd(epoch=5)], Counters(epoch=5), id="epoch-end-explicit-epoch"),
    pytest.param([BatchEnd(steps=1, batch=3), EpochEnd(count=False)], Counters(step=1, batch=3),
                 id="epoch-end-count-false-keeps-epoch-and-batch"),
    pytest.param([EpochEnd(count=False, epoch=5)], Counters(), id="epoch-end-count-false-ignores-epoch"),
    pytest.param([BatchEnd(steps=1, batch=3), EpochCounted()], Counters(epoch=1, step=1), id="epoch-counted"),
    pytest.param([BatchEnd(steps=1, batch=3), StageEnd()], Counters(step=1, batch=3), id="stage-end-counts-nothing"),
])
def test_counters(events, counters):
    assert feed(events)[0].counters == counters


@pytest.mark.parametrize("n", [0, 3], ids=["zero-step-batch", "three-step-batch"])
def test_batch_counter_moves_by_the_batch_steps_without_an_explicit_batch(n):
    assert feed([BatchEnd(steps=n)])[0].counters.batch == n


def test_epoch_counted_decides_nothing_and_keeps_what_is_owed():
    start = feed([BatchEnd(steps=1, grads_pending=True, due=DUE), Deadline("x"), Signal(SIGINT)])[0]
    state, decision = transition(start, EpochCounted())
    assert decision == NOTHING
    assert state.pending == start.pending


# ------------------------------------------------------------------------------ saves
@pytest.mark.parametrize("prelude, event, decision, pending", [
    pytest.param([OptimizerStep()], BatchEnd(due=DUE), Decision(save=True, reason=EVERY), Pending(),
                 id="due-save-at-consistent-batch-end-saves"),
    pytest.param([OptimizerStep()], BatchEnd(), NOTHING, Pending(), id="nothing-due-nothing-done"),
    pytest.param([OptimizerStep()], BatchEnd(grads_pending=True, due=DUE), NOTHING, Pending(save=EVERY),
                 id="due-save-with-grads-pending-is-owed"),
    pytest.param([OptimizerStep()], BatchEnd(positionable=False, due=DUE), NOTHING, Pending(save=EVERY),
                 id="due-save-not-positionable-is-owed"),
    pytest.param([OptimizerStep(), BatchEnd(grads_pending=True, due=DUE), OptimizerStep()], BatchEnd(),
                 Decision(save=True, reason=EVERY), Pending(), id="owed-save-paid-at-next-consistent-batch-end"),
    pytest.param([BatchEnd(steps=0, grads_pending=True, due=DUE)], BatchEnd(steps=0),
                 Decision(save=True, reason=EVERY), Pending(), id="owed-save-paid-even-without-a-step"),
    pytest.param([OptimizerStep(), BatchEnd(grads_pending=True, due=DUE)], EpochEnd(),
                 Decision(save=True, reason=EVERY), Pending(), id="owed-save-paid-at-epoch-end"),
    pytest.param([BatchEnd(steps=1, positionable=False, due=DUE), BatchEnd(steps=1, positionable=False)], EpochEnd(),
                 Decision(save=True, reason=EVERY), Pending(), id="not-positionable-owed-until-epoch-end"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=Due(save="every 5 steps"))],
                 BatchEnd(steps=1, grads_pending=True, due=Due(save="every 2s")), NOTHING,
                 Pending(save="every 5 steps"), id="owed-save-keeps-its-first-reason"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=Due(save="every 5 steps"))], BatchEnd(steps=1, due=DUE),
                 Decision(save=True, reason="every 5 steps"), Pending(), id="owed-reason-wins-over-a-new-due"),
    pytest.param([], BatchEnd(steps=1, requested=True), Decision(save=True, reason="by hand"), Pending(),
                 id="requested-saves-by-hand"),
    pytest.param([], BatchEnd(steps=1, grads_pending=True, requested=True), NOTHING, Pending(save="by hand"),
                 id="requested-with-grads-pending-is-owed-by-hand"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=Due(save="every 5 steps"))],
                 BatchEnd(steps=1, grads_pending=True, requested=True), NOTHING, Pending(save="by hand"),
                 id="requested-replaces-an-owed-reason"),
    # as the code is: the schedule's reason of the same batch is kept over "by hand" (both save the same)
    pytest.param([], BatchEnd(steps=1, requested=True, due=DUE), Decision(save=True, reason=EVERY), Pending(),
                 id="requested-and-due-in-one-batch-keep-the-schedules-reason"),
    pytest.param([BatchEnd(steps=1), Saved()], EpochEnd(requested=True), Decision(save=True, reason="by hand"),
                 Pending(), id="requested-at-epoch-end"),
    pytest.param([], EpochEnd(due=Due(save="every epoch")), Decision(save=True, reason="every epoch"), Pending(),
                 id="due-save-at-epoch-end"),
    pytest.param([], BatchEnd(steps=0, due=DUE), Decision(save=True, reason=EVERY), Pending(),
                 id="a-fresh-state-was-never-saved"),
    pytest.param([BatchEnd(steps=1), Saved()], BatchEnd(steps=0, due=DUE), Decision(reason=EVERY), Pending(),
                 id="due-save-with-counters-unmoved-is-not-made"),
    pytest.param([BatchEnd(steps=1), Saved(), BatchEnd(steps=0, grads_pending=True, due=DUE)], BatchEnd(steps=0),
                 Decision(reason=EVERY), Pending(), id="owed-save-with-counters-unmoved-is-answered-without-a-save"),
    pytest.param([Restored(Counters(epoch=2, step=40))], BatchEnd(steps=0, batch=0, due=DUE), Decision(reason=EVERY),
                 Pending(), id="due-save-right-after-restore-is-not-made"),
    pytest.param([BatchEnd(steps=1), Saved()], BatchEnd(steps=0, samples=8, due=DUE),
                 Decision(save=True, reason=EVERY), Pending(), id="samples-alone-move-the-counters"),
    pytest.param([BatchEnd(steps=1, batch=1), Saved()], BatchEnd(steps=0, batch=2, due=DUE),
                 Decision(save=True, reason=EVERY), Pending(), id="an-explicit-batch-alone-moves-the-counters"),
    pytest.param([BatchEnd(steps=1), Saved(), SetCounter("step", 9)], BatchEnd(steps=0, due=DUE),
                 Decision(save=True, reason=EVERY), Pending(), id="a-set-counter-moves-the-counters"),
    pytest.param([EpochEnd(), Saved()], EpochEnd(count=False, due=Due(save="every 2s")), Decision(reason="every 2s"),
                 Pending(), id="uncounted-epoch-end-without-steps-is-not-new"),
    pytest.param([EpochEnd(epoch=3), Saved()], EpochEnd(epoch=3, due=Due(save="every epoch")),
                 Decision(reason="every epoch"), Pending(), id="epoch-end-at-the-same-explicit-epoch-is-not-new"),
])
def test_saves(prelude, event, decision, pending):
    state, _ = feed(prelude)
    state, got = transition(state, event)
    assert got == decision
    assert state.pending == pending
    assert not state.stopped and not state.finished


def test_owed_save_waits_through_unsaveable_batch_ends_until_the_epoch_end():
    state, decisions = feed([BatchEnd(steps=1, positionable=False, due=DUE)]
                            + [BatchEnd(steps=1, positionable=False, due=Due(save="every 2s"))] * 5)
    assert decisions == [NOTHING] * 6
    assert state.pending == Pending(save=EVERY) and state.counters.step == 6
    state, decision = transition(state, EpochEnd())
    assert decision == Decision(save=True, reason=EVERY)
    assert state.pending == Pending()


def test_saved_marks_the_current_counters():
    state, (decision,) = feed([Saved()], moved())
    assert decision == NOTHING
    assert state.saved_at == state.counters and not state.unsaved


# ------------------------------------------------------------------------------ an iteration loop
def test_a_loop_without_batches_saves_at_its_epoch_ends():
    """``for it in ckpt.epochs(n)`` with its own steps: the epoch end is the only boundary, so step-
    and time-based saves come due there, and each epoch end is new even without a batch."""
    state = BoundaryState()
    for epoch in range(1, 4):
        state, decisions = feed(steps(100) + [EpochEnd(due=Due(save="every 100 steps"))], state)
        assert decisions[-1] == Decision(save=True, reason="every 100 steps")
        assert state.counters == Counters(epoch=epoch, step=100 * epoch)
        state = transition(state, Saved())[0]
    for epoch in range(4, 6):  # no step at all: the epoch counter alone makes it new
        state, decision = transition(state, EpochEnd(due=Due(save="every 2s")))
        assert decision == Decision(save=True, reason="every 2s")
        assert state.counters == Counters(epoch=epoch, step=300)
        state = transition(state, Saved())[0]


# ------------------------------------------------------------------------------ stops
STOP = Decision(save=True, sync=True, stop=True, reason="session ends")


@pytest.mark.parametrize("prelude, event, decision, pending, stopped", [
    pytest.param([], BatchEnd(steps=1, due=Due(save="session ends", stop="session ends")), STOP, Pending(), True,
                 id="due-stop-at-consistent-batch-end"),
    pytest.param([], BatchEnd(steps=1, due=Due(stop="session ends")), STOP, Pending(), True,
                 id="due-stop-without-due-save"),
    pytest.param([Deadline("session ends"), OptimizerStep()], BatchEnd(), STOP, Pending(), True,
                 id="deadline-then-consistent-batch-end"),
    pytest.param([], Deadline("session ends"), NOTHING, Pending(stop="session ends"), False,
                 id="deadline-alone-only-owes"),
    pytest.param([Deadline("session ends")], Deadline("preempted"), NOTHING, Pending(stop="session ends"), False,
                 id="deadline-keeps-the-first-reason"),
    pytest.param([Deadline("session ends")], BatchEnd(steps=1, grads_pending=True), NOTHING,
                 Pending(stop="session ends"), False, id="deadline-with-grads-pending-is-owed"),
    pytest.param([Deadline("session ends")], BatchEnd(steps=1, positionable=False), NOTHING,
                 Pending(stop="session ends"), False, id="deadline-not-positionable-is-owed"),
    pytest.param([Deadline("session ends"), BatchEnd(steps=1, positionable=False)], EpochEnd(), STOP, Pending(), True,
                 id="owed-stop-paid-at-epoch-end"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=Due(stop="session ends"))], BatchEnd(steps=1), STOP,
                 Pending(), True, id="owed-due-stop-paid-at-next-consistent-batch-end"),
    pytest.param([], EpochEnd(due=Due(save="session ends", stop="session ends")), STOP, Pending(), True,
                 id="due-stop-at-epoch-end"),
    pytest.param([BatchEnd(steps=1), Saved(), Deadline("session ends")], BatchEnd(steps=0),
                 Decision(flush=True, sync=True, stop=True, reason="session ends"), Pending(), True,
                 id="stop-with-counters-unmoved-flushes"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=DUE), Deadline("session ends")], BatchEnd(steps=1), STOP,
                 Pending(), True, id="stop-pays-an-owed-save-too"),
])
def test_stops(prelude, event, decision, pending, stopped):
    state, _ = feed(prelude)
    state, got = transition(state, event)
    assert got == decision
    assert state.pending == pending
    assert state.stopped is stopped
    assert state.stop_reason == ("session ends" if stopped else None)


# ------------------------------------------------------------------------------ the end of training
END = Decision(save=True, sync=True, finished=True, reason="end of training")


@pytest.mark.parametrize("prelude, event, decision", [
    pytest.param([], EpochEnd(last=True), END, id="fresh"),
    pytest.param(steps(3) + [BatchEnd(), EpochEnd(), Saved()], EpochEnd(last=True, count=False), END,
                 id="saved-even-with-counters-unmoved"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=DUE), Deadline("session ends")], EpochEnd(last=True), END,
                 id="clears-an-owed-save-and-stop"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, requested=True)], EpochEnd(last=True, requested=True), END,
                 id="requested-too"),
    pytest.param([Signal(SIGTERM)], EpochEnd(last=True),
                 dataclasses.replace(END, signal=SIGTERM, signal_note="finished"), id="signal-pending-note-finished"),
    pytest.param([Signal(SIGINT), BatchEnd(steps=1, grads_pending=True)], EpochEnd(last=True, due=Due(stop="x")),
                 dataclasses.replace(END, signal=SIGINT, signal_note="finished"), id="signal-and-due-stop"),
])
def test_last_epoch_end_always_saves_and_finishes(prelude, event, decision):
    state, _ = feed(prelude)
    state, got = transition(state, event)
    assert got == decision
    assert state.pending == Pending()
    assert state.finished and not state.stopped


def test_last_epoch_end_counts_the_epoch():
    assert feed([EpochEnd(last=True, epoch=3)])[0].counters.epoch == 3
    assert feed([EpochEnd(last=True)])[0].counters.epoch == 1


# ------------------------------------------------------------------------------ stages
STAGE = Decision(save=True, sync=True, reason="end of stage")


@pytest.mark.parametrize("prelude, event, decision, finished, stop_reason", [
    pytest.param([], StageEnd(), STAGE, False, None, id="saves-sync"),
    pytest.param(steps(1) + [BatchEnd(), Saved()], StageEnd(), STAGE, False, None,
                 id="saves-even-with-counters-unmoved"),
    pytest.param([], StageEnd(reason="end of fit"), dataclasses.replace(STAGE, reason="end of fit"), False, None,
                 id="its-own-reason"),
    pytest.param([], StageEnd(finished=True), dataclasses.replace(STAGE, finished=True), True, None,
                 id="finished-when-asked"),
    pytest.param([Finish()], StageEnd(), STAGE, True, None, id="a-finished-run-stays-finished"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=DUE)], StageEnd(), STAGE, False, None,
                 id="pays-an-owed-save-with-its-own-reason"),
    pytest.param([Deadline("session ends")], StageEnd(),
                 Decision(save=True, sync=True, stop=True, reason="session ends"), False, "session ends",
                 id="uses-an-owed-stop"),
    pytest.param([], StageEnd(due=Due(stop="next stage does not fit")),
                 Decision(save=True, sync=True, stop=True, reason="next stage does not fit"), False,
                 "next stage does not fit", id="due-stop"),
    pytest.param([Deadline("session ends")], StageEnd(due=Due(stop="next stage does not fit")),
                 Decision(save=True, sync=True, stop=True, reason="next stage does not fit"), False,
                 "next stage does not fit", id="due-stop-over-an-owed-one"),
    pytest.param([Deadline("session ends")], StageEnd(finished=True),
                 Decision(save=True, sync=True, stop=True, finished=True, reason="session ends"), True,
                 "session ends", id="stop-and-finished"),
    pytest.param([Signal(SIGINT)], StageEnd(), dataclasses.replace(STAGE, signal=SIGINT, signal_note="saved"), False,
                 None, id="pays-a-signal"),
    pytest.param([Deadline("session ends"), Signal(SIGTERM)], StageEnd(),
                 Decision(save=True, sync=True, stop=True, reason="end of stage", signal=SIGTERM, signal_note="saved"),
                 False, "session ends", id="signal-and-stop"),
])
def test_stage_end(prelude, event, decision, finished, stop_reason):
    state, _ = feed(prelude)
    state, got = transition(state, event)
    assert got == decision
    assert state.pending == Pending() and state.steps_seen == ()
    assert state.finished is finished
    assert state.stopped is (stop_reason is not None)
    assert state.stop_reason == stop_reason


def test_stage_end_keeps_an_earlier_stop():
    state, _ = feed([Deadline("session ends"), BatchEnd(steps=1)])
    assert state.stopped
    state, decision = transition(state, StageEnd())
    assert decision == STAGE
    assert state.stopped and state.stop_reason == "session ends"


# ------------------------------------------------------------------------------ signals
def saved_signal(signum: int, *, save: bool = True) -> Decision:
    return Decision(save=save, sync=True, flush=not save, reason=f"{signal_name(signum)} received", signal=signum,
                    signal_note="saved")


@pytest.mark.parametrize("prelude, event, decision, pending", [
    pytest.param([], Signal(SIGINT), Decision(signal_note="received"), Pending(signal=SIGINT), id="once-is-noted"),
    pytest.param([Signal(SIGINT), OptimizerStep()], BatchEnd(), saved_signal(SIGINT), Pending(),
                 id="paid-at-the-next-consistent-batch-end"),
    pytest.param([BatchEnd(steps=1), Saved(), Signal(SIGTERM)], BatchEnd(steps=0), saved_signal(SIGTERM, save=False),
                 Pending(), id="paid-with-a-flush-when-counters-unmoved"),
    pytest.param([Signal(SIGINT)], BatchEnd(steps=1, grads_pending=True), NOTHING, Pending(signal=SIGINT),
                 id="owed-through-grads-pending"),
    pytest.param([Signal(SIGINT), BatchEnd(steps=1, grads_pending=True)], EpochEnd(), saved_signal(SIGINT),
                 Pending(), id="paid-at-epoch-end"),
    pytest.param([Signal(SIGINT)], Signal(SIGTERM), Decision(signal=SIGTERM, signal_note="insisted"), Pending(),
                 id="twice-insisted-at-once"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=DUE), Deadline("x"), Signal(SIGINT)], Signal(SIGINT),
                 Decision(signal=SIGINT, signal_note="insisted"), Pending(save=EVERY, stop="x"),
                 id="twice-keeps-the-rest-owed"),
    pytest.param([Signal(SIGINT), BatchEnd(steps=1)], Signal(SIGINT), Decision(signal_note="received"),
                 Pending(signal=SIGINT), id="again-after-it-was-paid-is-a-first-one"),
    pytest.param([Signal(SIGINT)], BatchEnd(steps=1, positionable=False),
                 Decision(signal=SIGINT, signal_note="unsaveable"), Pending(), id="not-positionable-unsaveable"),
    pytest.param([Signal(SIGINT)], BatchEnd(steps=1, positionable=False, grads_pending=True),
                 Decision(signal=SIGINT, signal_note="unsaveable"), Pending(),
                 id="not-positionable-with-grads-pending-unsaveable"),
    pytest.param([Signal(SIGINT), Deadline("x")], BatchEnd(steps=1, positionable=False, due=DUE),
                 Decision(signal=SIGINT, signal_note="unsaveable"), Pending(save=EVERY, stop="x"),
                 id="unsaveable-keeps-the-rest-owed"),
    pytest.param([BatchEnd(steps=1, grads_pending=True, due=DUE), Signal(SIGINT)], BatchEnd(steps=1),
                 saved_signal(SIGINT), Pending(), id="pays-an-owed-save-too"),
    pytest.param([Deadline("session ends"), Signal(SIGINT)], BatchEnd(steps=1), saved_signal(SIGINT), Pending(),
                 id="comes-before-an-owed-stop"),
    pytest.param([Signal(99)], BatchEnd(steps=1),
                 Decision(save=True, sync=True, reason="signal 99 received", signal=99, signal_note="saved"),
                 Pending(), id="an-unnamed-signal"),
])
def test_signals(prelude, event, decision, pending):
    state, _ = feed(prelude)
    state, got = transition(state, event)
    assert got == decision
    assert state.pending == pending
    assert not got.save or got.signal_note in ("", "saved", "finished")


# ------------------------------------------------------------------------------ fits, restores, counters
def test_new_fit_starts_over():
    state, _ = feed([BatchEnd(steps=5, samples=10), EpochEnd(), BatchEnd(steps=1), Saved(), Deadline("x"),
                     BatchEnd(steps=1), EpochEnd(last=True), Signal(SIGINT), OptimizerStep()])
    assert state.stopped and state.finished
    new, decision = transition(state, NewFit())
    assert decision == NOTHING
    assert new.counters == Counters()
    assert not new.finished and not new.stopped and new.stop_reason is None
    assert new.saved_at == state.saved_at and new.pending == state.pending and new.steps_seen == state.steps_seen


def test_new_fit_keeping_counters_resets_only_the_batch():
    state, _ = feed([BatchEnd(steps=5, samples=10), EpochEnd(), BatchEnd(steps=3, batch=3), Deadline("x"),
                     BatchEnd(steps=1, batch=4), Finish()])
    assert state.stopped and state.finished and state.counters.batch == 4
    new, decision = transition(state, NewFit(keep_counters=True))
    assert decision == NOTHING
    assert new.counters == dataclasses.replace(state.counters, batch=0)
    assert not new.finished and not new.stopped and new.stop_reason is None


@pytest.mark.parametrize("value", [True, False], ids=["finished", "not-finished"])
def test_finish(value):
    state, (decision,) = feed([Finish(value)], BoundaryState(finished=not value))
    assert decision == NOTHING and state.finished is value


@pytest.mark.parametrize("name", COUNTER_NAMES)
def test_set_counter(name):
    start = feed([BatchEnd(steps=2, samples=4), EpochEnd(), BatchEnd(steps=1), Saved()])[0]
    state, decision = transition(start, SetCounter(name, 42.0))  # type: ignore[arg-type]
    assert decision == NOTHING
    assert state.counters == dataclasses.replace(start.counters, **{name: 42})
    assert type(getattr(state.counters, name)) is int
    assert state.saved_at == start.saved_at and state.unsaved


def test_set_counter_unknown_name():
    with pytest.raises(KeyError, match="epochs"):
        transition(BoundaryState(), SetCounter("epochs", 1))


def test_restored_sets_counters_and_saved_at():
    start = feed(steps(3) + [Deadline("x"), Signal(SIGINT)])[0]
    c = Counters(epoch=2, step=40, batch=5, samples=640)
    state, decision = transition(start, Restored(c))
    assert decision == NOTHING
    assert state.counters == c and state.saved_at == c and not state.unsaved
    assert state.steps_seen == ()
    assert state.pending == start.pending  # what is owed still is


# ------------------------------------------------------------------------------ several processes
WHY = "another rank stops before the session ends"
OWN_SAVE = Decision(save=True, reason=EVERY)
OWN_STOP = Decision(save=True, sync=True, stop=True, reason="session ends")


@pytest.mark.parametrize("state, decision, others, expected, stopped", [
    pytest.param(moved, NOTHING, {}, NOTHING, False, id="nobody-asks-anything"),
    pytest.param(moved, OWN_SAVE, {"save": True}, OWN_SAVE, False, id="own-save-kept"),
    pytest.param(moved, NOTHING, {"save": True}, Decision(save=True, reason="a save came due on another rank"), False,
                 id="another-ranks-save-saves-here"),
    pytest.param(unmoved, NOTHING, {"save": True}, NOTHING, False, id="another-ranks-save-counters-unmoved"),
    pytest.param(unmoved, Decision(reason=EVERY), {"save": True}, Decision(reason=EVERY), False,
                 id="another-ranks-save-own-unmade-save"),
    pytest.param(moved, NOTHING, {"stop": True}, Decision(save=True, sync=True, stop=True, reason=WHY), True,
                 id="another-ranks-stop-stops-here"),
    pytest.param(unmoved, NOTHING, {"stop": True}, Decision(flush=True, sync=True, stop=True, reason=WHY), True,
                 id="another-ranks-stop-counters-unmoved-flushes"),
    pytest.param(moved, OWN_SAVE, {"save": True, "stop": True}, Decision(save=True, sync=True, stop=True, reason=WHY),
                 True, id="another-ranks-stop-over-own-save"),
    pytest.param(moved, OWN_STOP, {"save": True, "stop": True}, OWN_STOP, False, id="own-stop-kept"),
    pytest.param(moved, NOTHING, {"signal": SIGTERM}, saved_signal(SIGTERM), False, id="another-ranks-signal"),
    pytest.param(unmoved, NOTHING, {"signal": SIGTERM}, saved_signal(SIGTERM, save=False), False,
                 id="another-ranks-signal-counters-unmoved-flushes"),
    pytest.param(moved, NOTHING, {"save": True, "stop": True, "signal": SIGINT}, saved_signal(SIGINT), False,
                 id="another-ranks-signal-over-its-stop"),
    pytest.param(moved, saved_signal(SIGINT), {"signal": SIGINT}, saved_signal(SIGINT), False, id="own-signal-kept"),
    pytest.param(moved, saved_signal(SIGINT), {"signal": SIGTERM}, saved_signal(SIGINT), False,
                 id="own-signal-over-another-ranks"),
])
def test_agreed(state, decision, others, expected, stopped):
    start = state()
    kw = {"save": False, "stop": False, "signal": None, **others}
    new, got = agreed(start, decision, **kw)
    assert got == expected
    assert new.stopped is stopped
    assert new.stop_reason == (WHY if stopped else None)
    assert new.counters == start.counters and new.pending == start.pending and new.saved_at == start.saved_at


def test_agreed_another_ranks_signal_over_own_stop():
    state, decision = transition(moved(), Deadline("session ends"))
    state, decision = transition(state, BatchEnd(steps=1))
    assert decision == OWN_STOP
    _, got = agreed(state, decision, save=True, stop=True, signal=SIGTERM)
    assert got.signal == SIGTERM and got.signal_note == "saved" and got.save and got.sync


def test_agreed_keeps_finished():
    _, got = agreed(moved(), Decision(save=True, sync=True, finished=True, reason="x"), save=False, stop=True,
                    signal=None)
    assert got.stop and got.finished


def test_agreed_keeps_own_signal_when_another_rank_stops():
    state, decision = feed([Signal(SIGINT), BatchEnd(steps=1)])
    decision = decision[-1]
    assert decision == saved_signal(SIGINT) and state.pending == Pending()
    _, got = agreed(state, decision, save=True, stop=True, signal=SIGINT)
    assert got.signal == SIGINT and got.signal_note == "saved"


# ------------------------------------------------------------------------------ properties
REASONS = ("every 3 steps", "every 2s", "every epoch")
STOPS = ("session ends", "preempted")
KINDS = ("step", "batch", "epoch", "counted", "stage", "signal", "deadline", "saved", "restored", "newfit", "finish",
         "set")
WEIGHTS = (30, 30, 6, 2, 2, 3, 2, 8, 1, 1, 1, 1)


def random_due(rng: random.Random) -> Due:
    r = rng.random()
    if r < 0.6:
        return Due()
    if r < 0.85:
        return Due(save=rng.choice(REASONS))
    reason = rng.choice(STOPS)
    return Due(save=reason if rng.random() < 0.5 else None, stop=reason)


def random_event(rng: random.Random, state: BoundaryState):
    kind = rng.choices(KINDS, WEIGHTS)[0]
    if kind == "stage" and state.steps_seen:
        kind = "batch"  # the step model of these sequences counts steps at batch and epoch ends only
    c = state.counters
    if kind == "step":
        return OptimizerStep(rng.choice((0, 0, 0, 1, 2)))
    if kind == "batch":
        return BatchEnd(steps=None if rng.random() < 0.6 else rng.randint(0, 3),
                        batch=None if rng.random() < 0.7 else rng.randint(0, 20),
                        samples=rng.choice((0, 0, 8, 32)), positionable=rng.random() < 0.8,
                        grads_pending=rng.random() < 0.25, requested=rng.random() < 0.05, due=random_due(rng))
    if kind == "epoch":
        return EpochEnd(epoch=None if rng.random() < 0.7 else c.epoch + rng.randint(0, 2), last=rng.random() < 0.1,
                        count=rng.random() < 0.9, requested=rng.random() < 0.1, due=random_due(rng))
    if kind == "counted":
        return EpochCounted()
    if kind == "stage":
        return StageEnd(reason=rng.choice(("end of stage", "end of fit")), finished=rng.random() < 0.3,
                        due=Due(stop=rng.choice(STOPS)) if rng.random() < 0.2 else Due())
    if kind == "signal":
        return Signal(rng.choice((SIGINT, SIGTERM)))
    if kind == "deadline":
        return Deadline(rng.choice(STOPS))
    if kind == "saved":
        return Saved()
    if kind == "restored":
        return Restored(Counters(*(rng.randint(0, 50) for _ in COUNTER_NAMES)))
    if kind == "newfit":
        return NewFit(keep_counters=rng.random() < 0.5)
    if kind == "finish":
        return Finish(rng.random() < 0.5)
    return SetCounter(rng.choice(COUNTER_NAMES), rng.randint(0, 100))


class StepModel:
    """The step and sample counters as the rules say, kept apart from the machine."""

    def __init__(self) -> None:
        self.step = self.samples = 0
        self.seen: dict = {}

    def feed(self, ev) -> None:
        if isinstance(ev, OptimizerStep):
            self.seen[ev.index] = self.seen.get(ev.index, 0) + 1
        elif isinstance(ev, (BatchEnd, EpochEnd, StageEnd)):
            explicit = ev.steps if isinstance(ev, BatchEnd) else None
            self.step += max(self.seen.values(), default=0) if explicit is None else explicit
            self.samples += ev.samples if isinstance(ev, BatchEnd) else 0
            self.seen = {}
        elif isinstance(ev, Restored):
            self.step, self.samples, self.seen = ev.counters.step, ev.counters.samples, {}
        elif isinstance(ev, NewFit) and not ev.keep_counters:
            self.step = self.samples = 0
        elif isinstance(ev, SetCounter) and ev.name in ("step", "samples"):
            setattr(self, ev.name, ev.value)


def consistent(ev) -> bool:
    return (isinstance(ev, BatchEnd) and ev.positionable and not ev.grads_pending) or \
        (isinstance(ev, EpochEnd) and not ev.last)


def check_transition(p: BoundaryState, ev, n: BoundaryState, d: Decision) -> None:
    """The invariants of one step ``p --ev--> n`` answered by ``d``."""
    pp, np_ = p.pending, n.pending
    # counters move only forward, but where an event sets them
    if not isinstance(ev, (NewFit, Restored, SetCounter)):
        assert n.counters.step >= p.counters.step and n.counters.samples >= p.counters.samples
        assert n.counters.epoch >= p.counters.epoch  # (the generator gives no explicit epoch below the current)
        if not (isinstance(ev, (EpochCounted, EpochEnd)) or (isinstance(ev, BatchEnd) and ev.batch is not None)):
            assert n.counters.batch >= p.counters.batch
    if isinstance(ev, NewFit) and ev.keep_counters:
        assert n.counters == dataclasses.replace(p.counters, batch=0)
    # only boundaries decide; nothing else touches what is owed (but a deadline, which adds a stop)
    if not isinstance(ev, (BatchEnd, EpochEnd, StageEnd, Signal)):
        assert d == NOTHING
        expected = dataclasses.replace(pp, stop=pp.stop or ev.reason) if isinstance(ev, Deadline) else pp
        assert np_ == expected
    # saves land only where the state is consistent; never with an unsaveable signal
    if d.save or d.flush or d.stop:
        assert consistent(ev) or isinstance(ev, (EpochEnd, StageEnd))
    assert not (d.save and d.signal_note == "unsaveable")
    if isinstance(ev, BatchEnd) and not consistent(ev):
        assert not (d.save or d.flush or d.stop)
        if d.signal is not None:
            assert d.signal_note == "unsaveable" and not ev.positionable and d.signal == pp.signal
        # what comes due here is owed
        assert np_.save == pp.save or np_.save in (ev.due.save, "by hand")
        assert (np_.save is not None) == (pp.save is not None or ev.requested or ev.due.save is not None)
        assert np_.stop == (ev.due.stop or pp.stop)
    if consistent(ev):
        assert not np_  # a consistent boundary pays everything
    # a save only where the counters moved, unless it ends the training or a stage
    if d.save and not isinstance(ev, StageEnd) and not (isinstance(ev, EpochEnd) and ev.last):
        assert p.saved_at != n.counters
    if d.flush:
        assert not d.save and d.sync and n.saved_at == n.counters
    # nothing owed is lost: whatever left the pending set was answered by this decision
    if pp.signal is not None and np_.signal is None:
        assert d.signal is not None
        if d.signal_note != "insisted":
            assert d.signal == pp.signal and d.signal_note in ("saved", "finished", "unsaveable")
            assert d.signal_note == "unsaveable" or d.save or d.flush
    if pp.stop is not None and np_.stop is None:
        assert d.stop or d.signal is not None or d.finished
    if pp.save is not None and np_.save is None:
        assert d.save or d.flush or n.saved_at == n.counters
    # ... and what came due at a consistent boundary too
    due = getattr(ev, "due", Due())
    if consistent(ev) and (due.save or getattr(ev, "requested", False)):
        assert d.save or d.flush or n.saved_at == n.counters
    if consistent(ev) and due.stop:
        assert d.stop or d.signal is not None
    # signals
    if isinstance(ev, Signal):
        if pp.signal is None:
            assert d == Decision(signal_note="received") and np_.signal == ev.signum
        else:
            assert d == Decision(signal=ev.signum, signal_note="insisted") and np_.signal is None
    if d.signal is not None and d.signal_note not in ("insisted", "unsaveable"):
        assert d.sync and (d.save or d.flush)
    # stops and ends
    if d.stop:
        assert d.sync and (d.save or d.flush) and n.stopped and n.stop_reason
    if p.stopped and not isinstance(ev, NewFit):
        assert n.stopped
    if isinstance(ev, EpochEnd) and ev.last:
        assert d.save and d.sync and d.finished and n.finished and not np_
    if isinstance(ev, StageEnd):
        assert d.save and d.sync and d.finished is ev.finished and not np_
        assert n.finished is (p.finished or ev.finished)
    if d.finished:
        assert n.finished


def snapshot(obj) -> dict:
    """A copy of a state's or a decision's fields, nested ones too (cheaper than dataclasses.astuple)."""
    return {k: snapshot(v) if hasattr(v, "__dataclass_fields__") else v for k, v in vars(obj).items()}


def check_agreed(state: BoundaryState, d: Decision, save: bool, stop: bool, signum: Optional[int]) -> BoundaryState:
    before = snapshot(state), snapshot(d)
    new, got = agreed(state, d, save=save, stop=stop, signal=signum)
    assert (new, got) == agreed(state, d, save=save, stop=stop, signal=signum)
    assert (snapshot(state), snapshot(d)) == before
    assert new.counters == state.counters and new.pending == state.pending and new.saved_at == state.saved_at
    if not (save or stop or signum is not None):
        assert (new, got) == (state, d)
    if signum is not None and d.signal is None:  # a signal that reached another rank acts here
        assert got.signal == signum and got.signal_note == "saved" and got.sync and (got.save or got.flush)
    if stop and not d.stop and signum is None and d.signal is None:
        assert got.stop and got.sync and (got.save or got.flush) and new.stopped
    if save and state.unsaved:
        assert got.save
    if got.save and not d.save:
        assert state.unsaved
    assert got.finished == d.finished
    return new


SEQUENCES_PER_SEED = 25


@pytest.mark.parametrize("seed", range(12))
def test_random_event_sequences(seed):
    """Several hundred seeded sequences (12 x 25, up to 80 events each), every step checked."""
    rng = random.Random(seed)
    for _ in range(SEQUENCES_PER_SEED):
        state, model = BoundaryState(), StepModel()
        for _ in range(rng.randint(1, 80)):
            ev = random_event(rng, state)
            before = snapshot(state)
            new, decision = transition(state, ev)
            assert snapshot(state) == before  # the input state is untouched
            assert transition(state, ev) == (new, decision)  # a function of its inputs
            check_transition(state, ev, new, decision)
            model.feed(ev)
            assert (new.counters.step, new.counters.samples) == (model.step, model.samples)
            assert new.steps_seen == tuple(model.seen.get(i, 0) for i in range(len(new.steps_seen)))
            assert new.counted_steps == max(model.seen.values(), default=0)
            if consistent(ev) and rng.random() < 0.5:  # several processes: combine with the others' wishes
                agreed_state = check_agreed(new, decision, rng.random() < 0.3, rng.random() < 0.15,
                                            rng.choice((None, None, None, SIGINT, SIGTERM)))
                if rng.random() < 0.5:
                    new = agreed_state
            state = new


def test_random_sequences_reach_every_decision():
    """The generator is not degenerate: the property test sees every kind of decision."""
    rng = random.Random(1234)
    notes, kinds = set(), set()
    for _ in range(40):
        state = BoundaryState()
        for _ in range(80):
            state, d = transition(state, random_event(rng, state))
            notes.add(d.signal_note)
            kinds.update(k for k in ("save", "flush", "stop", "finished") if getattr(d, k))
            if d.save and not d.sync:
                kinds.add("async save")
    assert notes == {"", "received", "saved", "insisted", "unsaveable", "finished"}
    assert kinds == {"save", "flush", "stop", "finished", "async save"}


def test_count_moves_the_counters_first_and_the_rest_of_the_event_acts_without_counting_again():
    start = feed([OptimizerStep(), OptimizerStep(1), OptimizerStep(1)])[0]
    event = BatchEnd(samples=4, due=Due(save="every 2 steps"))
    counted, rest = count(start, event)
    assert counted.counters.step == 2 and counted.counters.samples == 4 and counted.steps_seen == ()
    assert counted.pending == start.pending  # nothing owed, nothing paid yet
    whole = transition(start, event)
    assert transition(counted, rest) == whole  # the two halves are the whole
    ended, rest = count(whole[0], EpochEnd(due=Due(save="end of epoch")))
    assert ended.counters.epoch == 1 and ended.counters.batch == 0
    assert transition(ended, rest)[0].counters == ended.counters

"""The schedule (``every=``) and the deadline prediction, on a fake clock: what is due at a boundary."""
from __future__ import annotations

import pytest

from keepalive.boundary import Due
from keepalive.trigger import SaveTrigger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_n_steps_counts_optimizer_steps_not_boundaries():
    t = SaveTrigger(3, clock=Clock(), remaining_fn=lambda: None)
    answers = [t.after_step(n) for n in (1, 0, 1, 0, 1)]
    assert [a.save for a in answers] == [None, None, None, None, "every 3 steps"]
    t.saved()
    assert t.after_step(2) == Due() and t.after_step(1) == Due(save="every 3 steps")


def test_a_duration_is_due_after_that_time_since_the_last_save():
    clock = Clock()
    t = SaveTrigger("2s", clock=clock, remaining_fn=lambda: None)
    clock.now = 1.0
    assert t.after_step() == Due()
    clock.now = 2.5
    assert t.after_step() == Due(save="every 2s")
    t.saved()
    clock.now = 3.0
    assert t.after_epoch() == Due()


def test_epoch_schedule_is_due_at_epoch_ends_only():
    t = SaveTrigger("epoch", clock=Clock(), remaining_fn=lambda: None)
    assert t.after_step() == Due()
    assert t.after_epoch() == Due(save="end of epoch")


@pytest.mark.parametrize("on_deadline, stops", [("save_and_stop", True), ("save", False)])
def test_the_deadline_saves_and_stops_when_the_next_chance_would_come_too_late(on_deadline, stops):
    clock, left = Clock(), [3600.0]
    t = SaveTrigger(100, clock=clock, remaining_fn=lambda: left[0], on_deadline=on_deadline, margin=30)
    t.mid_epoch = True
    t.start_epoch()
    for _ in range(3):
        clock.now += 10.0
        assert t.after_step() == Due()
    left[0] = 45.0  # the next step is 10 s away, the margin 30 s: still in time
    clock.now += 10.0
    assert t.after_step() == Due()
    left[0] = 35.0  # now it would land inside the margin
    clock.now += 10.0
    due = t.after_step()
    assert due.save and due.save.startswith("deadline: the session ends in")
    assert (due.stop == due.save) if stops else due.stop is None
    clock.now += 10.0
    assert t.after_step() == Due()  # said once


def test_without_mid_epoch_saves_the_deadline_is_decided_at_epoch_ends():
    clock = Clock()
    t = SaveTrigger("epoch", clock=clock, remaining_fn=lambda: 50.0, margin=30)
    t.start_epoch()
    clock.now = 40.0
    assert t.after_step() == Due()  # nothing can be saved here: no decision
    due = t.after_epoch()  # the next epoch (40 s) would end past the deadline
    assert due.stop and due.save == due.stop


def test_answers_combine():
    assert (Due(save="a") | Due(save="b", stop="s")) == Due(save="a", stop="s")


@pytest.mark.parametrize("text", ["auto", "AUTO", " auto "])
def test_every_auto_is_a_schedule_of_its_own(text):
    from keepalive.autointerval import Uptime
    from keepalive.trigger import Schedule

    s = Schedule(text)
    assert s.auto and not s.epoch and s.steps is None and s.seconds is None
    t = SaveTrigger(text, clock=Clock(), remaining_fn=lambda: None, uptime_fn=lambda: Uptime(3600.0, "test"))
    assert t.auto_state()["interval_seconds"] == 300.0 and not t.auto_state()["measured"]
    with pytest.raises(ValueError, match="not a duration"):
        Schedule("automatic")


def test_with_every_auto_the_deadline_still_saves_and_stops_in_time():
    from keepalive.autointerval import Uptime

    clock, left = Clock(), [3600.0]
    t = SaveTrigger("auto", clock=clock, remaining_fn=lambda: left[0], margin=30,
                    uptime_fn=lambda: Uptime(3600.0, "test"))
    t.mid_epoch = True
    t.start_epoch()
    for _ in range(3):
        clock.now += 10.0
        assert t.after_step() == Due()
    left[0] = 35.0
    clock.now += 10.0
    due = t.after_step()
    assert due.save and due.save.startswith("deadline: the session ends in") and due.stop == due.save

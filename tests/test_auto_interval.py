"""``every="auto"``: the interval between saves from measured save costs and the expected time between
interruptions (Young/Daly, at most 1 % of the training time), on a fake clock; then one real torch loop."""
from __future__ import annotations

import math
import re
from typing import List, Optional

import pytest

from keepalive import autointerval
from keepalive.autointerval import BUDGET, FIRST_SAVE_SECONDS, MIN_INTERVAL_SECONDS, Uptime, young_daly
from keepalive.trigger import SaveTrigger
from keepalive.units import format_duration

HOURS = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Loop:
    """Drives a trigger as the core does: a step boundary every ``step`` seconds; a due save stalls the
    loop ``stall`` seconds, then its write runs ``write`` seconds in the background, during which each
    step takes ``slow`` seconds instead (the write competes with the training)."""

    def __init__(self, mtbf: float = 3 * HOURS, **kw):
        self.clock = Clock()
        self.trigger = SaveTrigger("auto", clock=self.clock, remaining_fn=lambda: None,
                                   uptime_fn=lambda: Uptime(mtbf, "test"), **kw)
        self.trigger.mid_epoch = True
        self.saves: List[float] = []
        self.news: List[str] = []
        self.stalled = 0.0
        self._write_ends: Optional[float] = None

    def run(self, seconds: float, step: float, stall: float = 0.0, write: float = 0.0,
            slow: Optional[float] = None) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += (slow or step) if self._write_ends is not None else step
            if self._write_ends is not None and self.clock.now >= self._write_ends:
                self.trigger.record_save(write)  # the writer's thread: the write is durable
                self._write_ends = None
            due = self.trigger.after_step()
            news = self.trigger.take_news()
            if news:
                self.news.append(news)
            if due.save:
                self.clock.now += stall
                self.stalled += stall
                self.trigger.record_stall(stall)
                self.trigger.saved()
                self.saves.append(self.clock.now)
                self._write_ends = self.clock.now + write

    def gaps(self, last: int = 3) -> List[float]:
        return [b - a for a, b in zip(self.saves, self.saves[1:])][-last:]


def test_before_anything_is_measured_the_first_save_comes_after_five_minutes_or_at_the_first_epoch_end():
    loop = Loop()
    loop.run(FIRST_SAVE_SECONDS - 1, step=0.5)
    assert loop.saves == [] and loop.trigger.auto_state()["limited_by"] == "first save"
    loop.run(2, step=0.5)
    assert len(loop.saves) == 1 and loop.trigger.after_step().save is None

    clock = Clock()
    t = SaveTrigger("auto", clock=clock, remaining_fn=lambda: None, uptime_fn=lambda: Uptime(HOURS, "test"))
    t.start_epoch()
    clock.now = 10.0
    assert t.after_step().save is None
    assert t.after_epoch().save == "end of the first epoch (auto: measures a save's cost)"


def test_the_interval_follows_young_daly_sqrt_2_mtbf_cost():
    loop = Loop(mtbf=3 * HOURS)
    loop.run(3000, step=0.1, stall=0.5)  # a write that costs the steps nothing: C = the stall
    expected = math.sqrt(2 * 3 * HOURS * 0.5)  # 104 s
    state = loop.trigger.auto_state()
    assert state["interval_seconds"] == pytest.approx(expected)
    assert state["young_daly_seconds"] == pytest.approx(expected) and state["limited_by"] == "Young/Daly"
    assert state["write_seconds"] == pytest.approx(0.0, abs=1e-9)
    # from one save's end to the next one's: the interval, the next boundary and the stall
    assert all(g == pytest.approx(expected + 0.5, abs=0.15) for g in loop.gaps())
    assert state["cost_fraction"] == pytest.approx(0.5 / expected)
    assert state["mtbf_seconds"] == 3 * HOURS and state["mtbf_source"] == "test"


def test_the_background_writes_cost_to_the_steps_counts_in_the_cost():
    loop = Loop(mtbf=3 * HOURS)
    # a 2 s write during which a 0.1 s step takes 0.15 s: 14 slow steps cost 0.7 s besides the stall
    loop.run(3000, step=0.1, stall=0.2, write=2.0, slow=0.15)
    state = loop.trigger.auto_state()
    assert state["write_seconds"] == pytest.approx(0.7, abs=0.06)
    assert state["interval_seconds"] == pytest.approx(young_daly(3 * HOURS, 0.2 + state["write_seconds"]))


def test_never_more_often_than_the_1_percent_budget_allows():
    # a save costing 3 s on a platform interrupted every 1 h: Young/Daly says 147 s = 2 % of the time
    loop = Loop(mtbf=HOURS)
    loop.run(20000, step=0.2, stall=3.0)
    state = loop.trigger.auto_state()
    assert young_daly(HOURS, 3.0) < 3.0 / BUDGET
    assert state["limited_by"] == "1 % budget" and state["interval_seconds"] == pytest.approx(300.0)
    assert state["cost_fraction"] == pytest.approx(BUDGET)
    later = [s for s in loop.saves if s > 2000]  # after the first (unmeasured) save
    assert 3.0 * len(later) / (20000 - 2000) <= BUDGET * 1.01
    # nearly free saves: at least a minute apart
    cheap = Loop(mtbf=HOURS)
    cheap.run(1000, step=0.1, stall=0.001)
    assert cheap.trigger.auto_state()["interval_seconds"] == MIN_INTERVAL_SECONDS
    assert cheap.trigger.auto_state()["limited_by"] == "minimum"


def test_it_adapts_when_the_save_and_step_times_change_and_says_so_again_only_after_a_large_change():
    loop = Loop(mtbf=3 * HOURS)
    loop.run(2000, step=0.1, stall=0.5)
    first = loop.trigger.auto_state()["interval_seconds"]
    assert loop.news == [
        "auto: every 1 min 44 s (Young/Daly for an interruption every ~3 h 00 min); a save stalls 0.50 s "
        "and its background write costs 0 ms = 0.48 % of the training"]
    loop.run(2000, step=0.1, stall=0.7)  # 1.4x the cost, 1.18x the interval: not said again
    assert len(loop.news) == 1
    assert loop.trigger.auto_state()["interval_seconds"] == pytest.approx(young_daly(3 * HOURS, 0.7), rel=0.02)
    # the model grew: the stall is 4 s and the write slows the (now slower) steps by half for 5 s
    loop.run(12000, step=0.3, stall=4.0, write=5.0, slow=0.45)
    state = loop.trigger.auto_state()
    assert state["stall_seconds"] == pytest.approx(4.0, rel=0.01)
    assert state["write_seconds"] == pytest.approx(1.8, abs=0.2)  # 12 steps (5 s / 0.45 s) slower by 0.15 s
    assert state["interval_seconds"] > 2 * first
    assert len(loop.news) == 2 and loop.news[1].startswith("auto: now every ")
    assert loop.gaps()[-1] == pytest.approx(state["interval_seconds"] + 4.0, abs=0.5)


def test_a_write_that_is_durable_before_its_stall_is_timed_is_measured_too():
    # background=False, or a write faster than the copy's timing: record_save comes before record_stall
    clock = Clock()
    t = SaveTrigger("auto", clock=clock, remaining_fn=lambda: None, uptime_fn=lambda: Uptime(HOURS, "test"))
    for _ in range(5):
        clock.now += 1.0
        t.after_step()
    clock.now += 2.0
    t.record_save(2.0)
    t.record_stall(2.0)
    t.saved()
    clock.now += 1.0
    t.after_step()
    assert t.auto_state()["measured"] and t.auto_state()["stall_seconds"] == 2.0
    assert t.auto_state()["write_seconds"] == pytest.approx(0.0)


def _stall_with_the_write_reported_inside(t: SaveTrigger) -> None:
    """The save's stall recorded while the writer's thread reports the write durable in the middle of
    it (what a loaded machine's scheduler can do): the report is started inside ``auto.stall`` and
    given half a second to get through before the stall goes on."""
    import threading

    inner = t.auto.stall
    writer: List[threading.Thread] = []

    def stall(seconds: float, already_durable: bool = False) -> None:
        writer.append(threading.Thread(target=t.record_save, args=(1.0,)))
        writer[0].start()
        writer[0].join(0.5)
        inner(seconds, already_durable=already_durable)

    t.auto.stall = stall
    t.record_stall(1.0)
    writer[0].join(5)
    t.saved()


@pytest.mark.parametrize("lock", ["held", "control_no_lock"])
def test_a_write_reported_durable_during_the_stalls_record_is_not_lost(lock):
    import contextlib

    clock = Clock()
    t = SaveTrigger("auto", clock=clock, remaining_fn=lambda: None, uptime_fn=lambda: Uptime(HOURS, "test"))
    if lock == "control_no_lock":
        t._save_lock = contextlib.nullcontext()
    for _ in range(5):
        clock.now += 1.0
        t.after_step()
    _stall_with_the_write_reported_inside(t)
    clock.now += 1.0
    t.after_step()
    news = t.take_news()
    if lock == "held":
        assert t.auto_state()["write_seconds"] is not None and news and "auto: every" in news
    else:  # the report came while no window was open: lost, the interval's line never said
        assert t.auto_state()["write_seconds"] is None and news is None


def test_a_spot_vm_gives_a_shorter_interval_than_a_machine_of_ones_own(monkeypatch):
    from keepalive.session import cloud, platforms

    monkeypatch.setenv("KEEPALIVE_PLATFORM", "local")
    monkeypatch.delenv("KEEPALIVE_PROFILE", raising=False)
    platforms.detect(refresh=True)
    try:
        monkeypatch.setattr(cloud, "detect", lambda *a, **k: None)
        own = autointerval.expected_uptime()
        monkeypatch.setattr(cloud, "detect", lambda *a, **k: "gce")
        spot = autointerval.expected_uptime()
    finally:
        monkeypatch.undo()
        platforms.detect(refresh=True)
    assert own.seconds == platforms.get_profile("local").mtbf_seconds and own.source.startswith("local profile")
    assert spot.seconds == platforms.SPOT_VM_MTBF_SECONDS < own.seconds
    assert spot.source.startswith("a gce VM, maybe Spot / preemptible: estimate")
    intervals = []
    for uptime in (own, spot):
        loop = Loop(mtbf=uptime.seconds)
        loop.run(2000, step=0.1, stall=1.0)
        intervals.append(loop.trigger.auto_state()["interval_seconds"])
    assert intervals[1] < intervals[0]
    assert intervals[1] == pytest.approx(young_daly(platforms.SPOT_VM_MTBF_SECONDS, 1.0))


def test_every_profile_has_an_expected_uptime_with_its_source():
    from keepalive.session import platforms

    for profile in platforms.PROFILES:
        assert profile.mtbf_seconds > 0 and profile.mtbf_source, profile.name
    free = platforms.get_profile("colab").mtbf_seconds
    assert free < platforms.get_profile("colab-pro+").mtbf_seconds < platforms.get_profile("local").mtbf_seconds


def test_other_schedules_have_no_auto_state_and_say_nothing():
    t = SaveTrigger("10min", clock=Clock(), remaining_fn=lambda: None)
    assert t.auto_state() is None and t.take_news() is None


def test_a_real_torch_loop_with_every_auto_saves_and_says_the_line(tmp_path, capsys):
    torch = pytest.importorskip("torch")  # the quick tier on Python 3.12 runs without torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive import CheckpointStore
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.randn(80, 8, generator=g), torch.randint(0, 3, (80,), generator=g)),
                        batch_size=8)
    # (blocking: with a lazy snapshot the first write's cost was not always learned within these three
    # short epochs, so the line came late: open, in the note)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every="auto", remaining_fn=lambda: None,
                           snapshot="blocking")
    ckpt.core.trigger.auto._uptime = Uptime(3 * HOURS, "test")  # not this machine's profile
    import time as _t
    orig = CheckpointStore._write_one
    CheckpointStore._write_one = lambda self, *a, **k: (_t.sleep(0.3), orig(self, *a, **k))[1]
    for epoch in ckpt.epochs(3):
        for batch, (x, y) in enumerate(ckpt.batches(loader)):
            if epoch == 1 and batch == 0:
                # the first save (at epoch 0's end, made when the next epoch begins) is durable before
                # this epoch's second step: its cost is measured there. Left to itself, the background
                # write (at a lower priority) of a loaded machine can outlast these 20 short steps, and
                # a run that ends before the write's cost is known never says the line
                ckpt.flush()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    ckpt.close()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "auto: every" in line]
    assert len(lines) == 1, out
    state = ckpt.core.trigger.auto_state()
    assert state["measured"] and state["interval_seconds"] >= MIN_INTERVAL_SECONDS and state["stall_seconds"] > 0
    # (the rule that wins depends on this machine's load: a slow copy makes Young/Daly's interval longer)
    cost = r"(\d+\.\d\d s|\d+ ms)"
    assert re.fullmatch(rf"keepalive: auto: every {format_duration(state['interval_seconds'])} \(.+\); a save "
                        rf"stalls {cost} and its background write costs {cost} = (\d+\.\d\d|< 0\.01) % of the training",
                        lines[0]), lines[0]
    # saved at the first epoch end (the measuring save) and at the end; nothing in between (1 min apart)
    steps = sorted(info.step for info in CheckpointStore(str(tmp_path / "run")).list())
    assert steps == [10, 30]


def test_a_process_that_does_not_write_is_measured_by_its_stall_and_saves_at_one_epoch_end_only():
    # under DDP a rank other than the writer copies its state (the stall) but commits nothing: no
    # record_save ever comes. It must not ask for a save at every epoch end (the agreement would make
    # every rank save there), nor wait for a write's cost it never learns
    clock = Clock()
    t = SaveTrigger("auto", clock=clock, remaining_fn=lambda: None, uptime_fn=lambda: Uptime(3 * HOURS, "test"))
    saves = []
    for epoch in range(4):
        t.start_epoch()
        for _ in range(10):
            clock.now += 1.0
            assert t.after_step().save is None
        if t.after_epoch().save:
            clock.now += 0.5
            t.record_stall(0.5)
            t.saved()
            saves.append(epoch)
    assert saves == [0]
    assert t.auto_state()["interval_seconds"] == pytest.approx(young_daly(3 * HOURS, 0.5))


def test_status_shows_the_interval_auto_chose(tmp_path):
    """`%keepalive status` in the training's kernel: the run, "auto", the interval and why."""
    torch = pytest.importorskip("torch")
    from keepalive import status
    from keepalive.callbacks.torch import DriveCheckpoint

    model = torch.nn.Linear(2, 1)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                           every="auto", quiet=True)
    report = status.status_report(str(tmp_path))
    mine = [r for r in report["training_here"] if r["url"] == ckpt.url]
    assert mine and mine[0]["every"] == "auto" and mine[0]["auto"]["interval_seconds"] == 300.0
    assert mine[0]["auto"]["limited_by"] == "first save"
    assert f"saving    {ckpt.url}: auto: every 5 min 00 s (first save)" in status.format_status(report)
    ckpt.close()

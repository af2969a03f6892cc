"""Lazy snapshots in the fastai adapter: a save copies the fastai optimizer's parameters and state in
the background while the next batch runs its forward and backward; the batch's 'step' event (before
any before_step callback, MixedPrecision's GradScaler included) waits for the copy and checks it.

Each test trains a real fastai Learner in this process, clones what a checkpoint holds at every step
boundary, and compares each committed checkpoint with the clone of its step, tensor by tensor. Where
the copy is settled is read from the order of events (save, the next batch's backward, the settle),
not from timings: a settle after that backward is a copy that could overlap it. Races are forced: the
background copy is held until the loop made its change. Controls: the settle at the batch's start
(the step gate's default) overlaps nothing; without the version check the torn save is committed.
"""
from __future__ import annotations

import os
import sys
import warnings
from functools import partial
from typing import Any, Dict, List, Optional

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from fastai.callback.core import Callback  # noqa: E402
from fastai.optimizer import OptimWrapper  # noqa: E402
from fastai_setup import make_learner  # noqa: E402

from keepalive.callbacks._fastai_state import capture_objects  # noqa: E402
from keepalive.callbacks.fastai import DriveCheckpoint  # noqa: E402
from keepalive.state import PendingCopy, from_files  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402
from lazykit import CHANGED, held_copy  # noqa: F401 - a fixture
from lazykit import HOLD as _HOLD
from lazykit import RELEASE as _RELEASE
from lazykit import clone as _clone
from lazykit import differences as _differences
from lazykit import overlapped as _overlapped


def _saved(run: str) -> Dict[int, Any]:
    store = CheckpointStore(run)
    return {info.step: from_files(store.read_files(info), copy=True)["objects"] for info in store.list()}


class _Watch(Callback):
    """Clones what a checkpoint holds at each step boundary (after every other callback's after_batch;
    the adapter's boundary follows them), notes the saves still being copied when the next batch
    starts, and marks each backward in the event log."""

    order = 300

    def __init__(self, ckpt: DriveCheckpoint, events: List[Any], change_at: Optional[int]):
        self.ckpt, self.events, self.change_at = ckpt, events, change_at
        self.n = 0
        self.boundaries: Dict[int, Any] = {}
        self.before_change: Dict[int, Any] = {}
        self.deferred: List[int] = []

    def before_batch(self) -> None:
        if not self.learn.training:
            return
        pending = self.ckpt.core.writer._pending
        if pending is not None:
            self.deferred.append(self.n)
        if self.change_at is not None and self.n == self.change_at and pending is not None:
            with torch.no_grad():
                self.learn.model.head[1].weight.mul_(0.5)  # a hand-made change before the next step
            self.before_change[self.n] = self.boundaries[self.n]
            self.boundaries[self.n] = None  # the state of this boundary is gone now
            _RELEASE.set()

    def after_backward(self) -> None:
        self.events.append(("backward", self.n + 1))

    def after_batch(self) -> None:
        if not self.learn.training:
            return
        self.n += 1
        self.boundaries[self.n] = _clone(capture_objects(self.learn))
        if self.change_at is not None and self.n == self.change_at:
            _RELEASE.clear()  # (a settle of an earlier save released it)
            _HOLD.set()  # the copy of this boundary's save waits for the change in the next batch


def _train(run: str, *, every: Any = 2, epochs: int = 2, change_at: Optional[int] = None,
           learner: str = "fastai", settle_at_batch_start: bool = False, **options: Any) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {}
    if learner == "optim_wrapper":
        kwargs["opt_func"] = partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = make_learner(**kwargs)
    learn.remove_cb(learn.progress)
    learn.logger = lambda *a, **k: None
    if learner == "to_fp16":
        learn = learn.to_fp16()  # on a CPU autocast and GradScaler disable themselves; its before_step runs
    ckpt = DriveCheckpoint(run, every=every, keep=None, quiet=True, **options)
    events: List[Any] = []
    writer = ckpt.core.writer
    submit, settle = writer.submit, writer.settle

    def logged_submit(*a: Any, **k: Any) -> Any:
        out = submit(*a, **k)
        if writer._pending is not None:
            events.append(("save", k.get("step")))
        return out

    def logged_settle() -> List[str]:
        if writer._pending is not None:
            events.append(("settle", None))
        return settle()

    writer.submit, writer.settle = logged_submit, logged_settle  # type: ignore[method-assign]
    if settle_at_batch_start:
        ckpt.core.step_gate.settle_at_step_start = True
    watch = _Watch(ckpt, events, change_at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU: to_fp16's autocast('cuda') / GradScaler('cuda') say they are off
        learn.fit_one_cycle(epochs, 5e-3, cbs=[ckpt, watch])
    return dict(boundaries=watch.boundaries, deferred=watch.deferred, core=ckpt.core, events=events,
                before_change=watch.before_change)


def _assert_each_save_is_its_step(found: Dict[str, Any], run: str) -> Dict[int, Any]:
    saved = _saved(run)
    assert saved
    for step, objects in saved.items():
        expected = found["boundaries"].get(step)
        assert expected is not None, f"step {step} was saved, but its state was changed before the save"
        # (the fit's end holds no GradScaler: to_fp16's after_fit removed it)
        common = [k for k in expected if k in objects]
        assert {"model", "optimizer"} <= set(common)
        diff = _differences({k: expected[k] for k in common}, {k: objects[k] for k in common})
        assert not diff, f"the checkpoint of step {step} is not the state of step {step}: {diff[:5]}"
    return saved




@pytest.mark.parametrize("learner", ["fastai", "optim_wrapper", "to_fp16"])
def test_each_lazy_save_is_its_step_and_its_copy_overlaps_the_next_backward(tmp_path, capsys, learner):
    """12 steps, a save every 2 (and each epoch's end): each checkpoint equals the state of its step;
    the copy of each save made between two training batches was settled only after the next batch's
    backward (at its step event), never at the batch's start."""
    found = _train(str(tmp_path / "run"), learner=learner)
    assert len(found["deferred"]) >= 3, "no save copied lazily"
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert set(found["deferred"]) <= set(saved)
    overlapped = _overlapped(found["events"])
    # every lazy save between two training batches (steps 2, 4, 8, 10: the epoch ends' saves at 6, 12 are
    # settled at the validation and the fit's end)
    assert sum(overlapped) >= 4, found["events"]
    assert CHANGED not in capsys.readouterr().err


def test_control_settled_at_the_batch_start_the_copy_overlaps_nothing(tmp_path):
    """The step gate's default (settle where the batch enters the gate): still exact, but no copy
    runs past a backward, which the order check above would catch."""
    found = _train(str(tmp_path / "run"), settle_at_batch_start=True)
    overlapped = _overlapped(found["events"])
    assert overlapped and not any(overlapped), found["events"]
    _assert_each_save_is_its_step(found, str(tmp_path / "run"))


@pytest.mark.usefixtures("held_copy")
def test_a_weight_changed_before_its_copy_is_said_once_and_saved_again(tmp_path, capsys):
    """A hand-made in-place change of a parameter in the batch after a save, before its step, with
    the copy held until after it: the version check drops that save (said once), the next step
    boundary saves again, and that parameter is copied at once from then on."""
    found = _train(str(tmp_path / "run"), every=2, change_at=4)
    err = capsys.readouterr().err
    assert err.count(CHANGED) == 1, err
    assert "head.1.weight changed in place before its snapshot was copied" in err
    assert "the save of step 4 is made again at the next step boundary" in err
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert 4 not in saved and 5 in saved  # dropped, made again one step later
    assert any(k.endswith("head.1.weight") for k in found["core"].snapshots.copy_at_once)


@pytest.mark.usefixtures("held_copy")
def test_control_without_the_version_check_the_torn_save_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(PendingCopy, "changed", lambda self: [])
    found = _train(str(tmp_path / "run"), every=2, change_at=4)
    saved = _saved(str(tmp_path / "run"))
    assert 4 in saved  # committed: its weight is the changed one, the rest is step 4's
    assert _differences(found["before_change"][4], saved[4]) == [".model.head.1.weight"]


# ------------------------------------------------------------ a weight swap at the validation's start
class _SwapForValidation(Callback):
    """Evaluates other weights (as an EMA callback does): swapped into the model through ``.data`` in
    before_validate (no version counter moves), swapped back in after_validate. Once swapped, lets a
    held copy run: it would read the swapped weights unless settled before."""

    order = 0  # before every other callback's before_validate

    def before_validate(self) -> None:
        self.kept = [p.data.clone() for p in self.learn.model.parameters()]
        for p in self.learn.model.parameters():
            p.data.mul_(0.5)
        _RELEASE.set()

    def after_validate(self) -> None:
        for p, kept in zip(self.learn.model.parameters(), self.kept):
            p.data.copy_(kept)


@pytest.mark.parametrize("broken", [False, True], ids=["settled_before_validation", "control_not_settled"])
def test_weights_swapped_for_the_validation_are_not_in_the_lazy_copy(tmp_path, monkeypatch, broken):
    """The save of an epoch's last batch (step 6) has its copy held until a before_validate callback
    swapped other weights in through ``.data``, which the version check cannot see: settled at the
    validate event, before any callback, the checkpoint holds the training weights of step 6.
    Control: without that settle the copy reads the swapped weights and the checkpoint is torn."""
    _HOLD.clear()
    _RELEASE.clear()
    original_run = PendingCopy.run

    def held_run(self: Any) -> None:
        if _HOLD.is_set():
            _HOLD.clear()
            assert _RELEASE.wait(30), "neither a settle nor the validation came"
        original_run(self)

    monkeypatch.setattr(PendingCopy, "run", held_run)

    learn = make_learner()
    learn.remove_cb(learn.progress)
    learn.logger = lambda *a, **k: None
    run = str(tmp_path / "run")
    ckpt = DriveCheckpoint(run, every=3, keep=None, quiet=True)
    core, writer = ckpt.core, ckpt.core.writer
    settle, core_settle = writer.settle, core.settle_snapshot

    def releasing_settle() -> List[str]:
        if writer._pending is not None:  # (submit's own wait settles too, before its copy exists)
            _RELEASE.set()
        return settle()

    def settle_except_at_validate() -> None:
        if sys._getframe(1).f_locals.get("event_type") != "validate":
            core_settle()

    writer.settle = releasing_settle  # type: ignore[method-assign]
    if broken:
        core.settle_snapshot = settle_except_at_validate  # type: ignore[method-assign]
    watch = _Watch(ckpt, [], change_at=None)
    original_after_batch = watch.after_batch

    def after_batch() -> None:
        original_after_batch()
        if learn.training and watch.n == 6:
            _RELEASE.clear()  # (a settle of an earlier save released it)
            _HOLD.set()  # the copy of this boundary's save waits (for a settle or the swap)

    watch.after_batch = after_batch  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn.fit_one_cycle(2, 5e-3, cbs=[ckpt, watch, _SwapForValidation()])
    saved = _saved(run)
    assert 6 in saved
    diff = _differences(watch.boundaries[6]["model"], saved[6]["model"])
    if broken:
        assert diff, "the control's torn checkpoint went unnoticed: this test cannot fail"
    else:
        assert not diff, f"the checkpoint of step 6 holds weights swapped in after its save: {diff}"


# ---------------------------------------------------------------- Lookahead (ranger) in a checkpoint
@pytest.mark.parametrize("broken", [False, True], ids=["lookahead_saved", "control_lookahead_dropped"])
def test_ranger_resumes_bit_exactly(tmp_path, monkeypatch, broken):
    """fastai's ``ranger`` is a Lookahead over RAdam: its step count and slow weights are part of the
    optimizer's state (they were left out, and a resume failed on them). A crash after step 8 and a
    resume end bit-identical to an uninterrupted run. Control: a checkpoint without them differs."""
    from fastai.optimizer import Lookahead, ranger

    from keepalive.callbacks import _fastai_state
    from test_fastai import session, weights

    if broken:
        capture = _fastai_state.capture_objects

        def without_lookahead(learn: Any) -> Dict[str, Any]:
            objects = capture(learn)
            objects["optimizer"] = {k: objects["optimizer"][k] for k in ("state", "hypers")}
            return objects

        monkeypatch.setattr(_fastai_state, "capture_objects", without_lookahead)
        # (a Lookahead given no count / slow weights starts them afresh, as a resume without them did)
        monkeypatch.setattr(Lookahead, "load_state_dict", lambda self, sd: (self._init_state(),
                                                                           self.opt.load_state_dict(sd)))
    learner = {"opt_func": ranger}
    ref, _ = session(tmp_path / "ref", every=4, lkw=learner)
    session(tmp_path / "run", every=4, crash=9, lkw=learner)
    got, _ = session(tmp_path / "run", every=4, lkw=learner)
    a, b = weights(ref), weights(got)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert bool(differ) == broken, differ

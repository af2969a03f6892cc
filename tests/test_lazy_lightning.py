"""Lazy snapshots in the Lightning adapter: a save copies the optimizers' parameters and state in the
background while the next batch runs; Lightning runs forward and backward inside
``optimizer.step(closure)``, after torch's step pre-hook, so the copy is settled in
``on_before_optimizer_step`` (after the closure, before the update), or at the start of a step given
no closure (AMP's ``scaler.step``).

Each test runs a real ``Trainer.fit`` in this process, clones the model's and optimizers' state at
every step boundary, and compares each committed checkpoint with the clone of its step, tensor by
tensor. Where the copy is settled is read from the order of events (save, the next batch's backward,
the settle), not from timings. Races are forced: the background copy is held until the loop made its
change. Controls: the settle at the step's start (torch's pre-hook, the gate's default) overlaps no
backward; without the version check the torn save is committed.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Any, Dict, List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_torchvision_shim() -> None:
    """lightning imports torchvision, whose CUDA build here needs its op schemas first (tests/shims)."""
    spec = importlib.util.spec_from_file_location("_keepalive_tv_shim", os.path.join(HERE, "shims", "sitecustomize.py"))
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


torch = pytest.importorskip("torch")
_load_torchvision_shim()
pl = pytest.importorskip("lightning.pytorch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from keepalive.callbacks.lightning import DriveCheckpoint  # noqa: E402
from keepalive.state import PendingCopy, from_files  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402
from lazykit import CHANGED, held_copy  # noqa: F401 - a fixture
from lazykit import HOLD as _HOLD
from lazykit import RELEASE as _RELEASE
from lazykit import clone as _clone
from lazykit import differences as _differences
from lazykit import overlapped as _overlapped


class Data(pl.LightningDataModule):
    def __init__(self, n: int = 48):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n + 16, 4, generator=g), torch.randn(n + 16, 1, generator=g)
        self.n = n

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:self.n], self.y[:self.n]), batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[self.n:], self.y[self.n:]), batch_size=8)


class Net(pl.LightningModule):
    """Automatic optimization (``mode="auto"``) or manual (``"manual"``: manual_backward, opt.step)."""

    def __init__(self, mode: str, cb: "DriveCheckpoint", change_at: Optional[int]):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
        self.mode, self.cb, self.change_at = mode, cb, change_at
        self.automatic_optimization = mode != "manual"
        self.before_change: Dict[int, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        step = int(self.trainer.global_step)
        if self.change_at is not None and step == self.change_at and self.cb.core.writer._pending is not None:
            with torch.no_grad():
                self.net[0].weight.mul_(0.5)  # a hand-made change before the next optimizer step
            self.before_change[step] = _BOUNDARIES[step]
            _BOUNDARIES[step] = None  # the state of this boundary is gone now
            _RELEASE.set()
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        if self.mode != "manual":
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                                                   "interval": "step"}}


class _Events(pl.Callback):
    def __init__(self, events: List[Any], change_at: Optional[int]):
        self.events, self.change_at = events, change_at

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.events.append(("backward", int(trainer.global_step)))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
        if self.change_at is not None and int(trainer.global_step) == self.change_at:
            _RELEASE.clear()  # (a settle of an earlier save released it)
            _HOLD.set()  # the copy of this boundary's save waits for the change in the next batch


_BOUNDARIES: Dict[int, Any] = {}






def _saved(run: str) -> Dict[int, Any]:
    store = CheckpointStore(run)
    out = {}
    for info in store.list():
        ckpt = from_files(store.read_files(info), copy=True)["lightning"]["checkpoint"]
        out[info.step] = {"state_dict": ckpt["state_dict"], "optimizer_states": ckpt["optimizer_states"]}
    return out


def _train(run: str, *, mode: str = "auto", every: Any = 2, epochs: int = 2, change_at: Optional[int] = None,
           settle_at_step_start: bool = False, accumulate: int = 1, amp: bool = False,
           **options: Any) -> Dict[str, Any]:
    _BOUNDARIES.clear()
    pl.seed_everything(3, verbose=False)
    cb = DriveCheckpoint(run, every=every, keep=None, quiet=True, **options)
    model, events = Net(mode, cb, change_at), []
    core, writer = cb.core, cb.core.writer
    deferred: List[int] = []

    def clone_at(boundary: Any) -> Any:
        def run_boundary(*a: Any, **k: Any) -> Any:
            trainer = cb.trainer
            _BOUNDARIES[int(trainer.global_step)] = _clone(
                {"state_dict": model.state_dict(), "optimizer_states": [o.state_dict() for o in trainer.optimizers]})
            return boundary(*a, **k)
        return run_boundary

    submit, settle = writer.submit, writer.settle

    def logged_submit(*a: Any, **k: Any) -> Any:
        out = submit(*a, **k)
        if writer._pending is not None:
            events.append(("save", k.get("step")))
            deferred.append(k.get("step"))
        return out

    def logged_settle() -> List[str]:
        if writer._pending is not None:
            events.append(("settle", None))
        return settle()

    core.advance, core.end_epoch = clone_at(core.advance), clone_at(core.end_epoch)  # type: ignore[method-assign]
    writer.submit, writer.settle = logged_submit, logged_settle  # type: ignore[method-assign]
    if settle_at_step_start:
        core.step_gate.settle_at_step_start = True
    plugins = []
    if amp:  # AMP's GradScaler path (on a CPU: torch's CPU GradScaler): the closure runs before the step
        plugins = [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[cb, _Events(events, change_at)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", num_sanity_val_steps=0, accumulate_grad_batches=accumulate,
                         plugins=plugins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=Data())
    return dict(boundaries=dict(_BOUNDARIES), deferred=deferred, core=core, events=events,
                before_change=model.before_change)


def _assert_each_save_is_its_step(found: Dict[str, Any], run: str) -> Dict[int, Any]:
    saved = _saved(run)
    assert saved
    for step, objects in saved.items():
        expected = found["boundaries"].get(step)
        assert expected is not None, f"step {step} was saved, but its state was changed before the save"
        diff = _differences(expected, objects)
        assert not diff, f"the checkpoint of step {step} is not the state of step {step}: {diff[:5]}"
    return saved




@pytest.mark.parametrize("variant", ["auto", "manual", "accumulate", "amp"])
def test_each_lazy_save_is_its_step_and_its_copy_overlaps_the_next_backward(tmp_path, capsys, variant):
    """12 batches, a save every 2 optimizer steps: each checkpoint equals the state of its step; the
    copy of each save made between two training batches is settled only after the next batch's
    backward (Lightning's closure ran; on_before_optimizer_step), never at the step's start."""
    options: Dict[str, Any] = {"accumulate": 2, "every": 1} if variant == "accumulate" else {}
    found = _train(str(tmp_path / "run"), mode="manual" if variant == "manual" else "auto", amp=variant == "amp",
                   **options)
    assert len(found["deferred"]) >= 3, "no save copied lazily"
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert set(found["deferred"]) <= set(saved)
    overlapped = _overlapped(found["events"])
    assert sum(overlapped) >= 3, found["events"]
    assert CHANGED not in capsys.readouterr().err


def test_control_settled_at_the_step_start_the_copy_overlaps_no_backward(tmp_path):
    """torch's step pre-hook runs before Lightning's closure: settled there (the gate's default), the
    copy is still exact but overlaps no forward or backward, which the order check above catches."""
    found = _train(str(tmp_path / "run"), settle_at_step_start=True)
    overlapped = _overlapped(found["events"])
    assert overlapped and not any(overlapped), found["events"]
    _assert_each_save_is_its_step(found, str(tmp_path / "run"))


@pytest.mark.usefixtures("held_copy")
def test_a_weight_changed_before_its_copy_is_said_once_and_saved_again(tmp_path, capsys):
    """A hand-made in-place change of a parameter in training_step after a save (inside the step's
    closure), with the copy held until after it: the version check drops that save (said once), the
    next step boundary saves again, and that parameter is copied at once from then on."""
    found = _train(str(tmp_path / "run"), every=2, change_at=4)
    err = capsys.readouterr().err
    assert err.count(CHANGED) == 1, err
    assert "net.0.weight changed in place before its snapshot was copied" in err
    assert "the save of step 4 is made again at the next step boundary" in err
    saved = _assert_each_save_is_its_step(found, str(tmp_path / "run"))
    assert 4 not in saved and 5 in saved  # dropped, made again one step later
    assert any(k.endswith("net.0.weight") for k in found["core"].snapshots.copy_at_once)


@pytest.mark.usefixtures("held_copy")
def test_control_without_the_version_check_the_torn_save_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(PendingCopy, "changed", lambda self: [])
    found = _train(str(tmp_path / "run"), every=2, change_at=4)
    saved = _saved(str(tmp_path / "run"))
    assert 4 in saved  # committed: its weight is the changed one, the rest is step 4's
    assert _differences(found["before_change"][4], saved[4]) == [".state_dict.net.0.weight"]


# ------------------------------------------------------------ a weight swap at the validation's start
class _Plain(pl.LightningModule):
    """Net's training without references to the test's objects (EMAWeightAveraging deep-copies it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _ReleaseAtValidation(pl.Callback):
    """After EMAWeightAveraging swapped the average into the model (through .data: no version counter
    moves), lets the held copy run: it would read the swapped weights unless settled before."""

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        _RELEASE.set()


@pytest.mark.parametrize("broken", [False, True], ids=["settled_before_validation", "control_not_settled"])
def test_weights_swapped_for_the_validation_are_not_in_the_lazy_copy(tmp_path, monkeypatch, broken):
    """Lightning's EMAWeightAveraging evaluates the average by swapping it into the model's
    parameters through ``.data`` at the validation's start, which the version check cannot see. A
    save at the validation's boundary (step 3, val_check_interval=3) has its copy held until that
    swap: settled before the validation runs, the checkpoint holds the training weights of step 3.
    Control: without that settle the copy reads the swapped weights and the checkpoint is torn."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    _HOLD.clear()
    _RELEASE.clear()
    original_run = PendingCopy.run

    def held_run(self: Any) -> None:
        if _HOLD.is_set():
            _HOLD.clear()
            assert _RELEASE.wait(30), "neither a settle nor the validation came"
        original_run(self)

    monkeypatch.setattr(PendingCopy, "run", held_run)
    pl.seed_everything(3, verbose=False)
    run = str(tmp_path / "run")
    cb = DriveCheckpoint(run, every=3, keep=None, quiet=True)
    core, writer = cb.core, cb.core.writer
    model = _Plain()
    clones: Dict[int, Any] = {}
    advance, settle, settle_snapshot = core.advance, writer.settle, core.settle_snapshot

    def cloning_advance(*a: Any, **k: Any) -> Any:
        step = int(cb.trainer.global_step)
        clones[step] = _clone(model.state_dict())
        if step == 3:
            _RELEASE.clear()  # (a settle of an earlier save released it)
            _HOLD.set()  # this boundary's save (at the validation's start) is held
        return advance(*a, **k)

    def releasing_settle() -> List[str]:
        if writer._pending is not None:  # (submit's own wait settles too, before its copy exists)
            _RELEASE.set()  # a settle waits for the copy: let it run now
        return settle()

    def settle_except_before_validation() -> None:
        if sys._getframe(1).f_code.co_name != "_validation_begins":
            settle_snapshot()

    core.advance, writer.settle = cloning_advance, releasing_settle  # type: ignore[method-assign]
    if broken:
        core.settle_snapshot = settle_except_before_validation  # type: ignore[method-assign]
    trainer = pl.Trainer(max_epochs=1, callbacks=[cb, EMAWeightAveraging(decay=0.5), _ReleaseAtValidation()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0, val_check_interval=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=Data())
    store = CheckpointStore(run)
    info = next(i for i in store.list() if i.step == 3)
    saved = from_files(store.read_files(info), copy=True)["lightning"]["checkpoint"]["current_model_state"]
    diff = _differences(clones[3], saved)
    if broken:
        assert diff, "the control's torn checkpoint went unnoticed: this test cannot fail"
    else:
        assert not diff, f"the checkpoint of step 3 holds weights swapped in after its save: {diff}"


class _AskDuringValidation(pl.Callback):
    """Asks the core, at each validation batch's end, whether a save between steps would hold the
    state of the last step boundary."""

    def __init__(self, cb: DriveCheckpoint):
        self.cb = cb
        self.answers: List[Optional[str]] = []

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
        if not trainer.sanity_checking:
            self.answers.append(self.cb.core.between_steps.unchanged_since_mark()[0])


@pytest.mark.parametrize("ema", [True, False], ids=["ema_swapped", "control_no_swap"])
def test_no_save_during_a_validation_that_evaluates_swapped_weights(tmp_path, ema):
    """A save during a validation (a signal, the deadline) writes the model as it is then; with
    EMAWeightAveraging the model holds the average then (swapped in through .data: no version counter
    moves), so such a save must wait for the next step boundary. Control: without the swap it may save."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    pl.seed_everything(3, verbose=False)
    cb = DriveCheckpoint(str(tmp_path / "run"), every=100, quiet=True)
    ask = _AskDuringValidation(cb)
    callbacks: List[Any] = [cb, ask] + ([EMAWeightAveraging(decay=0.5)] if ema else [])
    trainer = pl.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         num_sanity_val_steps=0, val_check_interval=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Plain(), datamodule=Data())
    assert ask.answers
    if ema:
        assert all(a is not None and "changed state beside the tensors" in a for a in ask.answers), ask.answers
    else:
        assert all(a is None for a in ask.answers), ask.answers

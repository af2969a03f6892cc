"""Lazy snapshots under the HF Trainer: a save at a step's end copies the model's parameters and the
optimizer's state in the background while the next step's forward and backward run (gradient
accumulation over 2 micro-batches); the optimizer's step waits for the copy. Each committed
checkpoint is compared, tensor by tensor, with a clone of the state taken at its save. Control:
with the version check off and a parameter changed in place before its copy, the committed
checkpoint differs from the clone of its step.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("transformers")

from keepalive.state import PendingCopy, from_files  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402
from lazykit import (
    CHANGED,  # noqa: E402
    differences,  # noqa: E402
)
from lazykit import clone as _clone  # noqa: E402


def _run(tmp_path, *, change_at=None, hold=False):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers import logging as hf_logging

    from keepalive.callbacks.transformers import DriveCheckpoint

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=8))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (32, 8), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    ckpt = DriveCheckpoint(str(tmp_path / "run"), every=2, keep=None, quiet=True)
    saved_at: Dict[int, Any] = {}
    deferred: List[int] = []
    release = threading.Event()

    class Clone(TrainerCallback):
        """The state a save at this step's boundary holds (the adapter saves when the next batch is
        fetched: nothing changes in between), and, before the next optimizer step, whether that save's
        copy is still running in the background (and, where asked, a change made while it runs)."""

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            saved_at[state.global_step] = _clone({"model": model.state_dict(),
                                                  "optimizer": optimizer.state_dict()["state"]})

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            core = ckpt.core
            if core.writer._pending is None:
                return
            deferred.append(state.global_step)
            if state.global_step == change_at:
                with torch.no_grad():
                    next(model.parameters()).mul_(0.5)  # before the step: the copy must not hold it
                saved_at[state.global_step] = None
                release.set()

    if hold:
        original = PendingCopy.run

        def held(self):
            if ckpt.core.counters["step"] == change_at:
                release.wait(30)
            original(self)

        PendingCopy.run = held  # type: ignore[method-assign]
    try:
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-2,
                                 report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no")
        trainer = Trainer(model=net, args=args, train_dataset=data, callbacks=[ckpt, Clone()])
        trainer.train()
    finally:
        if hold:
            PendingCopy.run = original  # type: ignore[method-assign]
    store = CheckpointStore(str(tmp_path / "run"))
    checkpoints = {info.step: from_files(store.read_files(info), copy=True)["objects"] for info in store.list()}
    return saved_at, deferred, checkpoints


def _compare(saved_at, checkpoints, skip=()):
    for step, objects in checkpoints.items():
        if step in skip or step not in saved_at:
            continue
        expected = saved_at[step]
        assert expected is not None, f"step {step} was committed although it changed before its copy"
        diff = differences(expected["model"], objects["model"], "model", strict=False)
        diff += differences(expected["optimizer"], objects["optimizer"]["state"], "optimizer", strict=False)
        assert not diff, f"the checkpoint of step {step} is not its step's state: {diff[:5]}"


def test_each_lazy_save_is_the_state_of_its_step(tmp_path, capsys):
    saved_at, deferred, checkpoints = _run(tmp_path)
    assert deferred, "no save was copied lazily"
    assert set(deferred) <= set(checkpoints)
    _compare(saved_at, checkpoints)
    assert CHANGED not in capsys.readouterr().err


def test_a_parameter_changed_before_its_copy_is_said_and_saved_again(tmp_path, capsys):
    saved_at, deferred, checkpoints = _run(tmp_path, change_at=4, hold=True)
    err = capsys.readouterr().err
    assert err.count(CHANGED) == 1, err
    assert 4 not in checkpoints and 5 in checkpoints, sorted(checkpoints)
    _compare(saved_at, checkpoints)


def test_control_without_the_version_check_the_torn_save_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(PendingCopy, "changed", lambda self: [])
    saved_at, deferred, checkpoints = _run(tmp_path, change_at=4, hold=True)
    assert 4 in checkpoints
    with pytest.raises(AssertionError, match="committed although it changed"):
        _compare(saved_at, checkpoints)

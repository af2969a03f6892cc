"""Hugging Face ``Trainer``: the random states of the loader's workers go through the shared
``keepalive.callbacks.replay.WorkerStates`` (the state each batch starts from, by batch number), and a
checkpoint in the earlier per-worker format (one state per worker: the state after its last trained batch)
still resumes exactly.

``tests/scripts/hf_setup.py``: a tiny BERT from a config, an in-memory tokenizer, masking in the workers
(``DataCollatorForLanguageModeling``), accumulation 2, 11 batches (6 steps) per epoch, 2 epochs; the
deadline stops the run inside an epoch and the same cell runs again.

* a checkpoint written with the old ``workers`` section (built by saving the new one's states under the
  worker that made each batch, as keepalive wrote it before) resumes bit-exactly; control: the same
  checkpoint read without its worker states differs;
* persistent workers stopped at the epoch's last step (fewer batches left than workers): the next epoch's
  new workers take over states saved with the checkpoint and noted by the resumed pass's workers: exact;
* persistent workers, a checkpoint at an epoch's end: the resumed epoch's new workers take over the states
  the uninterrupted run's workers go on from: exact; control: without them, the weights differ.
"""
from __future__ import annotations

import shutil

import pytest

import hfkit
from crashkit import assert_differs, assert_same
from hfkit import stop_after, train, trainer_state

hfkit.importorskip("transformers", "tokenizers")

TOTAL = 12


def _stop(tmp_path, stop_at, **kw):
    assert hfkit.stopped(tmp_path, stop_at, **kw).step == stop_at


def _resume(tmp_path, **kw):
    return hfkit.resumed(tmp_path, TOTAL, **kw)


def _old_format(monkeypatch, workers):
    """Save the worker states as keepalive did before: per worker, the state its next batch starts from."""
    from keepalive.callbacks import _hf_data

    capture = _hf_data.Replay.capture

    def old(self, trained):
        out = capture(self, trained)
        starts = out.pop("worker_starts")
        assert len(starts) == workers
        out["workers"] = {str(int(b) % workers): s for b, s in starts.items()}
        return out

    monkeypatch.setattr(_hf_data.Replay, "capture", old)


def test_a_checkpoint_in_the_per_worker_format_resumes_exactly(tmp_path, monkeypatch):
    from keepalive.callbacks import _hf_data

    plain = trainer_state(train(tmp_path / "plain", workers=2))
    with monkeypatch.context() as m:
        _old_format(m, 2)
        _stop(tmp_path / "old", 3, workers=2)  # batch 6 of 11: worker 0's batch next
    shutil.copytree(tmp_path / "old", tmp_path / "control")  # the same checkpoint, for the control
    seen = []
    per_batch = _hf_data.per_batch

    def reading(saved, trained, workers):
        seen.append(sorted(saved.get("workers") or {}))
        return per_batch(saved, trained, workers)

    monkeypatch.setattr(_hf_data, "per_batch", reading)
    assert_same(plain, _resume(tmp_path / "old", workers=2))
    assert seen == [["0", "1"]] and "worker_starts" not in str(seen)

    # control: the same old checkpoint without its worker states (workers seeded afresh)
    monkeypatch.setattr(_hf_data, "per_batch", lambda saved, trained, workers: {})
    assert_differs(plain, _resume(tmp_path / "control", workers=2))


def test_persistent_workers_stopped_at_an_epochs_last_batches_resume_exactly(tmp_path):
    """3 persistent workers, stopped at step 5 (batch 10 of 11): the resumed pass makes one batch; two of
    epoch 1's workers take over states saved in the checkpoint, one the state the resumed pass left."""
    kw = dict(workers=3, dataloader_persistent_workers=True)
    plain = trainer_state(train(tmp_path / "plain", **kw))
    _stop(tmp_path, 5, **kw)
    assert_same(plain, _resume(tmp_path, **kw))


def test_persistent_workers_resumed_at_an_epochs_end_go_on_as_the_uninterrupted_ones(tmp_path, monkeypatch):
    """2 persistent workers, a checkpoint at epoch 0's end (every="epoch"): the uninterrupted run's workers
    go on into epoch 1, a resumed run starts new ones: they take over the saved states (and the main
    generator is not drawn from by their creation). Control: without the states taken over the masks of
    epoch 1 differ (max |delta| of the weights printed)."""
    from keepalive.callbacks import _hf_data
    from keepalive.callbacks.transformers import DriveCheckpoint

    kw = dict(workers=2, dataloader_persistent_workers=True)
    plain = trainer_state(train(tmp_path / "plain", **kw))
    cb = DriveCheckpoint(tmp_path / "run", every="epoch", quiet=True, remaining_fn=stop_after(7),
                         deadline_margin="5s")
    with pytest.raises(SystemExit) as stop:  # a script's stop exits 143 (EXIT_STOPPED) after its save
        train(tmp_path / "a", cb, **kw)
    assert stop.value.code == 143
    assert cb.stopped and dict(cb.core.counters, samples=0) == {"epoch": 1, "step": 6, "batch": 0, "samples": 0}
    shutil.copytree(tmp_path / "run", tmp_path / "control" / "run")
    assert_same(plain, _resume(tmp_path, **kw))

    monkeypatch.setattr(_hf_data.Replay, "resume_carry", lambda self, saved: None)
    control = _resume(tmp_path / "control", **kw)
    delta = max((plain["weights"][k] - control["weights"][k]).abs().max().item() for k in plain["weights"])
    print(f"control: max |delta| of the weights = {delta}")
    assert_differs(plain, control)

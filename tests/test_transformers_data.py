"""Hugging Face ``Trainer``: the data a resumed step is made from, and the checkpoints of a stream.

A random collator (``DataCollatorForLanguageModeling``'s masking) draws while batches are made: in the main
process, where the Trainer fetches a step's micro-batches before the step begins and accelerate's loader one
batch ahead of that, or in the loader's workers, each continuing its own generator from batch to batch. The
first resumed step must mask exactly what the uninterrupted run masked (``tests/scripts/hf_setup.py``: a tiny
BERT from a config, an in-memory tokenizer, accumulation 2, dropout; no download).

* transparency: a run with the callback (saving at every step, 2 workers) is bit-identical to the same run
  without it; control: a callback that draws one random number per step is caught;
* SIGKILL mid-epoch (between optimizer steps), re-run until done: weights, optimizer state and log history
  bit-identical to a run without keepalive, with masking in the main process, in 2 workers, and with a
  Hugging Face ``datasets.IterableDataset`` (positioned through its ``state_dict()``);
* controls: the same resume without the replayed random states (main process, workers) differs;
* a stream with ``max_steps`` checkpoints every N steps (it has no epoch end): exact through
  ``state_dict()``; a stream without one is read again by the Trainer's skip, said once at the first save.
"""
from __future__ import annotations

import os

import pytest

import hfkit
from crashkit import assert_differs, assert_same
from hfkit import train, trainer_state

torch = hfkit.importorskip("transformers", "tokenizers")

import hf_setup  # noqa: E402 - tests/scripts, on the path through hfkit

SCRIPT = os.path.join(hfkit.SCRIPTS, "hf_data_train.py")
TOTAL = 12  # map: 44 samples / batch 4 = 11 batches, accumulation 2: 6 steps per epoch, 2 epochs; streams: max_steps

#: what hf_data_train.py has imported once keepalive's Trainer callback is (and the model's module): the
#: children fork from a server that has imported it, some 4 s of CPU each of the 11 children here
forked_children = hfkit.forked_children_fixture(
    ["torch", "numpy", "safetensors.torch", "transformers", "transformers.trainer_callback", "transformers.trainer",
     "transformers.training_args", "transformers.models.bert.modeling_bert"], only=SCRIPT)


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _stopped_and_resumed(tmp_path, stop_at, **kw):
    """Train until the deadline saves and stops inside an epoch, then run the same cell again."""
    cb = hfkit.stopped(tmp_path, stop_at, **kw)
    assert 0 < cb.step < TOTAL
    return cb.step, hfkit.resumed(tmp_path, TOTAL, **kw)


# ------------------------------------------------------------------------------- transparency
def test_with_keepalive_equals_without_mlm_two_workers(tmp_path):
    """Saving at every step (stamps, notes, captures) changes nothing; a callback that draws is caught."""
    from transformers import TrainerCallback

    from keepalive.callbacks.transformers import DriveCheckpoint

    plain = trainer_state(train(tmp_path / "plain", workers=2))
    cb = DriveCheckpoint(tmp_path / "run", every=1, quiet=True)
    assert_same(plain, trainer_state(train(tmp_path / "ka", cb, workers=2)))
    assert cb.finished and cb.step == TOTAL

    class Draws(TrainerCallback):  # the control: what a leaky adapter would do at its save points
        def on_step_end(self, *a, **kw):
            torch.rand(1)

    assert_differs(plain, trainer_state(train(tmp_path / "leaky", workers=2, extra_callbacks=[Draws()])))


# ----------------------------------------------------------------------------- crash tests
def _run(tmp_path, name, *extra, kills=0, seed=0):
    return hfkit.run_script(SCRIPT, tmp_path / name, *extra, total=TOTAL, kills=kills, seed=seed, sleep=0.02)[0]


@pytest.mark.slow
@pytest.mark.parametrize("data,workers,seed", [
    ("map", 0, 3),
    ("map", 2, 4),
    pytest.param("hfstream", 0, 5, marks=pytest.mark.skipif(not _has("datasets"), reason="no datasets")),
], ids=["mlm-main-process", "mlm-2-workers", "datasets-stream"])
def test_sigkill_mid_epoch_replays_the_random_batches(tmp_path, data, workers, seed):
    shape = ["--data", data, "--workers", str(workers)]
    ref = _run(tmp_path, "plain", *shape, "--plain")
    got = _run(tmp_path, "killed", *shape, kills=1 if data == "hfstream" else 2, seed=seed)
    assert got["global_step"] == TOTAL
    assert_same(ref, got)


# -------------------------------------------------------------------------------- controls
@pytest.mark.parametrize("workers", [0, 2], ids=["main-process", "2-workers"])
def test_resume_mid_epoch_is_exact_and_the_replay_is_what_makes_it(tmp_path, monkeypatch, workers):
    """Stopped at step 5 (batch 10 of 11, one batch fetched ahead): exact; without the replayed states
    (the step's state put back after the fetch, as before; workers seeded afresh) the masks differ."""
    from keepalive.callbacks import _hf_data

    plain = trainer_state(train(tmp_path / "plain", workers=workers))
    stopped, resumed = _stopped_and_resumed(tmp_path / "exact", 5, workers=workers)
    assert stopped == 5
    assert_same(plain, resumed)
    if workers:
        monkeypatch.setattr(_hf_data, "per_batch", lambda saved, trained, workers: {})
    else:
        monkeypatch.setattr(_hf_data.Replay, "prepare", lambda self, saved, trained, step_rng: False)
    _, control = _stopped_and_resumed(tmp_path / "control", 5, workers=workers)
    assert_differs(plain, control)


def test_persistent_workers_resume_on_another_worker_count_boundary(tmp_path):
    """3 persistent workers, stopped at batch 4 of epoch 0: an empty batch puts batch 4 on worker 1 again,
    and epoch 1's new workers (accelerate's resumed loader took the old ones with it) take over the states."""
    kw = dict(workers=3, dataloader_persistent_workers=True)
    plain = trainer_state(train(tmp_path / "plain", **kw))
    stopped, resumed = _stopped_and_resumed(tmp_path, 2, **kw)
    assert stopped == 2
    assert_same(plain, resumed)


# -------------------------------------------------------------------------------- streams
@pytest.mark.parametrize("data", [
    "stream", pytest.param("hfstream", marks=pytest.mark.skipif(not _has("datasets"), reason="no datasets"))])
def test_a_stream_checkpoints_every_n_steps_and_resumes_exactly(tmp_path, capsys, data):
    from keepalive.callbacks.transformers import DriveCheckpoint

    plain = trainer_state(train(tmp_path / "plain", data=data))
    cb = DriveCheckpoint(tmp_path / "every", every=5, quiet=True)
    steps = []
    cb.core.on_commit.append(lambda r: steps.append(r.info.step))
    assert_same(plain, trainer_state(train(tmp_path / "ka", cb, data=data)))
    cb.core.close()
    assert steps[:2] == [5, 10] and steps[-1] == TOTAL  # step saves land; no epoch end in this run
    err = capsys.readouterr().err
    told = "without state_dict(): a resume reads its pass again"
    assert (err.count(told) == 1) if data == "stream" else (told not in err)
    _, resumed = _stopped_and_resumed(tmp_path, 7, data=data)
    assert_same(plain, resumed)


def test_a_collator_with_its_own_seed_is_told_once(tmp_path, capsys):
    """``DataCollatorForLanguageModeling(seed=...)`` masks from a generator of its own, which is not saved: the
    first mid-epoch save says so (once), instead of a resume that masks differently in silence."""
    from transformers import DataCollatorForLanguageModeling

    from keepalive.callbacks.transformers import DriveCheckpoint

    t = hf_setup.trainer(str(tmp_path / "hf"), DriveCheckpoint(tmp_path / "run", every=1, quiet=True), epochs=1)
    t.data_collator = DataCollatorForLanguageModeling(hf_setup.tokenizer(), mlm_probability=0.3, seed=1)
    t.train()
    assert capsys.readouterr().err.count("draws from its own generator (seed=1)") == 1

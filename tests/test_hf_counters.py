"""A ``Trainer`` subclass's own counters across a kill: TRL's real ``SFTTrainer``.

``SFTTrainer`` keeps, beside ``TrainerState``, ``self._metrics`` (entropy and token accuracy per step,
averaged into the next log) and ``self._total_train_tokens`` (logged as ``num_tokens``). keepalive finds
the attributes no ``transformers`` class defines, tracks those that change during training, saves the
plain ones with each checkpoint (their values at the step's boundary) and puts them back on resume
(``keepalive.callbacks._hf_counters``); objects are named once.

``tests/scripts/hf_sft_train.py``: a tiny GPT-2 from a config, a word-level tokenizer built in memory
(no download), 40 texts of varying length, 2 epochs of 10 steps, a log every 3 steps, saves every step.

* SIGKILL mid-training (twice), re-run until done: ``log_history`` (``num_tokens``, entropy, accuracy,
  losses, the final summary) and the weights bit-identical to an uninterrupted run without keepalive;
* control: the same with the counters not saved: ``log_history`` differs (``num_tokens`` restarts);
* unit: an object attribute of a subclass that changes is named once, a plain one is not.
"""
from __future__ import annotations

import os

import pytest

import hfkit
from crashkit import assert_same

torch = hfkit.importorskip("transformers", "trl", "datasets")

SCRIPT = os.path.join(hfkit.SCRIPTS, "hf_sft_train.py")
TOTAL = 20

#: the children fork from a server that has imported torch, transformers' Trainer and TRL (most of a
#: child's CPU time)
forked_children = hfkit.forked_children_fixture(["torch", "transformers.trainer", "datasets",
                                                 "trl.trainer.sft_trainer"])


def _run(tmp_path, name, *extra, kills=0, seed=0):
    result, _ = hfkit.run_script(SCRIPT, tmp_path / name, *extra, total=TOTAL, kills=kills, seed=seed,
                                 kill_after_commit=4)
    return result


def _max_delta(a, b):
    return max(abs(x.get(k, 0) - y.get(k, 0)) for x, y in zip(a["log_history"], b["log_history"])
               for k in ("num_tokens", "entropy", "mean_token_accuracy") if k in x or k in y)


@pytest.mark.slow
def test_sft_trainers_counters_survive_sigkill_and_the_control_differs(tmp_path):
    ref = _run(tmp_path, "plain", "--plain")
    assert ref["global_step"] == TOTAL and any("num_tokens" in e for e in ref["log_history"])
    got = _run(tmp_path, "killed", kills=2, seed=11)
    assert_same(ref["log_history"], got["log_history"], "log_history")
    assert_same(ref, got)
    control = _run(tmp_path, "control", "--no-counters", kills=1, seed=11)
    delta = _max_delta(ref, control)
    print(f"control: max |delta| of num_tokens / entropy / accuracy in log_history = {delta}")
    assert delta > 0, "without the trainer's counters saved the log history should differ"


def test_an_object_that_changes_is_named_once_and_a_plain_counter_is_saved(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    from keepalive.callbacks.transformers import DriveCheckpoint

    class Tally:
        def __init__(self):
            self.n = 0

    class Counting(Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.seen_tokens = 0
            self.tally = Tally()
            self.tag = "fixed"

        def compute_loss(self, model, inputs, *a, **kw):
            self.seen_tokens += int(inputs["input_ids"].numel())
            self.tally = Tally()  # a new object every step
            return super().compute_loss(model, inputs, *a, **kw)

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=8))
    ids = torch.randint(0, 30, (16, 8), generator=torch.Generator().manual_seed(1))
    cb = DriveCheckpoint(str(tmp_path / "run"), every=2, quiet=True)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, num_train_epochs=1,
                             report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no")
    trainer = Counting(model=net, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                       callbacks=[cb])
    trainer.train()
    err = capsys.readouterr().err
    assert err.count("Counting.tally changes during training and is an object (Tally)") == 1, err
    assert "seen_tokens" not in err and "Counting.tag" not in err
    from keepalive.state import from_files
    from keepalive.store import CheckpointStore

    store = CheckpointStore(str(tmp_path / "run"))
    newest = max(store.list(), key=lambda info: info.step)
    saved = from_files(store.read_files(newest), copy=True)["hf"]["counters"]
    assert saved == {"seen_tokens": 16 * 8}, saved

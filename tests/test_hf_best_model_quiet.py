"""Hugging Face ``Trainer`` with ``load_best_model_at_end=True``: an uninterrupted run prints no warning.

The Trainer loads the best model's weights into the model (in place) after its last step. keepalive lets
the background copy of any save still in flight finish before that load (as an optimizer step waits for
it: ``keepalive.callbacks._hf_best``), so no save sees the best weights arrive and nothing is said; the
Trainer's evaluations and its own checkpoints at every epoch, keepalive's saves at every step, and the
final save after the load print no warning line. The case that must warn (a parameter changed in place
before its copy) stays covered by ``tests/test_lazy_transformers.py``.
"""
from __future__ import annotations

import hfkit

torch = hfkit.importorskip("transformers")

from lazykit import CHANGED  # noqa: E402

LAST = 18  # 24 samples, batch 4, 3 epochs


def _train(tmp_path, *, best: bool = True):
    """Saves at every step, the Trainer's evaluation and its own checkpoint at every epoch."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    from keepalive.callbacks.transformers import DriveCheckpoint

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=8))
    ids = torch.randint(0, 50, (24, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": x, "labels": x} for x in ids]
    cb = DriveCheckpoint(str(tmp_path / "run"), every=1, quiet=True)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, num_train_epochs=3,
                             learning_rate=1e-2, report_to=[], disable_tqdm=True, use_cpu=True,
                             eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=best,
                             metric_for_best_model="loss", greater_is_better=True,  # best: epoch 1, not the last
                             save_total_limit=2)
    trainer = Trainer(model=net, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[cb])
    trainer.train()
    assert cb.finished and trainer.state.global_step == LAST
    assert trainer.state.best_global_step != LAST  # the best weights were loaded into the model
    return cb, trainer


def _warnings(err):
    """keepalive's lines, less the run's announcement and the saves' cost: every=1 on a tiny model is
    this test's choice, and on a loaded machine its saves do cost most of the training (said then,
    rightly; keepalive/savecosts.py has its own tests)."""
    return [line for line in err.splitlines()
            if line.startswith("keepalive") and "protecting run" not in line and "saves cost" not in line]


def test_an_uninterrupted_run_loading_the_best_model_says_nothing(tmp_path, capsys):
    _train(tmp_path)
    err = capsys.readouterr().err
    assert CHANGED not in err and not _warnings(err), err

"""Hugging Face ``Trainer``: keepalive's ``DriveCheckpoint`` against the Trainer's own checkpoints.

1. Stall per save: how long training waits for one checkpoint of the same state (model, AdamW state,
   scheduler, RNG, trainer state): the Trainer's ``_save_checkpoint`` (synchronous: safetensors + torch
   files in ``output_dir``) vs keepalive's save (the copy to host memory; the write goes on in the
   background, its duration printed apart).
2. Resume in the middle of a long epoch: from ``train()`` to the first optimizer step after the
   restart, ``resume_from_checkpoint=`` (the Trainer's ``skip_first_batches``: its ``SkipBatchSampler``
   walks the epoch's order batch by batch up to the saved one) vs keepalive's positioned sampler (the
   saved batch's slice of the order). Also the data positioning alone.

    python benchmarks/transformers_checkpoint.py                      # ~25M-parameter GPT-2, 2M samples
    python benchmarks/transformers_checkpoint.py --layers 2 --width 128 --samples 200000   # quick

Prints the figures and the ratios (theirs / ours). CPU; no downloads (a model built from a config).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

for _name in ("torchvision::nms", "torchvision::qnms"):  # a CUDA torchvision next to a CPU torch
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - defined already, or a working torchvision
        pass

from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from keepalive.callbacks.transformers import DriveCheckpoint  # noqa: E402

hf_logging.set_verbosity_error()
p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=6)
p.add_argument("--width", type=int, default=512)
p.add_argument("--vocab", type=int, default=8000)
p.add_argument("--samples", type=int, default=2_000_000, help="training samples (one long epoch)")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--repeat", type=int, default=3)
opts = p.parse_args()
SEQ = 16


class Tokens(Dataset):
    """A long synthetic token dataset (tokens made per item: no memory for millions of rows)."""

    def __len__(self):
        return opts.samples

    def __getitem__(self, i):
        ids = torch.arange(i, i + SEQ) % opts.vocab
        return {"input_ids": ids, "labels": ids}


def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=8,
                                      vocab_size=opts.vocab, n_positions=SEQ))


def trainer(out, callbacks=(), max_steps=4, save_steps=10**9):
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=opts.batch, max_steps=max_steps,
                             learning_rate=1e-4, report_to=[], disable_tqdm=True, use_cpu=True,
                             save_strategy="steps", save_steps=save_steps, logging_steps=10**9)
    return Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=list(callbacks))


class FirstStep(TrainerCallback):
    """Time from the start of train() to the end of its first optimizer step."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds = None

    def on_step_end(self, args, state, control, **kw):
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.t0
            control.should_training_stop = True


def stall(tmp):
    print(f"model: {sum(p.numel() for p in model().parameters()) / 1e6:.1f}M parameters, AdamW")
    # the Trainer's own save of the state after 2 steps
    t = trainer(os.path.join(tmp, "hf-stall"), max_steps=2)
    t.train()
    theirs = []
    for _ in range(opts.repeat):
        t0 = time.perf_counter()
        t._save_checkpoint(t.model, trial=None)
        theirs.append(time.perf_counter() - t0)
        t.state.global_step += 1  # a new folder each time
    # keepalive's: the same state, the save the callback makes at a step boundary
    cb = DriveCheckpoint(os.path.join(tmp, "ka-stall"), quiet=True, keep=2)
    t = trainer(os.path.join(tmp, "hf-unused"), callbacks=[cb], max_steps=2)
    t.args.save_strategy = "no"
    t.train()
    ours, writes = [], []
    cb._active = True  # as inside train(): the capture reads the trainer
    for _ in range(opts.repeat + 1):
        cb.core.counters["step"] += 1
        t0 = time.perf_counter()
        cb.core.save(cb.capture, reason="benchmark")
        ours.append(time.perf_counter() - t0)
        cb.core.flush()
        writes.append(time.perf_counter() - t0)
    cb._active = False
    cb.close()
    first, steady = ours[0], statistics.median(ours[1:])
    hf = statistics.median(theirs)
    print(f"stall per save: Trainer._save_checkpoint {hf * 1000:.0f} ms | keepalive {steady * 1000:.0f} ms "
          f"(first save {first * 1000:.0f} ms; background write {statistics.median(writes[1:]) * 1000:.0f} ms)"
          f" -> ratio {hf / steady:.1f}x")


def resume(tmp):
    steps_per_epoch = -(-opts.samples // opts.batch)
    at = steps_per_epoch // 2  # the middle of the long epoch
    print(f"resume at step {at} of a {steps_per_epoch}-step epoch ({opts.samples} samples)")
    # a checkpoint at step `at` of each kind: one real step, then its counters moved to `at`
    hf_dir = os.path.join(tmp, "hf-resume")
    trainer(hf_dir, max_steps=1, save_steps=1).train()
    ckpt = os.path.join(hf_dir, f"checkpoint-{at}")
    os.rename(os.path.join(hf_dir, "checkpoint-1"), ckpt)
    state_file = os.path.join(ckpt, "trainer_state.json")
    with open(state_file) as f:
        state = json.load(f)
    state.update(global_step=at, max_steps=at + 10, epoch=at / steps_per_epoch)
    with open(state_file, "w") as f:
        json.dump(state, f)
    first = FirstStep()
    t = trainer(hf_dir, callbacks=[first], max_steps=at + 10)
    first.t0 = time.perf_counter()
    t.train(resume_from_checkpoint=ckpt)
    theirs = first.seconds

    ka_dir = os.path.join(tmp, "ka-resume")
    cb = DriveCheckpoint(ka_dir, quiet=True, every=1)

    class Jump(TrainerCallback):  # the first save says "step `at`, batch `at` of epoch 0"
        def on_step_end(self, args, state, control, **kw):
            state.global_step = at
            cb._batches = at - 1  # the callback counts this step's batch next
            control.should_training_stop = True

        def on_train_end(self, args, state, control, **kw):
            cb.core.stopped = True  # no end-of-training save: the checkpoint stays "inside the epoch"

    t = trainer(os.path.join(tmp, "unused"), callbacks=[Jump(), cb], max_steps=at + 10)
    t.args.save_strategy = "no"
    t.train()
    cb.close()
    first = FirstStep()
    cb = DriveCheckpoint(ka_dir, quiet=True, every=10**9)
    t = trainer(os.path.join(tmp, "unused"), callbacks=[cb, first], max_steps=at + 10)
    t.args.save_strategy = "no"
    first.t0 = time.perf_counter()
    t.train()
    ours = first.seconds
    assert t.state.global_step == at + 1, t.state.global_step
    cb.close()
    print(f"train() to the first step after the resume: resume_from_checkpoint {theirs:.2f} s | keepalive "
          f"{ours:.2f} s -> ratio {theirs / ours:.1f}x")

    # the data positioning alone: to the first batch of the resumed epoch
    from accelerate.data_loader import skip_first_batches

    from keepalive.callbacks import _hf_data

    t = trainer(os.path.join(tmp, "unused"), max_steps=1)
    dl = t.get_train_dataloader()
    t0 = time.perf_counter()
    next(iter(skip_first_batches(dl, at)))
    skip = time.perf_counter() - t0
    dl = t.get_train_dataloader()
    sampler, why = _hf_data.install(dl, 0)
    assert sampler is not None, why
    t0 = time.perf_counter()
    sampler.start = sampler.placeholders = at
    next(iter(skip_first_batches(dl, at)))
    positioned = time.perf_counter() - t0
    print(f"to the first batch at step {at}: skip_first_batches {skip * 1000:.0f} ms | positioned sampler "
          f"{positioned * 1000:.0f} ms -> ratio {skip / positioned:.1f}x")


if __name__ == "__main__":
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    tmp = tempfile.mkdtemp(prefix="ka-hf-bench-")
    try:
        stall(tmp)
        resume(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

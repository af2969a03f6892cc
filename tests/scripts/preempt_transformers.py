"""A Hugging Face ``Trainer`` fine-tuning whose evaluation is slow, for the "save during evaluation" tests: a
tiny GPT-2 built from a config (random weights, dropout), synthetic tokens, gradient accumulation 2, a linear
warmup schedule, ``eval_strategy="epoch"`` over 8 evaluation batches. ``--slow-eval S``: each evaluation
batch takes S seconds more (a forward pre-hook that sleeps in eval mode only: weights and random draws are
untouched). Prints ``STEP n``, ``EVAL START t`` / ``EVAL END t`` (wall-clock time), ``COMMITTED step t``,
and at the end writes the trainable weights, the optimizer state, the log history (without timings), a
final random draw and the epoch counter.

``--mode plain``: no keepalive (the reference). ``--deadline-in-eval S``: the session's deadline falls S
seconds after the first evaluation starts (none before). ``--counter``: a stateful callback after keepalive's
counts epochs at each epoch end, i.e. after the last step's boundary and before the evaluation.
``--no-pause-save``: keepalive's saves between steps switched off (the control: saved after the evaluation).
``--broken-fingerprint``: keepalive's fingerprint blind to the objects' state (the control: a save during the
evaluation that is not the last boundary's state). ``--eval-steps N``: ``eval_strategy="steps"`` every N steps.
``--eval-samples N``: the evaluation's batches (of one sample). ``--no-gate``: the Trainer's optimizer is not
gated (the control: the core's guard thread may not save for the loop).
"""
import argparse
import json
import random
import time

import numpy as np
import torch

# The registry's torchvision is a CUDA build: next to this CPU torch its import fails unless the op
# schemas exist first (DESIGN.md; transformers imports it when installed). Tests only.
for _name in ("torchvision::nms", "torchvision::qnms"):
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
from childio import emit
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers import logging as hf_logging
from transformers.trainer_callback import ExportableState

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--mode", default="keepalive", choices=["keepalive", "plain"])
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--slow-eval", type=float, default=0.0)
p.add_argument("--deadline-in-eval", type=float, default=None)
p.add_argument("--counter", action="store_true")
p.add_argument("--no-pause-save", action="store_true")
p.add_argument("--broken-fingerprint", action="store_true")
p.add_argument("--eval-steps", type=int, default=None)
p.add_argument("--eval-samples", type=int, default=8)
p.add_argument("--no-gate", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)
hf_logging.set_verbosity_error()

SEQ, VOCAB = 16, 100


class Tokens(Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Steps(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        emit(f"STEP {state.global_step}")


class EpochCounter(TrainerCallback, ExportableState):
    """Stateful (saved and restored by keepalive with the other callbacks' states); its epoch-end hook runs
    after keepalive's, so between the last step's boundary and the evaluation."""

    def __init__(self):
        self.epochs = 0

    def on_epoch_end(self, a, state, control, **kw):
        self.epochs += 1

    def state(self):
        return {"args": {}, "attributes": {"epochs": self.epochs}}


DEADLINE = None


def remaining():
    return None if DEADLINE is None else DEADLINE - time.time()


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
if args.slow_eval:
    model.register_forward_pre_hook(lambda m, _: None if m.training else time.sleep(args.slow_eval))
targs = TrainingArguments(
    output_dir=args.run + "-hf-unused", per_device_train_batch_size=4, per_device_eval_batch_size=1,
    gradient_accumulation_steps=2, num_train_epochs=args.epochs, learning_rate=5e-3, lr_scheduler_type="linear",
    warmup_steps=2, logging_steps=2, report_to=[], disable_tqdm=True, use_cpu=True,
    seed=42, save_strategy="no", dataloader_num_workers=0,
    **({"eval_strategy": "steps", "eval_steps": args.eval_steps} if args.eval_steps else {"eval_strategy": "epoch"}))
callbacks = [Steps()]
ckpt = None
if args.mode == "keepalive":
    from keepalive.callbacks.transformers import DriveCheckpoint

    if args.no_pause_save:
        from keepalive import pauses
        from keepalive.core import Checkpointer

        pauses.PAUSE_SECONDS = 1e9
        Checkpointer._pause_save = lambda self, capture, in_thread: None
    if args.no_gate:
        import keepalive.callbacks.transformers as adapter

        adapter.gate_steps = lambda core, optimizer: None
    if args.broken_fingerprint:
        right = DriveCheckpoint._fingerprint
        DriveCheckpoint._fingerprint = lambda self: (None, right(self)[1])
    ckpt = DriveCheckpoint(args.run, every="epoch", remaining_fn=remaining, deadline_margin="2s")
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step} {time.time():.3f}"))
    callbacks.append(ckpt)
counter = EpochCounter()
if args.counter:
    callbacks.append(counter)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(32, 7), eval_dataset=Tokens(args.eval_samples, 8),
                  callbacks=callbacks)
evaluate = trainer.evaluate


def announced_evaluate(*a, **kw):
    global DEADLINE
    if args.deadline_in_eval is not None and DEADLINE is None:
        DEADLINE = time.time() + args.deadline_in_eval
    emit(f"EVAL START {time.time():.3f}")
    try:
        return evaluate(*a, **kw)
    finally:
        emit(f"EVAL END {time.time():.3f}")


trainer.evaluate = announced_evaluate  # the Trainer's epoch-end evaluation calls self.evaluate
try:
    trainer.train()
except SystemExit:  # keepalive's exit (143) after a SIGTERM or a stop before the end
    if ckpt is not None and ckpt.stopped:
        print("STOPPED", flush=True)
    raise

from safetensors.torch import save_file  # noqa: E402

weights = {k: v.detach().contiguous() for k, v in trainer.model.named_parameters()}
for i, st in trainer.optimizer.state_dict()["state"].items():
    for k, v in st.items():
        if torch.is_tensor(v):
            weights[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1).clone()
save_file(weights, args.out)
timing = ("_runtime", "_per_second")
logs = [{k: v for k, v in e.items() if not k.endswith(timing)} for e in trainer.state.log_history
        if "train_runtime" not in e]
with open(args.out + ".json", "w") as f:
    json.dump({"log_history": logs, "global_step": trainer.state.global_step, "epochs_counted": counter.epochs,
               "draw": [torch.rand(3).tolist(), random.random(), float(np.random.rand())]}, f)
print("DONE", flush=True)

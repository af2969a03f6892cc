"""A fastai ``fit_one_cycle`` whose validation of one epoch is slow, for the "save during evaluation"
tests (tests/test_preempt_fastai.py): the learner of fastai_setup.py (dropout, batch norm, shuffling,
augmentation from every global RNG), with a callback that sleeps after each validation batch of
``--slow-epoch`` (after keepalive's hooks: a slow metric or a slow validation forward).

Prints ``STEP n`` after each optimizer step with its loss (``LOSS n <hex>``), ``COMMITTED n <time>``
after each checkpoint commit, ``EVAL START <time>`` / ``EVAL END <time>`` around the slow validation;
at the end writes the weights and the optimizer's state (safetensors), and the Recorder history plus
one random draw of each global generator (JSON). ``--no-keepalive``: the same training without it
(the reference)."""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
from childio import emit
from fastai.callback.core import Callback
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 - patches Learner.fit_one_cycle
from fastai_setup import history, make_learner, weights
from safetensors.torch import save_file

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--n-train", type=int, default=64)
p.add_argument("--n-valid", type=int, default=64)
p.add_argument("--slow-epoch", type=int, default=-1, help="the epoch whose validation is slow")
p.add_argument("--eval-seconds", type=float, default=9.0, help="how long the slow validation sleeps in all")
p.add_argument("--slow-prologue", type=float, default=0.0, help="seconds the prologue of --slow-epoch's "
               "training pass sleeps (before its first batch: workers starting, a slow first fetch)")
p.add_argument("--every", default="epoch")
p.add_argument("--deadline-in", type=float, default=None,
               help="the session's deadline: this many seconds after the slow validation starts")
p.add_argument("--touch", action="store_true", help="negative control: a weight is changed in place "
               "(by x1.0: same values, a new version) in after_train, before the slow validation")
p.add_argument("--no-pause-save", action="store_true", help="negative control: saves between steps off")
p.add_argument("--no-keepalive", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

deadline = math.inf  # set when the slow validation starts


class SlowValidation(Callback):
    order = 200  # after DriveCheckpoint (95): its hooks do not see the sleep coming

    def before_train(self):
        if self.epoch == args.slow_epoch and args.slow_prologue:
            emit(f"PROLOGUE START {time.time():.3f}")
            time.sleep(args.slow_prologue)
            emit(f"PROLOGUE END {time.time():.3f}")

    def after_train(self):
        if self.epoch == args.slow_epoch and args.touch:
            with torch.no_grad():
                next(self.learn.model.parameters()).mul_(1.0)

    def before_validate(self):
        global deadline
        if self.epoch == args.slow_epoch and args.eval_seconds:
            now = time.time()
            if args.deadline_in is not None:
                deadline = now + args.deadline_in
            emit(f"EVAL START {now:.3f}")

    def after_batch(self):
        if self.training:
            emit(f"LOSS {self.learn.train_iter} {float(self.learn.loss.detach()).hex()}")
            emit(f"STEP {self.learn.train_iter}")
        elif self.epoch == args.slow_epoch and args.eval_seconds:
            time.sleep(args.eval_seconds / len(self.dl))

    def after_validate(self):
        if self.epoch == args.slow_epoch and args.eval_seconds:
            emit(f"EVAL END {time.time():.3f}")


ckpt = None
cbs = [SlowValidation()]
if not args.no_keepalive:
    if args.no_pause_save:
        import keepalive.pauses
        from keepalive.core import Checkpointer

        keepalive.pauses.PAUSE_SECONDS = 1e9
        Checkpointer._pause_save = lambda self, capture, in_thread: None  # type: ignore[method-assign]
    from keepalive.callbacks.fastai import DriveCheckpoint

    every = int(args.every) if args.every.isdigit() else args.every
    ckpt = DriveCheckpoint(args.run, every=every, remaining_fn=lambda: deadline - time.time(), deadline_margin="2s")
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step} {time.time():.3f}"))
    cbs = [ckpt] + cbs
learn = make_learner(seed=42, n_train=args.n_train, n_valid=args.n_valid,
                     path=os.path.dirname(os.path.abspath(args.out)))
if hasattr(learn, "progress"):
    learn.remove_cb(learn.progress)
try:
    learn.fit_one_cycle(args.epochs, 3e-3, cbs=cbs)
except SystemExit as exc:  # keepalive's exit after a SIGTERM or a stop before the end: when the call ended
    emit(f"EXIT {exc.code} {time.time():.3f}")
    if ckpt is not None and ckpt.stopped:
        emit("STOPPED")
    raise
tensors = weights(learn)
for i, s in enumerate(learn.opt.state_dict()["state"]):
    for k, v in s.items():
        if isinstance(v, torch.Tensor):
            tensors[f"opt.{i}.{k}"] = v.detach().clone().contiguous()
save_file(tensors, args.out)
with open(args.out + ".json", "w") as f:
    json.dump(dict(history(learn), draws=[random.random(), float(np.random.rand()), torch.rand(1).item()]), f)
emit("DONE")

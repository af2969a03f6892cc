"""A real fastai training for crash tests: ``fit_one_cycle`` / ``fine_tune`` / ``fit_flat_cos`` of the
learner in fastai_setup.py (dropout, shuffling, augmentation in the main process or in DataLoader
workers, batch transforms), with tracker callbacks. Prints `STEP n` after each optimizer step and
`COMMITTED n` after each checkpoint commit; writes the final weights (safetensors) and the Recorder
history (JSON) next to each other."""
import argparse
import json
import os
import sys
import time

import torch
from childio import emit
from fastai.callback.core import Callback
from fastai.callback.tracker import EarlyStoppingCallback, SaveModelCallback
from fastai_setup import history, make_learner, weights
from safetensors.torch import save_file

from keepalive.callbacks.fastai import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--mode", default="one_cycle", choices=["one_cycle", "fine_tune", "flat_cos"])
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--freeze-epochs", type=int, default=1)
p.add_argument("--every", default="epoch")
p.add_argument("--workers", type=int, default=0)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--n-train", type=int, default=96)
p.add_argument("--seed", type=int, default=42)
p.add_argument("--fp16", action="store_true")
p.add_argument("--trackers", action="store_true")
p.add_argument("--in-learner", action="store_true", help="pass DriveCheckpoint to Learner(cbs=)")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--break", dest="breaks", default="", help="negative control: dl_rng = do not restore "
               "the fastai DataLoader RNG")
args = p.parse_args()
torch.set_num_threads(1)
if args.breaks == "dl_rng":
    import keepalive.callbacks._fastai_data as _fastai_data

    _fastai_data.set_dl_rngs = lambda learn, states: None


class AtomicSaveModel(SaveModelCallback):
    """fastai's SaveModelCallback, writing its file atomically (a SIGKILL mid-write must not leave a
    torn model file behind: that would be a test artefact, not what is tested)."""

    def _save(self, name):
        final = self.learn.path / self.learn.model_dir / f"{name}.pth"
        tmp = self.learn.save(f"{name}.tmp{os.getpid()}", with_opt=self.with_opt)
        os.replace(tmp, final)
        self.last_saved_path = final


class PrintSteps(Callback):
    order = 200

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def after_batch(self):
        if self.learn.training:
            emit(f"STEP {self.ckpt.counters['step'] + 1}")
            if args.sleep:
                time.sleep(args.sleep)


every = int(args.every) if args.every.isdigit() else args.every
ckpt = DriveCheckpoint(args.run, every=every)
ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
cbs = [PrintSteps(ckpt)]
if args.trackers:
    cbs += [AtomicSaveModel(monitor="valid_loss"),
            EarlyStoppingCallback(monitor="valid_loss", min_delta=0.002, patience=2)]
learn = make_learner(seed=args.seed, n_train=args.n_train, workers=args.workers, hidden=args.hidden,
                     path=os.path.dirname(os.path.abspath(args.out)),
                     cbs=[ckpt] if args.in_learner else None)
if hasattr(learn, "progress"):
    learn.remove_cb(learn.progress)
if args.fp16:
    learn.to_fp16()
run_cbs = cbs if args.in_learner else [ckpt] + cbs
if args.mode == "one_cycle":
    learn.fit_one_cycle(args.epochs, 3e-3, cbs=run_cbs)
elif args.mode == "flat_cos":
    learn.fit_flat_cos(args.epochs, 3e-3, cbs=run_cbs)
else:
    learn.fine_tune(args.epochs, 3e-3, freeze_epochs=args.freeze_epochs, cbs=run_cbs)
if ckpt.stopped:
    print("STOPPED", flush=True)
    sys.exit(3)
save_file(weights(learn), args.out)
with open(args.out + ".json", "w") as f:
    json.dump(history(learn), f)
print("DONE", flush=True)

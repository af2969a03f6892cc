"""A Hugging Face ``Trainer`` beside its own checkpoints, for the stage crash tests: a tiny GPT-2 built from a
config (random weights), synthetic tokens, 44 samples, batch 4, accumulation 2 (6 steps an epoch), 3 epochs,
a linear warmup schedule, dropout, a loss logged every step. Prints ``STEP n`` after each optimizer step and
``COMMITTED n`` after each keepalive commit; at the end writes the trainable weights (safetensors) and the
log history without timings (JSON).

``--guard``: the notebook guard ``trainer.train(resume_from_checkpoint=get_last_checkpoint(out) or None)``
with the Trainer's own checkpoints every ``--save-steps`` steps. ``--best``: evaluation and the Trainer's
checkpoints every 2 steps, ``load_best_model_at_end``, ``eval_on_start``. ``--kill-at N``: the process
SIGKILLs itself after step N (its boundary saved first when keepalive saves every step).
``--mode plain``: without keepalive. Controls: ``--control-ignore-trainer`` (keepalive unaware of the
Trainer's own resume), ``--control-no-best`` (the best model's weights not kept), ``--control-eval-again``
(``eval_on_start`` left on after a resume).
"""
import argparse
import json
import os
import signal

import torch

for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
from childio import emit
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments
from transformers import logging as hf_logging

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--out", required=True)
p.add_argument("--mode", default="keepalive", choices=["keepalive", "plain"])
p.add_argument("--every", type=int, default=2)
p.add_argument("--guard", action="store_true")
p.add_argument("--save-steps", type=int, default=3)
p.add_argument("--best", action="store_true")
p.add_argument("--kill-at", type=int, default=0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--control-ignore-trainer", action="store_true")
p.add_argument("--control-no-best", action="store_true")
p.add_argument("--control-eval-again", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)
hf_logging.set_verbosity_error()
SEQ, VOCAB = 8, 50


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
        if args.sleep:
            import time

            time.sleep(args.sleep)

    def on_step_begin(self, a, state, control, **kw):
        # called after the previous step's boundary (keepalive saves it before the next batches are made)
        if args.kill_at and state.global_step == args.kill_at:
            if ckpt is not None:
                ckpt.core.flush()
            os.kill(os.getpid(), signal.SIGKILL)


from transformers import GPT2Config, GPT2LMHeadModel, Trainer  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

hf_out = os.path.join(args.root, "hf")
own = {"save_strategy": "steps", "save_steps": args.save_steps} if args.guard else {"save_strategy": "no"}
if args.best:
    own = {"save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2,
           "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "eval_on_start": True}
targs = TrainingArguments(output_dir=hf_out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_train_epochs=3, learning_rate=5e-2 if args.best else 1e-2, lr_scheduler_type="linear",
                          warmup_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, seed=42,
                          **own)
callbacks = [Steps()]
ckpt = None
if args.mode == "keepalive":
    from keepalive.callbacks import transformers as kt

    if args.control_ignore_trainer:
        kt.TrainersResume.of = staticmethod(lambda loop, state: None)
    if args.control_no_best:
        kt.DriveCheckpoint.on_save = lambda self, *a, **k: None
    if args.control_eval_again:
        kt.DriveCheckpoint._change = lambda self, obj, name, value: None
    ckpt = kt.DriveCheckpoint(os.path.join(args.root, "ka"), every=args.every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(44, 7),
                  eval_dataset=Tokens(8, 9) if args.best else None, callbacks=callbacks)
last = get_last_checkpoint(hf_out) if args.guard and os.path.isdir(hf_out) else None
trainer.train(resume_from_checkpoint=last)

from safetensors.torch import save_file  # noqa: E402

save_file({k: v.detach().contiguous() for k, v in trainer.model.named_parameters()}, args.out)
logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
        for e in trainer.state.log_history if "train_runtime" not in e]
with open(args.out + ".json", "w") as f:
    json.dump({"log_history": logs, "global_step": trainer.state.global_step,
               "best": trainer.state.best_global_step}, f)
print("DONE", flush=True)

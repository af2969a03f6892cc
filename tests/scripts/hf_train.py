"""A Hugging Face ``Trainer`` fine-tuning for crash tests: a tiny GPT-2 causal LM (or a BERT sequence
classifier, or GPT-2 with a LoRA adapter) built from a config with random weights, synthetic token
data, gradient accumulation 2, a linear warmup schedule, dropout, logging every 2 steps. Prints
``STEP n`` after each optimizer step and ``COMMITTED n`` after each keepalive commit, and at the end
writes the trainable weights, the optimizer state and the log history (without timings).

``--mode keepalive`` (default): ``callbacks=[DriveCheckpoint(run)]``.
``--mode hf``: the Trainer's own checkpoints (``save_steps``) and ``resume_from_checkpoint=True`` when
one exists — the side-by-side comparison.
"""
import argparse
import json
import os
import sys
import time

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
from transformers import TrainerCallback, TrainingArguments
from transformers import logging as hf_logging

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--model", default="gpt2", choices=["gpt2", "bert", "lora"])
p.add_argument("--mode", default="keepalive", choices=["keepalive", "hf"])
p.add_argument("--every", default="3")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=44)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--margin", default=None)
p.add_argument("--budget", default=None)
args = p.parse_args()
torch.set_num_threads(1)
hf_logging.set_verbosity_error()

SEQ, VOCAB = 16, 100


class Tokens(Dataset):
    """Synthetic token sequences (and labels for the classifier)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.cls = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if args.model == "bert":
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                    "labels": self.cls[i]}
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model():
    torch.manual_seed(0)
    if args.model == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)
        return BertForSequenceClassification(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    if args.model == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                 lora_dropout=0.1, fan_in_fan_out=True))
    return model


class Steps(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        emit(f"STEP {state.global_step}")
        if args.sleep:
            time.sleep(args.sleep)


hf_out = os.path.join(args.run, "hf") if args.mode == "hf" else os.path.join(os.path.dirname(args.out), "hf-unused")
targs = TrainingArguments(
    output_dir=hf_out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
    num_train_epochs=args.epochs, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=4,
    logging_steps=2, report_to=[], disable_tqdm=True, use_cpu=True, seed=42,
    save_strategy="steps" if args.mode == "hf" else "no", save_steps=int(args.every),
    dataloader_num_workers=0)

from transformers import Trainer  # noqa: E402

callbacks = [Steps()]
ckpt = None
if args.mode == "keepalive":
    from keepalive.callbacks.transformers import DriveCheckpoint

    if args.budget:
        from keepalive import session

        session.configure(budget=args.budget, start=time.time())
    every = int(args.every) if args.every.isdigit() else args.every
    ckpt = DriveCheckpoint(args.run, every=every, deadline_margin=args.margin)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)
model = build_model()
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(args.samples), callbacks=callbacks)
resume = None
if args.mode == "hf":
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(hf_out) if os.path.isdir(hf_out) else None
    if last is not None:
        resume = True
        # the line crashkit reads for where a restart resumed (keepalive prints it for its own runs)
        step = int(last.rsplit("-", 1)[1])
        batches = -(-args.samples // args.batch)
        per_epoch = -(-batches // args.accum)
        emit(f"HF: resuming run hf from {os.path.basename(last)}: epoch {step // per_epoch}, step {step}")
trainer.train(resume_from_checkpoint=resume)
if ckpt is not None and ckpt.stopped:
    from keepalive import session

    print(f"STOPPED remaining {session.remaining_seconds():.3f}", flush=True)
    sys.exit(3)

from safetensors.torch import save_file  # noqa: E402

weights = {k: v.detach().contiguous() for k, v in trainer.model.named_parameters() if v.requires_grad}
opt = trainer.optimizer.state_dict()
for i, st in opt["state"].items():
    for k, v in st.items():
        if torch.is_tensor(v):
            weights[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1).clone()
save_file(weights, args.out)
logs = [e for e in trainer.state.log_history if "train_runtime" not in e]
summary = [e for e in trainer.state.log_history if "train_runtime" in e]
with open(args.out + ".json", "w") as f:
    json.dump({"log_history": logs, "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
               "train_loss": summary[-1]["train_loss"] if summary else None,
               "lr": trainer.optimizer.param_groups[0]["lr"]}, f)
print("DONE", flush=True)

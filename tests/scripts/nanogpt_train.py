"""nanoGPT's ``train.py`` shape, as written, with keepalive: the child of tests/test_nanogpt_shape.py.

The training loop runs at the top level of this script, as nanoGPT's does: a batch drawn before the
loop and again after each micro-step's forward (``X, Y = get_batch('train')``, from a ``np.memmap``
with ``torch.randint``), gradient accumulation, bf16 autocast (on the CPU), the learning rate set by
hand each iteration (``get_lr(iter_num)``), ``estimate_loss()`` every few iterations and
``best_val_loss`` / ``local_iter_num`` / ``running_mfu`` kept as plain variables of the script. Only
``while True`` became ``for iter_num in ckpt.iterations(max_iters)``.

``--kill-eval K`` / ``--kill-micro K``: SIGKILL inside ``estimate_loss()`` at iteration K / between the
micro-steps of iteration K (after the newest save is committed), so the kill points do not depend on
the machine's load. ``--control``: ``track_globals=False`` (the negative control). ``--in-main``: the
same loop (the lines between the markers) run inside ``def main():``. Each iteration's loss goes to
``--log`` (one line per write, the session's pid first); the end state to ``--out``.
"""
import argparse
import math
import os
import signal
import sys
import textwrap
import time

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from keepalive.callbacks.torch import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("--run", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--log", required=True)
p.add_argument("--kill-eval", type=int, default=None)
p.add_argument("--kill-micro", type=int, default=None)
p.add_argument("--control", action="store_true")
p.add_argument("--in-main", action="store_true")
p.add_argument("--every", type=int, default=3)
args = p.parse_args()

# config, as nanoGPT's (scaled down)
batch_size, block_size, gradient_accumulation_steps = 4, 16, 2
n_layer, n_head, n_embd, dropout, vocab_size = 2, 2, 32, 0.1, 64
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 1e-2, 12, 1e-1, 0.9, 0.95, 1.0
decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 3, 12, 1e-3
eval_interval, eval_iters, log_interval, always_save_checkpoint = 4, 2, 1, False
ctx = torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16)
torch.manual_seed(1337)
_LOG = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def log(*words) -> None:
    os.write(_LOG, (" ".join(str(w) for w in (os.getpid(), *words)) + "\n").encode())


def die(where: str) -> None:
    ckpt.flush()  # the newest save is committed: the resume starts from it
    log("KILL", where)
    os.kill(os.getpid(), signal.SIGKILL)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def attn(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(split):
    # nanoGPT: a new memmap every batch (a memory leak otherwise), torch.randint for the offsets
    data = np.memmap(os.path.join(args.data, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


model = GPT()
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(beta1, beta2))
scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16
ckpt = DriveCheckpoint(args.run, model=model, optimizer=optimizer, scaler=scaler, every=args.every,
                       track_globals=not args.control)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
            if args.kill_eval == iter_num and split == "val":
                die(f"estimate_loss {iter_num}")
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


iter_num = 0


def loop_source() -> str:
    """The training loop's lines below (for --in-main)."""
    lines = open(__file__).read().split("# ---- the loop ----\n")[1].split("# ---- end of the loop ----\n")[0]
    return lines


if args.in_main:
    exec("def main():\n    global iter_num\n" + textwrap.indent(loop_source(), "    ") + "\nmain()\n")
    log("DONE")
    sys.exit(0)

# ---- the loop ----
best_val_loss = 1e9
X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
local_iter_num = 0
raw_model = model
running_mfu = -1.0
for iter_num in ckpt.iterations(max_iters):
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        log("EVAL", iter_num, f"{losses['train']:.8f}", f"{losses['val']:.8f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "iter_num": iter_num,
                              "best_val_loss": best_val_loss}
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
        if args.kill_micro == iter_num and micro_step == 0:
            die(f"micro-step {iter_num}")
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5:
            running_mfu = 0.5 if running_mfu == -1.0 else 0.9 * running_mfu + 0.05
        log("ITER", iter_num, f"{lossf:.8f}")
    local_iter_num += 1
# ---- end of the loop ----

torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "best_val_loss": float(best_val_loss), "iter_num": iter_num}, args.out)
log("DONE")
print("DONE", flush=True)

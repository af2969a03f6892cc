"""Loops whose optimizer steps are not one per ``ckpt.batches()`` batch, for tests/test_step_counting.py.

One script, one ``--scenario`` per loop shape:

* ``zip``: semi-supervised, two shuffled loaders of different lengths zipped,
  ``for (xl, yl, il), (xu, iu) in zip(ckpt.batches(labeled), ckpt.batches(unlabeled))``, one optimizer
  step per pair (cross-entropy on the labeled batch + a consistency loss between two noisy, dropout
  views of the unlabeled batch).
* ``iters``: nanoGPT's loop, no DataLoader: ``for it in ckpt.epochs(max_iters)``, ``get_batch('train')``
  draws random offsets with ``torch.randint`` into a synthetic token tensor, a tiny GPT (dropout),
  AdamW, a warmup + cosine learning rate set by hand from ``it``, gradient clipping, and an
  ``estimate_loss()`` every ``EVAL_INTERVAL`` iterations (random batches of both splits, eval mode).
* ``randperm``: manual batching, ``perm = torch.randperm(N)`` at each epoch's start and
  ``for i in range(0, N, B): idx = perm[i:i + B]`` inside ``ckpt.epochs()``, a StepLR stepped per epoch.

The script keeps its own count of optimizer steps in ``ckpt.extras["opt_steps"]`` (incremented right
after each ``opt.step()``, saved and restored with the checkpoint): the test's measure of where a
checkpoint and a resume really are, whatever keepalive's own ``ckpt.step`` says.

Kills: ``--kill-after-steps K`` makes the process, in the body of its (K+1)-th step of this session
(forward and backward done, gradients pending, before ``opt.step()``), wait until the newest save is
committed (``ckpt.flush()``) and SIGKILL itself: a deterministic moment whatever the machine's load.

Outputs:
* ``--out``: ``torch.save`` of the final model / optimizer / scheduler states, ``ckpt.counters`` and
  ``ckpt.extras``.
* ``--log``: one line per event, appended by every session of a run, each starting with the session's
  pid: ``START epoch opt_steps ckpt.step`` when a session's first epoch begins, ``B opt_steps ckpt.step
  ...`` per optimizer step (the data it trained on), ``COMMIT epoch batch step reason`` per committed
  checkpoint (keepalive's counters in it), ``KILL opt_steps``.
* stdout: ``STEP n`` per optimizer step and ``COMMITTED n`` per commit (tests/crashkit.py reads them).

``--control X`` perturbs the resumed session from the outside (each a negative control: the test that
uses it must then fail to see bit-identical results).
"""
import argparse
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from childio import emit
from torch.utils.data import DataLoader, Dataset
from toydata import NoisyIndexed

from keepalive.callbacks.torch import DriveCheckpoint

CONTROLS = {
    "unlabeled-late": "zip: the resumed epoch's unlabeled stream starts one batch after its saved position",
    "reseed-on-resume": "the resumed session re-seeds the global RNGs as the script's start did (as if "
                        "keepalive had not restored them)",
}
SCENARIOS = ("zip", "iters", "randperm")

p = argparse.ArgumentParser()
p.add_argument("--scenario", required=True, choices=SCENARIOS)
p.add_argument("--run", required=True, help="the run folder")
p.add_argument("--out", required=True)
p.add_argument("--log", required=True)
p.add_argument("--every", default="epoch")
p.add_argument("--epochs", type=int, default=None, help="zip / randperm: epochs; iters: max_iters")
p.add_argument("--sleep", type=float, default=0.0, help="seconds per optimizer step (time-based saves)")
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--kill-after-steps", type=int, default=None,
               help="SIGKILL in the body of this session's next optimizer step after this many, once the "
                    "newest save is committed")
p.add_argument("--control", default=None, choices=sorted(CONTROLS))
args = p.parse_args()

torch.set_num_threads(1)


def seed_everything() -> None:
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)


seed_everything()

SESSION = os.getpid()
_LOG = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def log(*words) -> None:
    """One whole line per write (O_APPEND): the writer thread logs too."""
    os.write(_LOG, (" ".join(str(w) for w in (SESSION, *words)) + "\n").encode())


def indices(t) -> str:
    return ",".join(str(int(i)) for i in t)


def on_commit(result) -> None:
    meta = (result.info.manifest or {}).get("metadata", {})
    c = meta.get("counters", {})
    log("COMMIT", c.get("epoch"), c.get("batch"), c.get("step"), meta.get("reason", "?"))
    emit(f"COMMITTED {result.info.step}")


def checkpoint(**objects) -> DriveCheckpoint:
    ckpt = DriveCheckpoint(args.run, every=args.every, keep=None, **objects)
    hooks = getattr(getattr(ckpt.core, "writer", None), "on_commit", None)
    if isinstance(hooks, list):  # diagnostics only: the test reads the run folder itself
        hooks.append(on_commit)
    return ckpt


session_steps = 0
started = False


def session_start(ckpt, epoch: int) -> bool:
    """At each epoch's start: the first one of this session logs where it resumed; True if this session
    resumed a run that had optimizer steps (the perturbing controls act there)."""
    global started
    if started:
        return False
    started = True
    done = ckpt.extras.get("opt_steps", 0)
    log("START", epoch, done, ckpt.step)
    if done and args.control == "reseed-on-resume":
        seed_everything()
    return bool(done)


def before_step(ckpt) -> None:
    """Gradients computed, ``opt.step()`` next: the kill point."""
    if session_steps == args.kill_after_steps:
        ckpt.flush()  # the newest save is committed: the resume starts from it
        log("KILL", ckpt.extras.get("opt_steps", 0))
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(ckpt, *fields) -> None:
    """Right after ``opt.step()``: the script's own step count, carried in the checkpoint."""
    global session_steps
    session_steps += 1
    n = ckpt.extras.get("opt_steps", 0) + 1
    ckpt.extras["opt_steps"] = n
    log("B", n, ckpt.step, *fields)
    emit(f"STEP {n}")
    if args.sleep:
        time.sleep(args.sleep)


def finish(ckpt, **objects) -> None:
    if not ckpt.finished:
        print("NOT FINISHED", flush=True)
        sys.exit(3)
    state = {name: obj.state_dict() for name, obj in objects.items()}
    state["counters"] = dict(ckpt.counters)
    state["extras"] = dict(ckpt.extras)
    torch.save(state, args.out)


def mlp(dim: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(32, classes))


# ------------------------------------------------------------------------------------------ zip
DIM, CLASSES = 12, 3


class Labeled(NoisyIndexed):
    """Fixed inputs and labels; an item is (input + fresh noise, label, its index)."""

    def __init__(self, n: int):
        super().__init__(n, DIM, CLASSES, seed=11)


class Unlabeled(Dataset):
    """Fixed inputs, no labels; an item is (input + fresh noise, its index)."""

    def __init__(self, n: int):
        self.x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(12))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(DIM), i


LABELED, LABELED_BATCH = 48, 8        # 6 batches: the shorter loader, zip stops with it
UNLABELED, UNLABELED_BATCH = 100, 10  # 10 batches


def one_batch_late(ckpt, loader):
    """The control: ``ckpt.batches(loader)`` without its first batch."""
    batches = ckpt.batches(loader)
    next(batches)
    yield from batches


def zip_loaders() -> None:
    model = mlp(DIM, CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    labeled = DataLoader(Labeled(LABELED), batch_size=LABELED_BATCH, shuffle=True)
    unlabeled = DataLoader(Unlabeled(UNLABELED), batch_size=UNLABELED_BATCH, shuffle=True)
    ckpt = checkpoint(model=model, optimizer=opt)
    for epoch in ckpt.epochs(args.epochs or 3):
        resumed = session_start(ckpt, epoch)
        model.train()
        late = resumed and args.control == "unlabeled-late"
        # as written in a loop: the two generators belong to the zip alone (closed when it is freed)
        for (xl, yl, il), (xu, iu) in zip(ckpt.batches(labeled),
                                          one_batch_late(ckpt, unlabeled) if late else ckpt.batches(unlabeled)):
            supervised = F.cross_entropy(model(xl), yl)
            with torch.no_grad():  # Pi-model: two noisy views, dropout on both
                target = model(xu + 0.1 * torch.randn_like(xu)).softmax(-1)
            consistency = F.mse_loss(model(xu + 0.1 * torch.randn_like(xu)).softmax(-1), target)
            opt.zero_grad()
            (supervised + 2.0 * consistency).backward()
            before_step(ckpt)
            opt.step()
            after_step(ckpt, epoch, indices(il), indices(iu))
    finish(ckpt, model=model, optimizer=opt)


# ---------------------------------------------------------------------------------------- iters
VOCAB, BLOCK, BATCH, EMBD, HEADS = 24, 8, 4, 16, 2
EVAL_INTERVAL, EVAL_ITERS = 20, 2
LEARNING_RATE, MIN_LR, WARMUP = 3e-3, 3e-4, 10


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(EMBD), torch.nn.LayerNorm(EMBD)
        self.qkv, self.proj = torch.nn.Linear(EMBD, 3 * EMBD), torch.nn.Linear(EMBD, EMBD)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBD, 4 * EMBD), torch.nn.GELU(),
                                       torch.nn.Linear(4 * EMBD, EMBD), torch.nn.Dropout(0.1))
        self.attn_drop, self.resid_drop = torch.nn.Dropout(0.1), torch.nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK)).bool())

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = self.attn_drop(att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1))
        x = x + self.resid_drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, EMBD), torch.nn.Embedding(BLOCK, EMBD)
        self.drop, self.block = torch.nn.Dropout(0.1), Block()
        self.ln_f, self.head = torch.nn.LayerNorm(EMBD), torch.nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        logits = self.head(self.ln_f(self.block(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def iters() -> None:
    max_iters = args.epochs or 200
    tokens = torch.randint(VOCAB, (3000,), generator=torch.Generator().manual_seed(5))
    data = {"train": tokens[:2700], "val": tokens[2700:]}

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - BLOCK, (BATCH,))
        return torch.stack([d[i:i + BLOCK] for i in ix]), torch.stack([d[i + 1:i + 1 + BLOCK] for i in ix]), ix

    def get_lr(it):
        if it < WARMUP:
            return LEARNING_RATE * (it + 1) / (WARMUP + 1)
        ratio = (it - WARMUP) / (max_iters - WARMUP)
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            out[split] = sum(model(*get_batch(split)[:2]).item() for _ in range(EVAL_ITERS)) / EVAL_ITERS
        model.train()
        return out

    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = checkpoint(model=model, optimizer=opt)
    for it in ckpt.epochs(max_iters):
        session_start(ckpt, it)
        lr = get_lr(it)
        for group in opt.param_groups:
            group["lr"] = lr
        if it % EVAL_INTERVAL == 0:
            losses = estimate_loss()
            ckpt.extras["best_val_loss"] = min(losses["val"], ckpt.extras.get("best_val_loss", 1e9))
        x, y, ix = get_batch("train")
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before_step(ckpt)
        opt.step()
        after_step(ckpt, it, indices(ix))
    finish(ckpt, model=model, optimizer=opt)


# ------------------------------------------------------------------------------------- randperm
SAMPLES, PERM_BATCH = 64, 8  # 8 optimizer steps per epoch


def randperm() -> None:
    g = torch.Generator().manual_seed(13)
    inputs = torch.randn(SAMPLES, DIM, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    model = mlp(DIM, CLASSES)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    ckpt = checkpoint(model=model, optimizer=opt, scheduler=sched)
    for epoch in ckpt.epochs(args.epochs or 5):
        session_start(ckpt, epoch)
        model.train()
        perm = torch.randperm(SAMPLES)
        for i in range(0, SAMPLES, PERM_BATCH):
            idx = perm[i:i + PERM_BATCH]
            x = inputs[idx] + 0.05 * torch.randn(len(idx), DIM)
            opt.zero_grad()
            F.cross_entropy(model(x), labels[idx]).backward()
            before_step(ckpt)
            opt.step()
            after_step(ckpt, epoch, indices(idx))
        sched.step()
    finish(ckpt, model=model, optimizer=opt, scheduler=sched)


{"zip": zip_loaders, "iters": iters, "randperm": randperm}[args.scenario]()
print("DONE", flush=True)

"""Training children of tests/test_plain_objects.py and tests/test_unregistered.py: loops whose state
sits in objects keepalive is handed without a state_dict(), or not handed at all.

``--scenario nanogpt``: build-nanogpt's ``train_gpt2.py`` shape: its ``DataLoaderLite`` (token shards
from .npy files, ``current_shard`` / ``current_position``, ``next_batch()``), gradient accumulation,
one optimizer step per iteration of ``ckpt.epochs(max_steps)``; ``--unregistered``: the loader is
not registered. ``--scenario ema``: timm's ``train.py`` shape: a ``ModelEmaV3``-like EMA updated after
each optimizer step, a frozen teacher and a class-weighted loss beside it; ``--unregistered``: the EMA
is not registered. ``--kill-at N``: SIGKILL after the first micro-step (nanogpt) / batch (ema) of
iteration / step N, once the newest save is committed. ``--out``: the final state (torch.save).
The loop runs at the top level of the script, as in the originals.
"""
import argparse
import copy
import os
import signal

import numpy as np
import torch

from keepalive.callbacks.torch import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("--scenario", choices=("nanogpt", "ema"), required=True)
p.add_argument("--run", required=True)
p.add_argument("--out", required=True)
p.add_argument("--shards", default="")
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--unregistered", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(1337)


def watch_unregistered(ckpt):
    """What DriveCheckpoint does once its loop start and captures call the watch; done here by hand
    where they do not (yet): the same UnregisteredWatch, started with this script's variables."""
    if hasattr(ckpt, "_unregistered"):
        return
    from keepalive.callbacks._torch_unregistered import UnregisteredWatch

    watch = UnregisteredWatch(ckpt.core, ckpt.objects)
    states = ckpt._objects.states
    ckpt._objects.states = lambda: (watch.check(), states())[1]
    watch.start([globals()])


def kill_now(ckpt):
    ckpt.flush()  # the newest save is committed: the re-run resumes from it
    print("KILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------- build-nanogpt's data loader
def load_tokens(filename):
    npt = np.load(filename)
    npt = npt.astype(np.int32)
    return torch.tensor(npt, dtype=torch.long)


class DataLoaderLite:
    def __init__(self, B, T, process_rank, num_processes, split):
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        shards = sorted(s for s in os.listdir(args.shards) if split in s)
        self.shards = [os.path.join(args.shards, s) for s in shards]
        self.reset()

    def reset(self):
        self.current_shard = 0
        self.tokens = load_tokens(self.shards[self.current_shard])
        self.current_position = self.B * self.T * self.process_rank

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        x = (buf[:-1]).view(B, T)
        y = (buf[1:]).view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.shards)
            self.tokens = load_tokens(self.shards[self.current_shard])
            self.current_position = B * T * self.process_rank
        return x, y


# -------------------------------------------------------------------------------- timm's EMA
class ModelEmaV3(torch.nn.Module):
    """timm.utils.ModelEmaV3's shape: a deep copy of the model, lerped towards it under no_grad."""

    def __init__(self, model, decay=0.9):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.lerp_(m, 1.0 - self.decay)
            else:
                e.copy_(m)


if args.scenario == "nanogpt":
    V, B, T, ACCUM, MAX_STEPS = 64, 2, 8, 2, 14
    model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Linear(16, V))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_loader = DataLoaderLite(B=B, T=T, process_rank=0, num_processes=1, split="train")
    ckpt = DriveCheckpoint(args.run, model=model, optimizer=optimizer, every="epoch", quiet=True)
    if not args.unregistered:
        ckpt.register("loader", train_loader)
    watch_unregistered(ckpt)
    losses = []
    for step in ckpt.epochs(MAX_STEPS):
        optimizer.zero_grad()
        loss_accum = 0.0
        for micro_step in range(ACCUM):
            x, y = train_loader.next_batch()
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, V), y.view(-1)) / ACCUM
            loss_accum += loss.detach()
            loss.backward()
            if step == args.kill_at:
                kill_now(ckpt)
        optimizer.step()
        losses.append(float(loss_accum))
        print(f"STEP {step} shard {train_loader.current_shard} position {train_loader.current_position}",
              flush=True)
    final = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "loader": {k: getattr(train_loader, k) for k in ("current_shard", "current_position", "tokens")}}
else:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    teacher = torch.nn.Linear(8, 3).eval().requires_grad_(False)  # frozen: never changes
    criterion = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))  # a weight buffer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model_ema = ModelEmaV3(model)
    ckpt = DriveCheckpoint(args.run, model=model, optimizer=optimizer, every=2, quiet=True)
    if not args.unregistered:
        ckpt.register("model_ema", model_ema)
    watch_unregistered(ckpt)
    for epoch in ckpt.epochs(3):
        for x, y in ckpt.batches(loader):
            if ckpt.step == args.kill_at:
                kill_now(ckpt)
            out = model(x)
            loss = criterion(out, y) + torch.nn.functional.mse_loss(out, teacher(x))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model_ema.update(model)
            print(f"STEP {ckpt.step}", flush=True)
    final = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ema": model_ema.state_dict()}
torch.save(final, args.out)
print("DONE", flush=True)

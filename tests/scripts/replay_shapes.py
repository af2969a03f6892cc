"""One training per loader shape, with keepalive (``--run``) or without it (``--plain``): the child of
tests/test_data_replay.py. Each shape draws randomness where that shape's loader draws it (the global
generator, a ``generator=``, a sampler's private generator, workers' augmentation), the model has
dropout; ``--kill-after-steps K`` SIGKILLs the process in its K-th optimizer step of this session,
after the newest save is committed. The final weights go to ``--out``.

Shapes: ``weighted`` (WeightedRandomSampler, replacement, global RNG), ``subclass`` (a DataLoader
subclass whose ``__iter__`` post-processes ``super().__iter__()``), ``generator`` (``shuffle=True,
generator=g``, 2 workers drawing augmentation), ``custom`` (a sampler shuffling with its own
``np.random.Generator``), ``stateful`` (torchdata's StatefulDataLoader, shuffled), ``stream`` (a Hugging Face
``datasets.IterableDataset`` streamed from 4 shards through a plain DataLoader, noise added by the
collate function).
"""
import argparse
import os
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F
from childio import emit
from torch.utils.data import DataLoader, Sampler, WeightedRandomSampler
from toydata import NoisyIndexed

p = argparse.ArgumentParser()
p.add_argument("--shape", required=True)
p.add_argument("--run", default=None)
p.add_argument("--plain", action="store_true", help="the same training without keepalive")
p.add_argument("--out", required=True)
p.add_argument("--every", default="3")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--seed", type=int, default=1234)
p.add_argument("--kill-after-steps", type=int, default=None)
p.add_argument("--control", default=None, choices=["no-replay"],
               help="no-replay: the resumed epoch's loader starts from the saved step's random state")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(args.seed)
np.random.seed(args.seed)

N, DIM, CLASSES, BATCH = 80, 12, 3, 8


class ShuffledFromOwnRng(Sampler):
    """A custom sampler (as in Kaggle kernels): a permutation from its own numpy generator."""

    def __init__(self, n):
        self.n = n
        self.rng = np.random.default_rng(7)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


class CountingEpochs(Sampler):
    """A custom sampler that counts its passes and shuffles from the count (as Accelerate's does)."""

    def __init__(self, n):
        self.n, self.passes = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        self.passes += 1
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes)).tolist())


class Doubling(DataLoader):
    """A DataLoader subclass that post-processes its batches (what device / collate helpers do)."""

    def __iter__(self):
        for x, y, i in super().__iter__():
            yield x * 2.0, y, i


def loader_for(shape):
    ds = NoisyIndexed(N, DIM, CLASSES, seed=3)
    if shape == "weighted":
        w = torch.linspace(0.5, 2.0, N)
        return DataLoader(ds, batch_size=BATCH, sampler=WeightedRandomSampler(w, N, replacement=True))
    if shape == "subclass":
        return Doubling(ds, batch_size=BATCH, shuffle=True)
    if shape == "generator":
        return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2,
                          generator=torch.Generator().manual_seed(5))
    if shape == "custom":
        return DataLoader(ds, batch_size=BATCH, sampler=ShuffledFromOwnRng(N))
    if shape == "counting":
        return DataLoader(ds, batch_size=BATCH, sampler=CountingEpochs(N))
    if shape == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True)
    if shape == "stream":
        import datasets

        g = torch.Generator().manual_seed(3)
        table = datasets.Dataset.from_dict({"x": torch.randn(N, DIM, generator=g).tolist(),
                                            "y": torch.randint(0, CLASSES, (N,), generator=g).tolist(),
                                            "i": list(range(N))})
        stream = table.to_iterable_dataset(num_shards=4).with_format("torch")

        def collate(rows):
            x = torch.stack([r["x"] for r in rows]).float()
            return x + 0.05 * torch.randn_like(x), torch.stack([r["y"] for r in rows]), \
                torch.stack([r["i"] for r in rows])

        return DataLoader(stream, batch_size=BATCH, collate_fn=collate)
    raise SystemExit(f"unknown shape {shape}")


model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, CLASSES))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = loader_for(args.shape)
steps = 0


def train(x, y):
    global steps
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    steps += 1
    emit(f"STEP {steps}")


if args.plain:
    for epoch in range(args.epochs):
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        for x, y, _ in loader:
            train(x, y)
else:
    from keepalive.callbacks.torch import DriveCheckpoint

    ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, every=args.every, keep=None)
    ckpt.core.on_commit.append(lambda result: emit(f"COMMITTED {result.info.step}"))
    if args.control == "no-replay":
        ckpt.resume()
        ckpt._saved_data.pop("epoch_rng", None)
        for stream in (ckpt._saved_data.get("streams") or {}).values():
            stream["at_iter"] = None
            stream.pop("state", None)
    for epoch in ckpt.epochs(args.epochs):
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        for x, y, _ in ckpt.batches(loader):
            if steps == args.kill_after_steps:
                ckpt.flush()
                emit("KILL")
                os.kill(os.getpid(), signal.SIGKILL)
            train(x, y)
    if not ckpt.finished:
        sys.exit(3)
torch.save(model.state_dict(), args.out)
emit("DONE")

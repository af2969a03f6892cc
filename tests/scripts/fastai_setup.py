"""A tiny fastai training that depends on every RNG a real one does (shared by the fastai tests).

Synthetic 3x16x16 "images" in 4 classes; each fetch adds random noise (augmentation: python, numpy or
torch RNG, in the main process or in DataLoader workers), batch transforms add more noise in the main
process, the model has dropout and batch norm, the training loader shuffles. A splitter gives two
parameter groups so ``freeze()`` / ``fine_tune`` work. No torchvision needed (fast to import).
"""
from __future__ import annotations

import random

import numpy as np
import torch
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.torch_core import params, set_seed
from torch import nn


class PlainNoisyImages(torch.utils.data.Dataset):
    """Without ``n_inp``: fastai fetches (and augments) one item lazily to learn the batch layout."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        centers = torch.randn(4, 3, 16, 16, generator=g)
        self.x = centers[self.y] + 0.8 * torch.randn(n, 3, 16, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        # augmentation drawing from all three global RNGs
        shift = random.random() * 0.1 + float(np.random.rand()) * 0.1
        return self.x[i] + 0.1 * torch.randn(3, 16, 16) + shift, self.y[i]


class NoisyImages(PlainNoisyImages):
    n_inp = 1  # tells fastai the batch layout


def batch_noise(t):
    """A batch transform (fastai applies it to each element of the batch tuple) in the main process."""
    return t + 0.05 * torch.randn_like(t) if t.is_floating_point() else t


class Net(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width // 2, 3, padding=1), nn.BatchNorm2d(width // 2),
                                  nn.ReLU(), nn.Conv2d(width // 2, width, 3, padding=1, stride=2), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x):
        return self.head(self.body(x))


def splitter(m: Net):
    return [params(m.body), params(m.head)]


def make_learner(seed: int = 42, n_train: int = 96, n_valid: int = 32, bs: int = 16, workers: int = 0,
                 width: int = 16, hidden: int = 32, cbs=None, dataset=None, **kwargs) -> Learner:
    set_seed(seed)
    torch.set_num_threads(1)
    ds = dataset or NoisyImages
    dls = DataLoaders.from_dsets(ds(n_train, 1), ds(n_valid, 2), bs=bs,
                                 num_workers=workers, device="cpu", after_batch=batch_noise)
    kwargs.setdefault("splitter", splitter)
    return Learner(dls, Net(width, hidden), loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cbs,
                   **kwargs)


def weights(learn: Learner) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in learn.model.state_dict().items()}


def history(learn: Learner) -> dict:
    rec = learn.recorder
    return {"values": [[float(x) for x in v] for v in rec.values],
            "losses": [float(x) for x in rec.losses], "lrs": [float(x) for x in rec.lrs],
            "iters": list(rec.iters)}

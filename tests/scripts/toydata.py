"""Small synthetic datasets the crash children train on (no download, the same data in every process)."""
import torch
from torch.utils.data import Dataset


class NoisyIndexed(Dataset):
    """``n`` fixed inputs and labels (from ``seed``); an item is (input + fresh noise, label, its index):
    the noise draws from the global RNG, so a resume that restores it wrongly shows in the result, and
    the index says which samples a batch held."""

    def __init__(self, n: int, dim: int, classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.dim = dim

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(self.dim), self.y[i], i
